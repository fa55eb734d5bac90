"""Prefill at 1 rank on one "host", decode at 2 tensor-parallel ranks on another (network
namespaces joined by a veth pair, UCX held to TCP on it: see test_multi_host.py): each
page the prefill server computes whole crosses the link cut by KV head into the two
decode ranks' pool files, and the greedy text equals the single-host engine's."""
from __future__ import annotations

import pytest

from .test_multi_host import BATCHED, GRPC, PAGE_SIZE, PROMPTS, Server, _serve
from .test_multi_host import link  # noqa: F401 - the veth pair, a fixture of this module too
from .triton_calls import eventually

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def servers(link, demo_checkpoint, tmp_path_factory):
    started = []
    try:
        prefill = Server(link, "a", d := tmp_path_factory.mktemp("prefill-ns-tp"),
                         _serve(link, "a", d, mode="prefill", model=demo_checkpoint, spec="none"))
        started.append(prefill)
        decode = Server(link, "b", d := tmp_path_factory.mktemp("decode-ns-tp"),
                        _serve(link, "b", d, mode="disaggregated", model=demo_checkpoint, spec="none", tp=2,
                               threads=2, prefill_endpoints=f"{link.addr['a']}:{GRPC}", disagg_policy="remote"))
        started.append(decode)
        for srv in started:
            srv.wait_ready()
        yield prefill, decode
    finally:
        for srv in reversed(started):
            srv.stop()


@pytest.fixture(scope="module")
def reference(greedy_reference):
    greedy = greedy_reference(10, page_size=PAGE_SIZE, max_num_batched_tokens=BATCHED)
    return {p: greedy(p).text for p in PROMPTS}


def test_one_prefill_rank_feeds_two_decode_ranks_across_hosts(servers, reference):
    _, decode = servers
    config = (decode.run_dir / "model_repository" / "decode" / "config.pbtxt").read_text()
    assert 'key: "tensor_parallel_size" value: { string_value: "2" }' in config
    for p in PROMPTS:
        status, out = decode.generate(p)
        assert status == 200, out
        assert out["text_output"] == p + reference[p]

    def counted():
        assert decode.metric("tandem_kv_received_bytes_total", "kv_transfer") > 0
        assert decode.metric("tandem_disagg_requests_total", "kv_transfer", path="remote",
                             reason="policy") >= len(PROMPTS)
    eventually(counted)
