"""``tandem serve --tp 2`` on a real tritonserver. Colocated: the llm stub splits the demo
target with a rank process it starts, and the greedy text through the
``tandem_colocated`` ensemble is the one-rank offline engine's; the rank SIGKILLed, the
next request fails, the stub exits (its engine cannot serve), readiness drops, the
supervisor restarts the model with a new rank, and the text is right again; stopping
the server leaves no rank behind. Disaggregated, through the ``tandem`` ensemble: prefill
at 2 ranks feeds decode at 1 (each page rebuilt from the prefill ranks' halves), and both
at 2 (rank to rank), and the text is the same; a killed prefill rank or decode rank
restarts its model. (Lossless speculation makes the draft case's text the reference's.)
Every server serves a LoRA adapter too (each rank holds its share of it): its text at 2
ranks, colocated, and through prefill and decode at their splits, is the one-rank
offline engine's with the adapter."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tandem.client.generate import stream_generate
from tandem.client.serve.triton_server import stub_processes

from .triton_calls import eventually, metric, metric_reaches

pytestmark = pytest.mark.e2e
SETTINGS = dict(max_num_seqs=8, page_size=4)
PROMPT, MAX_TOKENS = "def fibonacci(n):\n    ", 12
ENSEMBLE = "tandem_colocated"
LORA = dict(max_loras=1, max_lora_rank=8)


def ranks_of(pid: int) -> list[int]:
    """The tensor-parallel rank processes a stub started (multiprocessing's spawned
    children; its resource tracker is not one)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and "spawn_main" in cmdline:
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.fixture(scope="module")
def adapter(demo_checkpoint, tmp_path_factory) -> Path:
    from ..unit.lora.adapters import make_adapter
    return make_adapter(demo_checkpoint, tmp_path_factory.mktemp("tp-adapter") / "a", seed=1, std=0.3)


@pytest.fixture(scope="module")
def lora_settings(adapter, tmp_path_factory) -> dict:
    """A server's LoRA settings: adapter "a" in its registry (as --lora-modules a=DIR)."""
    from tandem.backends.triton.lora_registry import AdapterRegistry
    registry = tmp_path_factory.mktemp("tp-loras")
    AdapterRegistry(registry).add("a", str(adapter))
    return dict(LORA, lora_dir=str(registry))


@pytest.fixture(scope="module")
def lora_reference(offline_llm, adapter) -> str:
    from tandem.backends import SamplingParams
    from tandem.backends.lora import LoRARequest
    llm = offline_llm(**LORA, **SETTINGS)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    out = llm.generate(PROMPT, greedy, lora=LoRARequest("a", 1, str(adapter)))[0].text
    assert out != llm.generate(PROMPT, greedy)[0].text, "the adapter changes the text"
    return out


@pytest.fixture(scope="module")
def server(serve, lora_settings):
    with serve("serve-tp", 300, mode="colocated", tensor_parallel_size=2, torch_threads=2, **SETTINGS,
               **lora_settings) as srv:
        yield srv
        ranks = [r for s in srv.stubs() if s.model == "llm" for r in ranks_of(s.pid)]
        srv.stop()
        assert stub_processes(srv.run_dir) == []
        eventually(lambda: not any(alive(r) for r in ranks), timeout_s=30)


@pytest.fixture(scope="module")
def reference(greedy_reference):
    return greedy_reference(MAX_TOKENS, **SETTINGS)(PROMPT).text


def text(server, ensemble: str = ENSEMBLE, **params) -> str:
    rs = list(stream_generate(server.grpc_url, PROMPT, model=ensemble, timeout_s=60, max_tokens=MAX_TOKENS,
                              temperature=0.0, stream=True, **params))
    return "".join(r.text for r in rs)


def stub_of(server, model: str = "llm"):
    """The live stub of ``model`` (None between its death and its restart)."""
    return next((s for s in server.stubs() if s.model == model), None)


def test_two_ranks_serve_the_one_rank_engines_text(server, reference):
    stub = stub_of(server)
    assert len(ranks_of(stub.pid)) == 1, "the llm stub started one rank process"
    assert text(server) == reference


def test_an_adapter_on_two_ranks_serves_the_one_rank_engines_text(server, lora_reference, reference):
    assert text(server, lora_name="a") == lora_reference
    assert text(server) == reference, "the base beside it is untouched"


