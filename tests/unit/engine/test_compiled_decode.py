"""The CPU's compiled decode step (torch.compile, attention outside the graph): the same
hidden states, KV and greedy tokens as the eager step, which buckets it keeps given
warm-up timings, and the persistent compile cache it writes."""
from __future__ import annotations

import pytest
import torch

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.engine import config as engine_config
from tandem.backends.engine.compiled_decode import CompiledDecode, buckets_worth_compiling
from tandem.backends.engine.model_runner import ForwardBatch, ModelRunner
from tandem.backends.kv_cache import KVPagePool
from tandem.backends.models import load_model

from ..hf_reference import NEW_TOKENS, hf_greedy, prompts


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One inductor cache for the module: later compiles of a graph load it."""
    return str(tmp_path_factory.mktemp("inductor"))


@pytest.fixture
def compiler_on(monkeypatch):
    """Undo the test session's "no C++ compiler" (tests/conftest.py) for this test."""
    monkeypatch.setattr(engine_config, "cxx_compiler", lambda: "c++")


def _prefilled_pools(model, lens, page_size=4, num_pages=32, room=2):
    """Two pools holding the same prefill of random prompts of ``lens`` tokens, with
    pages for ``room`` more tokens each."""
    cfg = model.config
    pools = [KVPagePool.for_model(cfg, num_pages, page_size, torch.float32, "HND", "cpu")
             for _ in range(2)]
    g = torch.Generator().manual_seed(len(lens))
    lists, nxt = [], 0
    for n in lens:
        count = (n + room + page_size - 1) // page_size
        lists.append(list(range(nxt, nxt + count)))
        nxt += count
    prefill = ForwardBatch([torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lens],
                           [0] * len(lens), lists)
    for pool in pools:
        ModelRunner(model, pool).forward(prefill)
    return pools, lists


def test_compiled_step_equals_the_eager_step(tiny_checkpoint, compile_cache):
    """Batches of 1 (its own graph) and 3 (the dynamic one), two steps each: hidden
    states and every page's KV as the eager runner's, untouched pages untouched."""
    model = load_model(tiny_checkpoint, "float32")
    for lens in ([6], [6, 3, 13]):
        pools, lists = _prefilled_pools(model, lens)
        eager, compiled = ModelRunner(model, pools[0]), ModelRunner(model, pools[1])
        steps = CompiledDecode(compiled, buckets=[1, 2, 4], cache_dir=compile_cache)
        for step in range(2):
            batch = ForwardBatch([[11 + i + step] for i in range(len(lens))],
                                 [n + step for n in lens], lists)
            want = eager.forward(batch)[1]
            torch.testing.assert_close(steps.forward(batch), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pools[1].kv, pools[0].kv, atol=1e-5, rtol=1e-5)
        used = {p for pages in lists for p in pages}
        assert not pools[1].kv[:, [p for p in range(pools[1].num_pages) if p not in used]].any()


def test_steps_compiled_for_each_thread_count_do_not_recompile(tiny_checkpoint, compile_cache):
    """torch.compile guards on torch's thread count: decode borrowing the prefill side's
    core switches it (1 <-> 2), and a step at a count not compiled at start-up recompiled
    (~1 s on the demo, ~30 s on SmolLM2: a KV lease expired). compile_for_threads compiles
    each count at start-up; with recompiles turned into errors, both counts then run."""
    import torch._dynamo
    model = load_model(tiny_checkpoint, "float32")
    pools, lists = _prefilled_pools(model, [6, 3])
    steps = CompiledDecode(ModelRunner(model, pools[0]), buckets=[1, 2], cache_dir=compile_cache)
    steps.warm_up(scratch_page=31, measure=False)
    before = torch.get_num_threads()
    steps.compile_for_threads((1, 2), scratch_page=31)
    assert torch.get_num_threads() == before
    batch = ForwardBatch([[11], [12]], [6, 3], lists)
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for n in (1, 2, 1):
                torch.set_num_threads(n)
                steps.forward(batch)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("k", [1, 3])
def test_compiled_verify_step_equals_the_eager_step(tiny_checkpoint, compile_cache, k):
    """Verify batches (k + 1 tokens per sequence, the prefill wrapper's attention in the
    same opaque op) through the compiled graph: hidden states and KV as eager's; a ragged
    batch (sequences drafting fewer) too."""
    model = load_model(tiny_checkpoint, "float32")
    for lens in ([6], [6, 3, 13]):
        pools, lists = _prefilled_pools(model, lens, num_pages=48, room=k + 1)
        eager, compiled = ModelRunner(model, pools[0]), ModelRunner(model, pools[1])
        steps = CompiledDecode(compiled, buckets=[1, 2, 4], cache_dir=compile_cache, verify_ks=[k])
        widths = [k + 1 if i != 1 else 1 for i in range(len(lens))]   # row 1 drafts nothing
        batch = ForwardBatch([[11 + i + j for j in range(w)] for i, w in enumerate(widths)],
                             list(lens), lists)
        torch.testing.assert_close(steps.forward_verify(batch, k), eager.forward(batch)[1],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pools[1].kv, pools[0].kv, atol=1e-5, rtol=1e-5)
    assert steps.forward_verify(batch, k + 1) is None          # a k it was not given: eager
    steps.verify_compiled = set()                              # eager measured faster
    assert steps.forward_verify(batch, k) is None


