"""A failure stays with the request that caused it: a request that makes a
step raise ends alone with the cause named, the others produce exactly the tokens
they would have produced without it; an engine whose thread fails says so."""
from __future__ import annotations

import threading

import pytest
import torch

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.engine import llm_engine, speculation
from tandem.backends.engine.async_engine import AsyncEngine, EngineStopped
from tandem.backends.engine.config import EngineConfig
from tandem.backends.engine.prefill_engine import PrefillEngine
from tandem.backends.engine.sampler import sample

from ..async_outputs import OutputCollector
from ..engine_runs import run_all
from ..tiny_checkpoints import make_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
POISON_SEED = 666   # a request with this seed makes every step it is in raise


@pytest.fixture(scope="module")
def draft_dir(checkpoint_root):
    return make_checkpoint("llama3_rope_tied", checkpoint_root)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (int(torch.randint(4, 30, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def poisoned(fn):
    """``fn`` that raises whenever the poisoned request is among the batch's params."""
    def wrapper(*args, **kwargs):
        params = next(a for a in args if isinstance(a, list) and a and isinstance(a[0], SamplingParams))
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("poisoned request")
        return fn(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("spec", [None, "draft_target"])
def test_a_request_that_breaks_the_step_ends_alone(target_dir, draft_dir, monkeypatch, spec):
    kw = {} if spec is None else {"speculative": SpeculativeConfig(spec, 3, draft_model=str(draft_dir))}
    ps = prompts(5)
    ref = LLM(target_dir, page_size=4, **kw).generate(ps, GREEDY)
    monkeypatch.setattr(llm_engine, "sample", poisoned(llm_engine.sample))
    monkeypatch.setattr(speculation, "verify_drafts", poisoned(speculation.verify_drafts))
    llm = LLM(target_dir, page_size=4, **kw)
    bad = SamplingParams(max_tokens=12, temperature=0.8, seed=POISON_SEED)
    params = [GREEDY, GREEDY, bad, GREEDY, GREEDY]
    seqs, finals = run_all(llm, ps, params)
    victim = finals[seqs[2].request_id]
    assert victim.finish_reason == "error"
    assert "RuntimeError: poisoned request" in victim.error
    assert "other requests were not affected" in victim.error
    for i in (0, 1, 3, 4):
        assert seqs[i].output_ids == ref[i].token_ids          # exactly as without it
        assert finals[seqs[i].request_id].finish_reason == "length"
    a = llm.engine.allocator
    assert a.num_free == a.num_pages                           # nothing leaked


def test_a_failure_while_appending_tokens_ends_that_request_alone(target_dir):
    ps = prompts(3, seed=1)
    ref = LLM(target_dir, page_size=4).generate(ps, GREEDY)
    llm = LLM(target_dir, page_size=4)
    seqs = [llm.engine.make_sequence(p, GREEDY) for p in ps]
    for s in seqs:
        llm.engine.add(s)

    def broken(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    llm.engine.outputs.detoks[seqs[1].request_id].add = broken
    finals = {}
    while llm.engine.has_unfinished():
        finals.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert finals[seqs[1].request_id].finish_reason == "error"
    assert "UnicodeDecodeError" in finals[seqs[1].request_id].error
    assert [seqs[0].output_ids, seqs[2].output_ids] == [ref[0].token_ids, ref[2].token_ids]


def test_a_subnormal_temperature_samples_greedily_next_to_greedy_streams(target_dir):
    ps = prompts(4, seed=2)
    ref = LLM(target_dir).generate(ps, GREEDY)
    tiny = SamplingParams(max_tokens=12, temperature=1e-45, ignore_eos=True)
    assert tiny.greedy
    outs = LLM(target_dir).generate(ps, [GREEDY, tiny, GREEDY, GREEDY])
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_never_reach_multinomial(bad):
    logits = torch.randn(3, 16)
    logits[1, 4] = bad
    params = [SamplingParams(temperature=0.7)] * 3
    with pytest.raises(FloatingPointError, match=r"row\(s\) \[1\]"):
        sample(logits, params, [0] * 3)


def test_a_failing_prefill_request_is_dropped_alone(target_dir, monkeypatch):
    ps = [p for p in prompts(4, seed=3) if len(p) > 2]
    eng = PrefillEngine.from_config(EngineConfig(str(target_dir), page_size=4))
    alone = {}
    for i, p in enumerate(ps):
        e = PrefillEngine.from_config(EngineConfig(str(target_dir), page_size=4))
        e.add(f"r{i}", p[:-1], p[-1])
        while e.has_work():
            for r in e.step():
                alone[r.request_id] = r.hidden
    forward = eng.runner.forward

    def poisoned_forward(batch, on_layer_done=None):
        if ps[1][:-1] in batch.token_ids:
            raise RuntimeError("poisoned prefill")
        return forward(batch, on_layer_done)
    monkeypatch.setattr(eng.runner, "forward", poisoned_forward)
    for i, p in enumerate(ps):
        eng.add(f"r{i}", p[:-1], p[-1])
    done = {}
    while eng.has_work():
        done.update({r.request_id: r.hidden for r in eng.step()})
    failed = eng.take_failed()
    assert [rid for rid, _ in failed] == ["r1"] and "poisoned prefill" in failed[0][1]
    assert sorted(done) == [f"r{i}" for i in range(len(ps)) if i != 1]
    for rid, hidden in done.items():
        torch.testing.assert_close(hidden, alone[rid])
        eng.release(rid)
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_an_engine_whose_loop_fails_ends_every_stream_unavailable_and_says_so(target_dir):
    eng = AsyncEngine(str(target_dir), page_size=4)
    fatal = threading.Event()
    eng.on_fatal = lambda exc: fatal.set()
    outs, done = [], threading.Event()

    def on_output(out):
        outs.append(out)
        if out.finished:
            done.set()

    def broken_step():
        raise RuntimeError("scheduler invariant broken")
    eng.engine.step = broken_step
    eng.submit([5, 6, 7], SamplingParams(max_tokens=50), on_output)
    eng.start()
    assert done.wait(30) and fatal.wait(30)
    assert outs[-1].finish_reason == "error" and outs[-1].error_code == "UNAVAILABLE"
    assert "RuntimeError: scheduler invariant broken" in outs[-1].error
    assert not eng.alive
    with pytest.raises(EngineStopped, match="retry later"):
        eng.submit([5, 6], SamplingParams(max_tokens=2), on_output)
    eng.shutdown()


def test_a_message_the_engine_cannot_take_ends_only_its_request(target_dir):
    """A request whose admission raises on the engine thread ends with an error of its
    own; an abort of it afterwards is a no-op; the next request runs as if alone."""
    eng = AsyncEngine(str(target_dir), page_size=4)
    add = eng.engine.add

    def add_or_refuse(seq):
        if seq.prompt_ids == [9, 9, 9]:
            raise RuntimeError("poisoned admission")
        add(seq)
    eng.engine.add = add_or_refuse
    on_output = OutputCollector()
    outs = on_output.outs
    eng.start()
    try:
        bad = eng.submit([9, 9, 9], GREEDY, on_output)
        eng.abort(bad)
        good = eng.submit([5, 6, 7], GREEDY, on_output)
        assert on_output.wait(2, timeout=30)
        assert eng.alive
    finally:
        eng.shutdown()
    (last,) = outs[bad]
    assert last.finish_reason == "error" and "could not be queued" in last.error
    assert "poisoned admission" in last.error
    assert outs[good][-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs[good]) == GREEDY.max_tokens


def test_the_engine_shows_its_counters_without_being_reached_into(target_dir, draft_dir):
    plain = AsyncEngine(str(target_dir), page_size=4, num_pages=24)
    assert plain.spec_metrics is None and plain.kv_pages == (24, 0)
    assert plain.scheduler.waiting is not None
    spec = SpeculativeConfig("draft_target", num_speculative_tokens=2, draft_model=str(draft_dir))
    speculating = AsyncEngine(str(target_dir), page_size=4, speculative=spec)
    assert speculating.spec_metrics.num_drafts == 0
