"""``--api-key``: the OpenAI API's ``/v1/*`` routes answer only a request that carries
``Authorization: Bearer <key>`` (vLLM's ``--api-key`` convention); ``/health`` and
``/metrics`` stay open for probes and scrapers.

A missing or wrong key gets 401 in OpenAI's error JSON (``code: invalid_api_key``, as
OpenAI's own API answers), with ``WWW-Authenticate: Bearer``. The comparison takes the
same time however much of the key matches (``hmac.compare_digest``), and the key is
never logged or echoed.

>>> bearer_token([(b"authorization", b"Bearer sk-1")]), bearer_token([(b"authorization", b"Basic x")])
(b'sk-1', None)
"""
from __future__ import annotations

import hmac
import json

PROTECTED_PREFIX = "/v1/"
UNAUTHORIZED = json.dumps({"error": {
    "message": "Incorrect or missing API key: send it as 'Authorization: Bearer <key>' (the server's --api-key)",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an ``Authorization: Bearer`` header (the scheme case-insensitive), or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


class ApiKeyMiddleware:
    """Refuses ``/v1/*`` requests without the key (pure ASGI: before any route runs, so
    an unauthenticated request reaches neither the body parser nor tritonserver)."""

    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("api_key: empty; leave --api-key unset to serve without one")
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            token = bearer_token(scope.get("headers", []))
            if token is None or not hmac.compare_digest(token, self._key):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer"),
                                        (b"content-length", str(len(UNAUTHORIZED)).encode())]})
                await send({"type": "http.response.body", "body": UNAUTHORIZED})
                return
        await self.app(scope, receive, send)