def test_warm_up_times_and_decides_verify_steps(tiny_checkpoint, compile_cache):
    model = load_model(tiny_checkpoint, "float32")
    pool = KVPagePool.for_model(model.config, 8, 4, torch.float32, "HND", "cpu")
    steps = CompiledDecode(ModelRunner(model, pool), buckets=[1, 2], cache_dir=compile_cache,
                           verify_ks=[1, 3])
    warm = steps.warm_up(scratch_page=7, rounds=1, steps=1)
    assert sorted(warm.verify_timings) == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert set(warm.verify_compiled) == steps.verify_compiled == {
        key for key, (e, c) in warm.verify_timings.items() if c < 0.95 * e}
    assert not pool.kv[:, :7].any(), "warm-up wrote outside the scratch page"


def test_a_restart_keeps_the_earlier_warm_up_decision_and_measures_nothing(tiny_checkpoint, tmp_path,
                                                                           monkeypatch):
    """The same model, shapes, torch, threads and CPU: the second warm-up takes the first's
    decision and timings (and compiles only what it kept); other buckets measure again."""
    from tandem.backends.engine import compiled_decode
    model = load_model(tiny_checkpoint, "float32")
    pool = KVPagePool.for_model(model.config, 8, 4, torch.float32, "HND", "cpu")
    make = lambda buckets: CompiledDecode(ModelRunner(model, pool), buckets=buckets, cache_dir=str(tmp_path),
                                          verify_ks=[2])
    first = make([1, 2]).warm_up(scratch_page=7, rounds=1, steps=1)
    assert not first.remembered and sorted(first.timings) == [1, 2]
    timed = []
    monkeypatch.setattr(compiled_decode, "_ms_per_step", lambda fn, steps: timed.append(1) or 1.0)
    again = make([1, 2])
    second = again.warm_up(scratch_page=7, rounds=1, steps=1)
    assert second.remembered and timed == []
    assert (second.compiled, second.verify_compiled, second.timings, second.verify_timings) == \
        (first.compiled, first.verify_compiled, first.timings, first.verify_timings)
    assert again.compiled == first.compiled and again.verify_compiled == set(first.verify_compiled)
    other = make([1, 4]).warm_up(scratch_page=7, rounds=1, steps=1)
    assert not other.remembered and timed        # another key: measured


