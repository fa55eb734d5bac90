"""Cancellation through an ensemble, without Triton.

When a client cancels an ensemble request, Triton (2.51) cancels the ensemble's
*next* step requests, never a step already in flight — and the engine step
(``decode`` or ``llm``) is in flight for the whole generation, so its
``request.is_cancelled()`` stays false. Its responses still flow into the next
step, ``postprocess``, whose requests then are cancelled. So every engine reply
carries a cancel token, and postprocess, seeing a cancelled request, sends the
token back to the engine model, which aborts the sequence:

- the engine model's :class:`CancelListener` binds a datagram socket in Linux's
  abstract namespace, named after the server (the stubs' parent pid), the model
  instance and the version, so two servers or two loaded versions never mix;
- a token is ``<endpoint>/<nonce>``, the nonce 128 random bits: knowing a
  sequence's token is the only way to cancel it;
- :func:`send_cancel` checks the token's shape before sending anything, and the
  listener acts only on a nonce it handed out; anything else is dropped.

>>> got = []
>>> listener = CancelListener("llm_0_0.1", got.append, server_pid=1)  # doctest: +SKIP
>>> nonce, token = listener.new_token()                             # doctest: +SKIP
>>> send_cancel(token, server_pid=1)                                # doctest: +SKIP
True
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
from typing import Callable

log = logging.getLogger(__name__)

CANCEL_TOKEN = "cancel_token"      # BYTES [1, 1] output of llm/decode, input of postprocess
_ENDPOINT = re.compile(r"[A-Za-z0-9_.-]{1,80}")
_TOKEN = re.compile(rb"([A-Za-z0-9_.-]{1,80})/([0-9a-f]{32})")
_NONCE = re.compile(rb"[0-9a-f]{32}")


def address(endpoint: str, server_pid: int | None = None) -> str:
    """The listener's abstract socket name (leading NUL: no file, gone with the process)."""
    return f"\0tandem-cancel-{server_pid or os.getppid()}-{endpoint}"


class CancelListener:
    """Receives cancel requests for one engine model instance's sequences.

    ``on_cancel(nonce)`` runs on the listener's thread, which blocks in ``recv``
    (no CPU while idle).
    """

    def __init__(self, endpoint: str, on_cancel: Callable[[str], None], server_pid: int | None = None):
        if not _ENDPOINT.fullmatch(endpoint):
            raise ValueError(f"cancel endpoint {endpoint!r}; allowed: 1-80 of [A-Za-z0-9_.-]")
        self.endpoint = endpoint
        self._on_cancel = on_cancel
        self._address = address(endpoint, server_pid)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self._address)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="tandem-cancel-listen", daemon=True)
        self._thread.start()

    def new_token(self) -> tuple[str, bytes]:
        """A fresh ``(nonce, token)`` for one sequence."""
        nonce = secrets.token_hex(16)
        return nonce, f"{self.endpoint}/{nonce}".encode()

    def _run(self) -> None:
        while True:
            try:
                data = self._sock.recv(64)
            except OSError:
                return
            if self._closing:
                return
            if not _NONCE.fullmatch(data):
                log.warning("cancel listener %s: dropped a malformed message (%d bytes)", self.endpoint, len(data))
                continue
            try:
                self._on_cancel(data.decode())
            except Exception:
                log.exception("cancel listener %s: cancel callback failed", self.endpoint)

    def close(self) -> None:
        self._closing = True
        try:  # wake the blocked recv
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(b"", self._address)
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._sock.close()


def is_token(token: bytes) -> bool:
    """Whether ``token`` has a cancel token's shape (``<endpoint>/<32 hex digits>``).

    >>> is_token(b"decode_0.1.42/" + b"0" * 32), is_token(b"../x")
    (True, False)
    """
    return _TOKEN.fullmatch(token) is not None


def send_cancel(token: bytes, server_pid: int | None = None) -> bool:
    """Ask the engine model that issued ``token`` to cancel its sequence; False when the
    token is malformed or no listener answers at its address."""
    m = _TOKEN.fullmatch(bytes(token))
    if m is None:
        return False
    endpoint, nonce = m.group(1).decode(), m.group(2)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(nonce, address(endpoint, server_pid))
    except OSError:
        return False
    return True
