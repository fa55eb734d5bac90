"""Triton's control APIs locked to ``--admin-key``: an unauthenticated unload (HTTP or
gRPC) is refused and leaves the model serving; with the key a version roll (a load)
works; inference never needs the key; and a server bound beyond loopback without a key
makes one (admin_key.py, the unit tests: test_serve_admin_key.py)."""
from __future__ import annotations

import pytest

from tandem.client.generate import stream_generate

from .servers import served
from .triton_calls import load_model

pytestmark = pytest.mark.e2e

KEY = "test-admin-key-0123456789"
GRPC_HEADER = "triton-grpc-protocol-admin-key"   # Triton 2.51 prefixes gRPC's restriction header


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("admin"), admin_key=KEY, mode="colocated", max_num_seqs=2) as srv:
        yield srv


def generate(server) -> str:
    return "".join(r.text for r in stream_generate(server.grpc_url, "def f(x):", model="tandem_colocated",
                                                   max_tokens=8, temperature=0.0))


def test_without_the_key_the_repository_api_is_refused_over_http_and_grpc(server):
    from tritonclient.grpc import InferenceServerClient
    from tritonclient.utils import InferenceServerException
    refused = load_model(server, "llm", action="unload")
    assert isinstance(refused, str) and refused.startswith("4"), refused
    assert load_model(server, "llm", action="unload", headers={"admin-key": "wrong-key-0123456789"}) != 200
    with InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException):
            client.unload_model("llm")
        with pytest.raises(InferenceServerException):
            client.get_model_repository_index()
        assert client.is_model_ready("llm") and client.is_server_ready()
    assert generate(server)


def test_with_the_key_a_roll_works_and_the_servers_own_calls_carry_it(server):
    from tritonclient.grpc import InferenceServerClient
    assert load_model(server, "postprocess", headers={"admin-key": KEY}) == 200
    with InferenceServerClient(server.grpc_url) as client:
        index = client.get_model_repository_index(headers={GRPC_HEADER: KEY})
        assert {m.name for m in index.models} >= {"llm", "tandem_colocated"}
    assert "llm" in server.http.index()       # the supervisor's and drain's client sends it
    assert generate(server)


def test_an_operators_unload_makes_the_server_not_ready_until_the_model_is_back(server):
    """With the key only an operator can unload a model: the supervisor does not undo it,
    but the server stops answering ready (Triton alone would keep answering 200 while
    every request fails) until the model is loaded again."""
    from .triton_calls import eventually, http_get
    assert load_model(server, "llm", action="unload", headers={"admin-key": KEY}) == 200
    def ready(expected: bool):
        def check():
            assert (http_get(f"http://{server.http_url}/v2/health/ready")[0] == 200) is expected
        return check
    def held():   # the unload done, the marker that keeps the server not ready loaded (and failed)
        index = server.http.index()
        assert index["llm"][0] == "UNAVAILABLE" and "operator_unloaded_a_model" in index, index
    eventually(held)
    ready(False)()
    index = server.http.index()   # the ensembles on llm went with it: every one comes back
    for model in sorted((m for m in server.options.models if index[m][0] == "UNAVAILABLE"),
                        key=lambda m: m in server.options.ensembles):
        assert load_model(server, model, headers={"admin-key": KEY}) == 200
    eventually(ready(True))
    assert generate(server)
