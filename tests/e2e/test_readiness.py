"""Readiness that tells the truth: on a server whose repository API is open (loopback, no
--admin-key), a model unloaded through it is loaded again by the supervisor, and the
server serves again (Triton alone keeps answering ready while every request fails).
The locked case: test_admin_key.py."""
from __future__ import annotations

import pytest

from tandem.client.generate import stream_generate

from .servers import served
from .triton_calls import eventually, http_get, load_model

pytestmark = pytest.mark.e2e


def test_an_unloaded_engine_model_is_loaded_again(tmp_path):
    with served(tmp_path, mode="colocated", max_num_seqs=2) as server:
        assert load_model(server, "llm", action="unload") == 200
        def back():
            index = server.http.index()
            assert index["llm"][0] == index["tandem_colocated"][0] == "READY", index
            assert http_get(f"http://{server.http_url}/v2/health/ready")[0] == 200
        eventually(back)
        text = "".join(r.text for r in stream_generate(server.grpc_url, "def f(x):", model="tandem_colocated",
                                                       max_tokens=4, temperature=0.0))
        assert text