def test_the_default_cache_dir_survives_a_reboot(monkeypatch, tmp_path):
    """torch puts its own /tmp default into TORCHINDUCTOR_CACHE_DIR when inductor loads:
    that counts as unset (the cache goes under ~/.cache); a directory the user set is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    from tandem.backends.engine.compiled_decode import default_cache_dir
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_default())
    assert default_cache_dir() == str(tmp_path / "tandem" / "inductor")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert default_cache_dir() == str(tmp_path / "tandem" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == str(tmp_path / "mine")


def test_batches_it_does_not_take_run_eagerly(tiny_checkpoint, compile_cache):
    model = load_model(tiny_checkpoint, "float32")
    pool = KVPagePool.for_model(model.config, 16, 4, torch.float32, "HND", "cpu")
    steps = CompiledDecode(ModelRunner(model, pool), buckets=[1, 2], cache_dir=compile_cache)
    assert steps.forward(ForwardBatch([[5, 6]], [0], [[0]])) is None               # 2 new tokens
    assert steps.forward(ForwardBatch([[5]] * 3, [0] * 3, [[0], [1], [2]])) is None  # > all buckets
    steps.compiled = [2]                                                              # 1: eager faster
    assert steps.forward(ForwardBatch([[5]], [0], [[0]])) is None
    assert steps.forward(ForwardBatch([[5]] * 2, [0] * 2, [[0], [1]])) is not None


def test_buckets_kept_where_compiled_measured_faster():
    timings = {1: (5.0, 3.0), 2: (6.0, 4.0), 4: (8.0, 7.9), 8: (12.0, 13.0), 16: (20.0, 18.0)}
    assert buckets_worth_compiling(timings) == [1, 2, 16]        # 4: within the noise margin
    assert buckets_worth_compiling(timings, margin=1.0) == [1, 2, 4, 16]
    assert buckets_worth_compiling({}) == []


def test_warm_up_times_every_bucket_and_decides(tiny_checkpoint, compile_cache):
    model = load_model(tiny_checkpoint, "float32")
    pool = KVPagePool.for_model(model.config, 8, 4, torch.float32, "HND", "cpu")
    steps = CompiledDecode(ModelRunner(model, pool), buckets=[1, 2, 4], cache_dir=compile_cache)
    warm = steps.warm_up(scratch_page=7, rounds=1, steps=1)
    assert sorted(warm.timings) == [1, 2, 4] and steps.compiled == warm.compiled
    assert warm.compiled == buckets_worth_compiling(warm.timings)
    assert not pool.kv[:, :7].any(), "warm-up wrote outside the scratch page"


def test_a_failing_compile_leaves_the_engine_eager(tiny_checkpoint, compile_cache):
    model = load_model(tiny_checkpoint, "float32")
    pool = KVPagePool.for_model(model.config, 8, 4, torch.float32, "HND", "cpu")
    steps = CompiledDecode(ModelRunner(model, pool), buckets=[1, 2], cache_dir=compile_cache)

    def broken(*args):
        raise ImportError("c2av.main.so: file too short")   # a cache entry torn by a kill
    steps.step = broken
    assert steps.warm_up(scratch_page=7).compiled == []
    assert steps.forward(ForwardBatch([[5]], [0], [[0]])) is None


START = """
import sys, torch
from torch._dynamo.utils import counters
from tandem.backends.engine.compiled_decode import CompiledDecode
from tandem.backends.engine.model_runner import ModelRunner
from tandem.backends.kv_cache import KVPagePool
from tandem.backends.models import load_model
model = load_model(sys.argv[1], "float32")
pool = KVPagePool.for_model(model.config, 2, 4, torch.float32, "HND", "cpu")
CompiledDecode(ModelRunner(model, pool), [1, 2], cache_dir=sys.argv[2]).warm_up(1, measure=False)
print(counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"])
"""


def test_a_restart_loads_the_compiled_graphs_from_the_cache_dir(target_dir, tmp_path):
    """Two starts in fresh processes: the first compiles both graphs (batch 1 and the
    dynamic one) into ``cache_dir``, the second loads them from there."""
    import subprocess
    import sys
    starts = [subprocess.run([sys.executable, "-c", START, str(target_dir), str(tmp_path)],
                             capture_output=True, text=True, check=True).stdout.split()[-2:]
              for _ in range(2)]
    assert starts == [["2", "0"], ["0", "2"]]
    assert any((tmp_path / "fxgraph").rglob("*")), "inductor's FX graph cache is not in cache_dir"


@pytest.mark.parametrize("spec", [None, "draft_target", "adaptive_auto"])
def test_engine_with_compiled_decode_matches_hf(tiny_checkpoint, compile_cache, compiler_on, spec):
    """Greedy tokens, fp32, every decode bucket compiled: exactly HF's (a shrinking batch
    crosses buckets 8, 4, 2 and 1); with a draft its decode steps and the target's verify
    steps are compiled too (adaptive: at every k it may pick)."""
    ref = hf_greedy(str(tiny_checkpoint))
    speculative = None if spec is None else SpeculativeConfig(
        "draft_target" if spec == "draft_target" else "auto", 3, draft_model=str(tiny_checkpoint),
        adaptive=spec != "draft_target")
    llm = LLM(tiny_checkpoint, dtype="float32", page_size=7, max_num_seqs=8, compile="all",
              compile_cache_dir=compile_cache, speculative=speculative)
    engine = llm.engine
    assert isinstance(engine.decode_graphs, CompiledDecode) and engine.decode_graphs.compiled == [1, 2, 4, 8]
    draft = None if spec is None else engine.proposer.drafter("draft_target")
    assert (getattr(draft, "fast_decode", None) is not None) == (spec is not None)
    want_verify = {None: set(), "draft_target": {(b, 3) for b in (1, 2, 4, 8)},
                   "adaptive_auto": {(b, k) for b in (1, 2, 4, 8) for k in (1, 2, 3)}}[spec]
    assert engine.decode_graphs.verify_compiled == want_verify
    if spec is not None:   # the draft's catch-up on the tokens a step accepted, compiled too
        assert draft.fast_decode.verify_compiled == want_verify
    params = [SamplingParams(max_tokens=NEW_TOKENS - 3 * i, temperature=0.0) for i in range(8)]
    outs = llm.generate(prompts(engine.model.config.vocab_size), params)
    for i, out in enumerate(outs):
        assert tuple(out.token_ids) == ref[i][:NEW_TOKENS - 3 * i], f"prompt {i} diverged from HF"
    assert engine.allocator.num_free == engine.allocator.num_pages   # every page back, the warm-up's too


def test_enforce_eager_and_no_compiler_run_eagerly(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(engine_config, "cxx_compiler", lambda: "c++")
    assert LLM(tiny_checkpoint, dtype="float32", enforce_eager=True).engine.decode_graphs is None
    monkeypatch.setattr(engine_config, "cxx_compiler", lambda: None)
    assert LLM(tiny_checkpoint, dtype="float32").engine.decode_graphs is None
    with pytest.raises(ValueError, match="compile='on'; allowed: auto, all"):
        LLM(tiny_checkpoint, dtype="float32", compile="on")