def kill_a_rank_and_recover(server, model: str, ensemble: str, reference: str, fails: bool = True) -> None:
    """SIGKILL ``model``'s rank: the next request fails (``fails``; else it is still
    served), the stub exits and is restarted with a new rank, and the text is right
    again."""
    stub = stub_of(server, model)
    (rank,) = ranks_of(stub.pid)
    os.kill(rank, 9)
    if fails:
        with pytest.raises(Exception):     # the engine stops: this request ends with an error
            text(server, ensemble)
    else:
        assert text(server, ensemble) == reference

    def restarted():
        new = stub_of(server, model)
        assert new is not None and new.pid != stub.pid and len(ranks_of(new.pid)) == 1
    eventually(restarted, timeout_s=180)
    server.wait_model_ready(ensemble, timeout_s=180)
    deadline = time.monotonic() + 120
    while True:
        try:
            if text(server, ensemble) == reference:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the restarted model never served the right text"
        time.sleep(0.5)
    assert not alive(rank) and not alive(stub.pid)


def test_a_killed_rank_restarts_the_model_with_a_new_group(server, reference):
    kill_a_rank_and_recover(server, "llm", ENSEMBLE, reference)


SPLITS = {"prefill-2-decode-1": dict(prefill_tensor_parallel_size=2, decode_tensor_parallel_size=1),
          "tp-2-draft": dict(tensor_parallel_size=2, spec_method="draft_target")}


@pytest.fixture(scope="module", params=list(SPLITS))
def disaggregated(serve, demo_checkpoint, lora_settings, request):
    """Prefill at 2 ranks feeding decode at 1 (each page rebuilt from the two prefill
    ranks' halves), and both at 2 (``--tp 2``: rank to rank) speculating with a draft
    model (the checkpoint itself: it runs whole on rank 0 of each side, its KV sent whole
    between them): every prompt through the prefill process (``--disagg-policy remote``)."""
    split = SPLITS[request.param]
    draft = dict(draft_model=str(demo_checkpoint)) if split.get("spec_method") == "draft_target" else {}
    with serve(f"serve-tp-{request.param}", 300, mode="disaggregated", torch_threads=2, disagg_policy="remote",
               **split, **draft, **SETTINGS, **lora_settings) as srv:
        yield srv, request.param
        ranks = [r for s in srv.stubs() if s.model in ("decode", "prefill") for r in ranks_of(s.pid)]
        srv.stop()
        assert stub_processes(srv.run_dir) == [] and srv.owned_segments() == []
        eventually(lambda: not any(alive(r) for r in ranks), timeout_s=30)


def remote_text(server, **params) -> str:
    return text(server, "tandem", **params)


def test_prefill_and_decode_ranks_serve_the_one_rank_engines_text(disaggregated, reference):
    disaggregated, split = disaggregated[0], SPLITS[disaggregated[1]]
    decode_tp = split.get("decode_tensor_parallel_size") or split["tensor_parallel_size"]
    assert len(ranks_of(stub_of(disaggregated, "prefill").pid)) == 1, "the prefill stub started one rank process"
    assert len(ranks_of(stub_of(disaggregated, "decode").pid)) == decode_tp - 1
    before = metric(disaggregated, "tandem_disagg_requests_total", "kv_transfer", path="remote", reason="policy")
    assert remote_text(disaggregated) == reference
    metric_reaches(disaggregated, "tandem_disagg_requests_total", "kv_transfer", before + 1,
                   "the prompt was not prefilled by the prefill process", path="remote", reason="policy")
    if split.get("spec_method") == "draft_target":
        metric_reaches(disaggregated, "tandem_spec_drafts_total", "decode", 1, "decode never drafted")


def test_an_adapters_prompt_is_prefilled_and_decoded_under_it_at_each_split(disaggregated, lora_reference):
    disaggregated = disaggregated[0]
    before = metric(disaggregated, "tandem_disagg_requests_total", "kv_transfer", path="remote", reason="policy")
    assert remote_text(disaggregated, lora_name="a") == lora_reference
    metric_reaches(disaggregated, "tandem_disagg_requests_total", "kv_transfer", before + 1,
                   "the prompt was not prefilled by the prefill process", path="remote", reason="policy")


def test_a_killed_rank_restarts_its_model(disaggregated, reference):
    """Prefill at 2 ranks: its rank killed, the prefill stub exits at its next job and is
    restarted with a new rank (the prompt meanwhile prefilled in decode: still the right
    text). Both at 2: decode's rank killed, as in the colocated case."""
    disaggregated, split = disaggregated
    if split == "tp-2-draft":
        return kill_a_rank_and_recover(disaggregated, "decode", "tandem", reference)
    kill_a_rank_and_recover(disaggregated, "prefill", "tandem", reference, fails=False)
    before = metric(disaggregated, "tandem_disagg_requests_total", "kv_transfer", path="remote", reason="policy")

    def prefilled_by_the_new_ranks():   # (until the restarted prefill takes jobs, decode prefills)
        assert remote_text(disaggregated) == reference
        assert metric(disaggregated, "tandem_disagg_requests_total", "kv_transfer", path="remote",
                      reason="policy") > before, "no prompt went to the restarted prefill"
    eventually(prefilled_by_the_new_ranks, timeout_s=120)
