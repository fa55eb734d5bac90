"""Prefill and decode at different tensor-parallel splits on two "hosts" (network
namespaces joined by a veth pair, UCX held to TCP on it: see test_multi_host.py): prefill
at 1 rank, decode at 2 (each page the prefill server computes whole crosses the link cut
by KV head into the two decode ranks' pool files), and prefill at 2, decode at 1 (each
prefill rank's messenger sends its half of every page, rebuilt whole in decode's pool;
the decode server plans for them with --prefill-tp 2). The greedy text equals the
single-host engine's."""
from __future__ import annotations

import pytest

from .test_multi_host import BATCHED, GRPC, PAGE_SIZE, PROMPTS, Server, _serve
from .test_multi_host import link  # noqa: F401 - the veth pair, a fixture of this module too
from .triton_calls import eventually

pytestmark = pytest.mark.e2e


SPLITS = {"prefill-1-decode-2": (1, 2), "prefill-2-decode-1": (2, 1)}


@pytest.fixture(scope="module", params=list(SPLITS))
def servers(link, demo_checkpoint, tmp_path_factory, request):
    prefill_tp, decode_tp = SPLITS[request.param]
    started = []
    try:
        prefill = Server(link, "a", d := tmp_path_factory.mktemp("prefill-ns-tp"),
                         _serve(link, "a", d, mode="prefill", model=demo_checkpoint, spec="none", tp=prefill_tp,
                                threads=prefill_tp))
        started.append(prefill)
        decode = Server(link, "b", d := tmp_path_factory.mktemp("decode-ns-tp"),
                        _serve(link, "b", d, mode="disaggregated", model=demo_checkpoint, spec="none", tp=decode_tp,
                               prefill_tp=prefill_tp, threads=decode_tp,
                               prefill_endpoints=f"{link.addr['a']}:{GRPC}", disagg_policy="remote"))
        started.append(decode)
        for srv in started:
            srv.wait_ready()
        yield prefill, decode, request.param
    finally:
        for srv in reversed(started):
            srv.stop()


@pytest.fixture(scope="module")
def reference(greedy_reference):
    greedy = greedy_reference(10, page_size=PAGE_SIZE, max_num_batched_tokens=BATCHED)
    return {p: greedy(p).text for p in PROMPTS}


def test_prefill_and_decode_ranks_split_differently_across_hosts(servers, reference):
    prefill, decode, split = servers
    prefill_tp, decode_tp = SPLITS[split]
    for srv, model, tp in ((prefill, "prefill", prefill_tp), (decode, "decode", decode_tp)):
        config = (srv.run_dir / "model_repository" / model / "config.pbtxt").read_text()
        assert f'key: "tensor_parallel_size" value: {{ string_value: "{tp}" }}' in config
    for p in PROMPTS:
        status, out = decode.generate(p)
        assert status == 200, out
        assert out["text_output"] == p + reference[p]

    def counted():
        assert decode.metric("tandem_kv_received_bytes_total", "kv_transfer") > 0
        assert decode.metric("tandem_disagg_requests_total", "kv_transfer", path="remote",
                             reason="policy") >= len(PROMPTS)
    eventually(counted)
