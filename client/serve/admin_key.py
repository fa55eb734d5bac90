"""The key that guards Triton's control APIs (``--admin-key``).

Triton 2.51 can restrict API groups to requests that carry a header with a given value
(``--http-restricted-api`` / ``--grpc-restricted-protocol``). ``tandem serve`` restricts the
groups that change or expose the server: the model repository (load, unload, index:
one unauthenticated unload would take the server down), shared memory, logging and
trace. Inference, health, metadata, statistics and model configs stay open.

A server bound beyond loopback is always locked: with no ``--admin-key`` it makes one,
written to ``<run dir>/admin-key`` (mode 0600). On loopback it is locked only when a key
is given. Clients send the key as the ``admin-key`` header over HTTP and as the
``triton-grpc-protocol-admin-key`` metadata over gRPC (Triton 2.51 prefixes the name there).

>>> restricted_api_args("s3cret")[0]
'--http-restricted-api=model-repository,shared-memory,logging,trace:admin-key=s3cret'
>>> needs_key("127.0.0.1"), needs_key("0.0.0.0")
(False, True)
"""
from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path

HEADER = "admin-key"
GRPC_HEADER = "triton-grpc-protocol-" + HEADER
RESTRICTED = ("model-repository", "shared-memory", "logging", "trace")
KEY_FILE = "admin-key"
# what a key may hold: Triton splits the flag at ':' and '=' and ',' separates API groups
_ALLOWED = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~+/")


class AdminKeyError(ValueError):
    """An ``--admin-key`` Triton could not carry in its restriction flag."""


def needs_key(host: str) -> bool:
    """Whether binding ``host`` exposes the server beyond this machine's loopback."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:    # a host name: assume it is reachable from elsewhere
        return True


def check_key(key: str) -> str:
    if len(key) < 16:
        raise AdminKeyError("--admin-key: use at least 16 characters")
    bad = sorted(set(key) - _ALLOWED)
    if bad:
        raise AdminKeyError(f"--admin-key: characters {''.join(bad)!r} are not allowed "
                            "(letters, digits and -_.~+/ only)")
    return key


def resolve_key(given: str, host: str, run_dir: Path) -> tuple[str, Path | None]:
    """The key the server runs with ("" for none) and the file a generated one went to."""
    if given:
        return check_key(given), None
    if not needs_key(host):
        return "", None
    key = secrets.token_urlsafe(24)
    path = Path(run_dir) / KEY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, path


def restricted_api_args(key: str) -> list[str]:
    """tritonserver's flags restricting the control APIs to ``key`` (none for "")."""
    if not key:
        return []
    spec = f"{','.join(RESTRICTED)}:{HEADER}={key}"
    return [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]
