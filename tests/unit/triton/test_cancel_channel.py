"""The cancel channel (backends/triton/cancel_channel.py): tokens from postprocess back
to the engine model."""

from __future__ import annotations

import uuid

import pytest

from .model_calls import wait_for


def test_cancel_channel_delivers_only_issued_well_formed_tokens():
    from tandem.backends.triton.cancel_channel import CancelListener, send_cancel

    got = []
    pid = 10**9 + uuid.uuid4().int % 10**6      # no real server: a pid of our own
    listener = CancelListener("decode_0_0.1", got.append, server_pid=pid)
    try:
        nonce, token = listener.new_token()
        assert token == f"decode_0_0.1/{nonce}".encode() and len(nonce) == 32
        assert send_cancel(token, server_pid=pid)
        wait_for(lambda: got == [nonce])
        for bad in (b"", b"decode_0_0.1/xyz", b"../x/" + nonce.encode(), token + b"\n"):
            assert not send_cancel(bad, server_pid=pid)
        assert not send_cancel(token, server_pid=pid + 1)       # no listener there
        import socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:  # garbage is dropped
            s.sendto(b"\x00" * 40, f"\0tandem-cancel-{pid}-decode_0_0.1")
        assert send_cancel(token, server_pid=pid)
        wait_for(lambda: got == [nonce, nonce])
    finally:
        listener.close()
    with pytest.raises(ValueError, match="cancel endpoint"):
        CancelListener("a/b", got.append, server_pid=pid)
