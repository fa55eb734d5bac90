"""Automatic prefix caching in the colocated engine: greedy text identical with and
without it (each family, both layouts, every speculation method, hits of none, some and
all full pages), shared pages never freed or rewritten while held, eviction under
pressure harmless, cancelled or failed requests leave nothing cached, salts isolate, a
new model version reads nothing of an old one's."""
from __future__ import annotations

import pytest
import torch

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.engine import llm_engine

PAGE = 8
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


BASE = tokens(41, 1)          # 5 full pages before its last token
OTHER = tokens(30, 2)


def turns(first_reply: list[int]) -> list[tuple[list[int], int]]:
    """(prompt, tokens the cache must serve when run after the ones before it)."""
    return [(BASE, 0),                                  # cold
            (BASE, 40),                                 # all full pages but the last token's
            (BASE[:21] + OTHER, 16),                    # some: two shared pages
            (BASE + first_reply + OTHER[:5], 48),       # the next chat turn: the reply cached too
            (OTHER, 0)]                                 # none


def generate_turns(llm, params=GREEDY):
    """Token ids and cached-token counts of each turn, run one after the other, then of
    all of them in one batch."""
    eng = llm.engine
    ids, cached = [], []
    first = None
    for i in range(5):
        prompt = BASE if first is None else turns(first[:-1])[i][0]
        eng.add_request(prompt, params)
        toks = []
        while eng.has_unfinished():
            for o in eng.step():
                toks += o.new_token_ids
                if o.finished:
                    cached.append(o.num_cached_tokens)
        first = toks if first is None else first
        ids.append(tuple(toks))
    batch = llm.generate([p for p, _ in turns(first[:-1])], params)
    return ids + [tuple(o.token_ids) for o in batch], cached


def assert_no_leak(llm):
    a = llm.engine.allocator
    assert a.num_free == a.num_pages and not llm.engine.has_unfinished()


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_greedy_identical_with_and_without_caching(tiny_checkpoint, kv_layout):
    on = LLM(tiny_checkpoint, dtype="float32", page_size=PAGE, kv_layout=kv_layout)
    off = LLM(tiny_checkpoint, dtype="float32", page_size=PAGE, kv_layout=kv_layout,
              enable_prefix_caching=False)
    got, cached = generate_turns(on)
    want, none = generate_turns(off)
    assert got == want
    assert cached == [want_hit for _, want_hit in turns([0] * 9)] and set(none) == {0}
    assert on.engine.allocator.num_cached > 0
    assert_no_leak(on)


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
@pytest.mark.parametrize("method", ["draft_target", "mtp", "ngram"])
def test_speculation_on_a_hit_is_lossless(target_dir, other_draft_dir, random_mtp_dir,
                                          method, kv_layout):
    kw = {"draft_target": dict(draft_model=str(other_draft_dir)),
          "mtp": dict(mtp_head=str(random_mtp_dir)), "ngram": {}}[method]
    spec = SpeculativeConfig(method, 3, **kw)
    on = LLM(target_dir, dtype="float32", page_size=PAGE, kv_layout=kv_layout, speculative=spec)
    off = LLM(target_dir, dtype="float32", page_size=PAGE, kv_layout=kv_layout, speculative=spec,
              enable_prefix_caching=False)
    got, cached = generate_turns(on)
    assert got == generate_turns(off)[0]
    # the reply's last pages are cached once the proposer's KV of them is right
    assert cached[:3] == [0, 40, 16] and cached[3] >= 40 and cached[4] == 0
    assert_no_leak(on)


@pytest.mark.parametrize("method", ["draft_target", "mtp"])
def test_a_hit_speculates_from_its_first_decode_step(target_dir, other_draft_dir, random_mtp_dir,
                                                     method):
    """The proposer's KV is cached with the target's: a fully cached prompt needs one
    plain step (its last token), then drafts."""
    kw = dict(draft_model=str(other_draft_dir)) if method == "draft_target" else dict(
        mtp_head=str(random_mtp_dir))
    llm = LLM(target_dir, dtype="float32", page_size=PAGE, speculative=SpeculativeConfig(method, 3, **kw))
    llm.generate(BASE, GREEDY)
    eng = llm.engine
    eng.add_request(BASE, GREEDY)
    eng.step()                       # the last prompt token, plainly
    seq = next(iter(eng.seqs.values()))
    assert seq.num_cached_tokens == 40 and eng.proposer.ready(seq)
    drafts = eng.spec_metrics.num_drafts
    eng.step()
    assert eng.spec_metrics.num_drafts > drafts


def test_shared_pages_are_never_rewritten_or_freed_while_held(target_dir):
    llm = LLM(target_dir, dtype="float32", page_size=PAGE, num_pages=40)
    eng = llm.engine
    llm.generate(BASE, GREEDY)
    ids = [eng.add_request(BASE[:33] + tokens(12, s), SamplingParams(max_tokens=20, temperature=0.0,
                                                                     ignore_eos=True))
           for s in range(3)]
    eng.step()
    shared = eng.seqs[ids[0]].pages[:4]
    assert all(eng.seqs[r].pages[:4] == shared for r in ids)
    assert all(eng.allocator.ref_count(p) == 3 for p in shared)
    snapshot = eng.pool.kv[:, shared].clone()
    while eng.has_unfinished():
        eng.step()
        assert torch.equal(eng.pool.kv[:, shared], snapshot)
        for r in ids:
            if r in eng.seqs:
                assert eng.seqs[r].pages[:4] == shared
    assert_no_leak(llm)


