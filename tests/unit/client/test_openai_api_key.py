"""``--api-key`` on the OpenAI API (client/openai/auth.py), against the ASGI app itself:
/v1/* needs the bearer key (401 in OpenAI's error JSON otherwise), /health and /metrics
stay open, and the key appears in no response. Through a served model and the `openai`
package: tests/e2e/test_openai_api.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from tandem.client.openai.app import create_app

KEY = "sk-tandem-test-0123456789"


def call(app, path: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    """One request through the ASGI app: (status, headers, body)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "server": ("127.0.0.1", 9000), "client": ("127.0.0.1", 5000),
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
             + [(b"content-type", b"application/json")]}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


@pytest.fixture(scope="module")
def app():
    return create_app("127.0.0.1:1", ["tandem"], api_key=KEY)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                                     {"Authorization": "Bearer "}])
@pytest.mark.parametrize("path,method", [("/v1/models", "GET"), ("/v1/completions", "POST"),
                                         ("/v1/chat/completions", "POST")])
def test_v1_without_the_key_is_401_in_openais_error_json(app, headers, path, method):
    status, head, body = call(app, path, headers, method)
    assert status == 401 and head["www-authenticate"] == "Bearer"
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
    assert KEY.encode() not in body


def test_the_key_opens_v1_and_probes_need_none(app):
    status, _, body = call(app, "/v1/models", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tandem"
    assert call(app, "/v1/models", {"authorization": f"bearer {KEY}"})[0] == 200   # the scheme: any case
    assert call(app, "/metrics")[0] == 200
    status, _, body = call(app, "/metrics")
    assert b'status="401"' in body   # refusals are counted


def test_no_key_means_open():
    assert call(create_app("127.0.0.1:1", ["tandem"]), "/v1/models")[0] == 200