def test_eviction_under_pressure_never_corrupts_a_running_sequence(target_dir):
    """A pool far smaller than the workload: cached pages are evicted (and running ones
    preempted) all the time; every text stays what it is without caching."""
    ps = [BASE[:9 + 4 * i] + tokens(6, 10 + i) for i in range(8)] * 2
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    on = LLM(target_dir, dtype="float32", page_size=4, num_pages=40, max_num_seqs=6)
    off = LLM(target_dir, dtype="float32", page_size=4, num_pages=40, max_num_seqs=6,
              enable_prefix_caching=False)
    want = [o.token_ids for o in off.generate(ps, params)]
    got = [o.token_ids for o in on.generate(ps, params)]
    got += [o.token_ids for o in on.generate(ps[::-1], params)]
    assert got == want + want[::-1]
    assert on.engine.allocator.stats.evictions > 0
    assert_no_leak(on)


def test_a_cancelled_request_leaves_nothing_cached(target_dir):
    llm = LLM(target_dir, dtype="float32", page_size=PAGE)
    eng = llm.engine
    rid = eng.add_request(BASE, GREEDY)
    eng.abort(rid)                             # before any KV was computed
    rid = eng.add_request(BASE, GREEDY)
    eng.step()                                 # its prompt computed (and published)
    assert eng.allocator.num_cached == 5
    eng.abort(rid)
    assert eng.allocator.num_cached == 0
    assert_no_leak(llm)


def test_a_failed_request_leaves_nothing_cached(target_dir, monkeypatch):
    llm = LLM(target_dir, dtype="float32", page_size=PAGE)
    eng = llm.engine
    good = eng.add_request(OTHER, GREEDY)
    bad = eng.add_request(BASE, SamplingParams(max_tokens=10, temperature=0.0, seed=666))
    eng.step()
    assert eng.allocator.num_cached == 3 + 5
    real = llm_engine.sample

    def poisoned(logits, params, generators):
        if any(p.seed == 666 for p in params):
            raise RuntimeError("poisoned request")
        return real(logits, params, generators)
    monkeypatch.setattr(llm_engine, "sample", poisoned)
    outs = {o.request_id: o for o in eng.step()}
    assert outs[bad].finish_reason == "error" and not outs[good].finished
    monkeypatch.setattr(llm_engine, "sample", real)
    while eng.has_unfinished():
        eng.step()
    # the failed one's pages left the cache, the good one's stay
    assert eng.allocator.num_cached == 3 + 1
    assert eng.make_sequence(BASE, GREEDY) and eng.add_request(BASE, GREEDY)
    eng.step()
    assert next(iter(eng.seqs.values())).num_cached_tokens == 0


def test_salts_isolate(target_dir):
    llm = LLM(target_dir, dtype="float32", page_size=PAGE)
    salted = lambda salt: SamplingParams(max_tokens=4, temperature=0.0, cache_salt=salt)
    cached = []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a", None):
        rid = llm.engine.add_request(BASE, salted(salt))
        while llm.engine.has_unfinished():
            cached += [o.num_cached_tokens for o in llm.engine.step() if o.finished]
    assert cached == [0, 0, 0, 40, 40]
    from tandem.backends.engine.prefix_caching import PrefixCacheStats
    stats = PrefixCacheStats.of(llm.engine.prefix)
    assert (stats.queried_tokens, stats.hit_tokens, stats.cached_pages) == (5 * 40, 80, 15)


def test_a_new_model_version_reads_nothing_of_the_old(target_dir):
    from tandem.backends.engine.prefix_caching import PrefixCaching
    llm = LLM(target_dir, dtype="float32", page_size=PAGE, model_version="1")
    eng = llm.engine
    llm.generate(BASE, GREEDY)
    # the same pool under version 2: its keys differ, so nothing matches
    v2 = PrefixCaching(eng.allocator, PAGE, (eng.prefix.extra_keys[0], "2"))
    eng.scheduler.prefix = eng.prefix = v2
    assert llm.generate(BASE, GREEDY)
    assert eng.allocator.stats.hit_pages == 0
    assert eng.reset_prefix_cache() > 0 and eng.allocator.num_cached == 0
    assert_no_leak(llm)


def test_caching_off_keeps_the_plain_allocator(target_dir):
    from tandem.backends.kv_cache import PageAllocator
    llm = LLM(target_dir, dtype="float32", page_size=PAGE, enable_prefix_caching=False)
    assert llm.engine.prefix is None and isinstance(llm.engine.allocator, PageAllocator)


@pytest.mark.parametrize("n,hit", [(1, 0), (8, 0), (9, 8), (40, 32), (41, 40)])
def test_the_last_prompt_token_is_always_recomputed(target_dir, n, hit):
    """A hit stops at the last full page before the prompt's last token (a page holding
    it is recomputed whole: a shared page is never written)."""
    llm = LLM(target_dir, dtype="float32", page_size=PAGE)
    first = llm.generate(BASE[:n], GREEDY)[0]
    rid = llm.engine.add_request(BASE[:n], GREEDY)
    outs = []
    while llm.engine.has_unfinished():
        outs += [o for o in llm.engine.step() if o.request_id == rid]
    assert outs[-1].num_cached_tokens == hit
    assert [t for o in outs for t in o.new_token_ids] == first.token_ids
