"""The prefill engine's own prefix cache: a request that takes cached pages produces
the same KV (target and proposer) and the same last hidden state as one computed from
scratch, for hits of none, some and all full pages, with and without speculation, in
both layouts; aborted and failed requests leave nothing cached; salts isolate; eviction
under a small pool is harmless."""
from __future__ import annotations

import pytest
import torch

from tandem.backends.engine import EngineConfig
from tandem.backends.engine.prefill_engine import PrefillEngine, PrefillHooks

from ..kv_reference import spec_for, token_kv

PAGE = 4


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


BASE = tokens(22, 1)      # prefills 21 tokens: 5 full pages short of its last one
OTHER = tokens(13, 2)
assert OTHER[0] != BASE[8]


def make(target_dir, spec=None, caching=True, kv_layout="HND", num_pages=64, hooks=None,
         max_num_batched_tokens=8):
    return PrefillEngine.from_config(EngineConfig(
        str(target_dir), dtype="float32", page_size=PAGE, kv_layout=kv_layout,
        num_pages=num_pages, max_num_batched_tokens=max_num_batched_tokens,
        speculative=spec, enable_prefix_caching=caching), hooks)


def run(eng, rid, prompt, salt=None):
    """Prefill ``prompt[:-1]`` alone; returns (request, hidden, target KV, proposer KV)
    and releases its pages."""
    req = eng.add(rid, prompt[:-1], last_token=prompt[-1], cache_salt=salt)
    while eng.has_work():
        eng.step()
    assert eng.take_failed() == []
    n = len(prompt) - 1
    kv = token_kv(eng.pool, req.pages, n).clone()
    draft = (token_kv(eng.proposer.pool, req.pages, n).clone()
             if eng.proposer is not None else None)
    hidden = req.hidden.clone()
    eng.release(rid)
    return req, hidden, kv, draft


def assert_same(got, want):
    for g, w in zip(got[1:], want[1:]):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
@pytest.mark.parametrize("method", [None, "draft_target", "mtp"])
def test_cached_prefill_equals_a_prefill_from_scratch(target_dir, random_mtp_dir, method,
                                                      kv_layout):
    spec = spec_for(method, target_dir, random_mtp_dir)
    cached = make(target_dir, spec, kv_layout=kv_layout)
    plain = make(target_dir, spec, caching=False, kv_layout=kv_layout)
    assert plain.prefix is None and cached.prefix is not None
    # an MTP head's KV row 7 reads token 8: with it, BASE[:8] + OTHER shares one page only
    some = 4 if method == "mtp" else 8
    cases = [(BASE, 0),                  # cold
             (BASE, 20),                 # every full page short of the last prefilled token
             (BASE[:21], 16),            # 20 prefilled, 5 full pages: the last one recomputed
             (BASE[:10] + OTHER, 8),     # some: two pages
             (BASE[:8] + OTHER, some),
             (OTHER, 0)]                 # none
    for i, (prompt, hit) in enumerate(cases):
        got = run(cached, f"c{i}", prompt)
        assert got[0].num_cached == hit, (i, got[0].num_cached)
        assert_same(got, run(plain, f"p{i}", prompt))
    stats = cached.prefix_cache_stats()
    assert stats.hit_tokens == sum(h for _, h in cases) and stats.cached_pages > 0
    assert cached.allocator.num_free == cached.allocator.num_pages


class Recorder(PrefillHooks):
    def __init__(self):
        self.admitted, self.forwards = [], []

    def on_admit(self, req):
        self.admitted.append((req.request_id, req.num_cached, list(req.pages)))

    def before_forward(self, chunks, model="target"):
        self.forwards.append((model, [(r.request_id, r.num_computed, end) for r, end in chunks]))


def test_a_hit_computes_only_from_the_first_page_it_lacks(target_dir, random_mtp_dir):
    hooks = Recorder()
    eng = make(target_dir, spec_for("mtp", target_dir, random_mtp_dir), hooks=hooks,
               max_num_batched_tokens=64)
    first, *_ = run(eng, "a", BASE)
    hooks.forwards.clear()
    eng.add("b", BASE[:-1], last_token=BASE[-1])
    eng.step()
    assert hooks.admitted[-1][:2] == ("b", 20)
    assert hooks.admitted[-1][2][:5] == hooks.admitted[0][2][:5]   # the same pages, shared
    assert hooks.forwards == [("target", [("b", 20, 21)]), ("mtp", [("b", 20, 21)])]
    eng.release("b")


def test_a_request_running_beside_its_twin_shares_what_is_published(target_dir):
    """Pages are published as they complete: a request admitted while another with the
    same prefix is half-way takes the pages that one has finished."""
    eng = make(target_dir, max_num_batched_tokens=8)
    eng.add("a", BASE[:-1], last_token=BASE[-1])
    eng.step()                                  # 8 tokens of "a": two full pages
    b = eng.add("b", BASE[:-1], last_token=BASE[-1])
    while eng.has_work():
        eng.step()
    assert b.num_cached == 8
    eng.release("a"), eng.release("b")


@pytest.mark.parametrize("how", ["abort", "fail"])
def test_an_aborted_or_failed_request_publishes_nothing(target_dir, monkeypatch, how):
    eng = make(target_dir, max_num_batched_tokens=8)
    if how == "fail":
        forward = eng.runner.forward
        calls = []

        def failing_second_forward(batch, on_layer_done=None):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("poisoned prefill")
            return forward(batch, on_layer_done)
        monkeypatch.setattr(eng.runner, "forward", failing_second_forward)
    eng.add("a", BASE[:-1], last_token=BASE[-1])
    eng.step()                                  # two pages published
    assert eng.allocator.num_cached == 2
    if how == "abort":
        assert eng.abort("a")
    else:
        eng.step()
        assert [rid for rid, _ in eng.take_failed()] == ["a"]
    assert eng.allocator.num_cached == 0
    assert eng.allocator.num_free == eng.allocator.num_pages
    monkeypatch.undo()
    assert run(eng, "b", BASE)[0].num_cached == 0


def test_an_aborted_request_leaves_pages_another_one_shares(target_dir):
    eng = make(target_dir, max_num_batched_tokens=64)
    run(eng, "a", BASE)
    b = eng.add("b", BASE[:10] + OTHER[:-1], last_token=OTHER[-1])
    eng.step()
    assert b.num_cached == 8 and eng.abort("b")
    assert eng.allocator.num_cached == 5       # a's pages stay; b's own ones are withdrawn
    assert run(eng, "c", BASE)[0].num_cached == 20


def test_a_finished_prefill_aborted_before_release_is_withdrawn(target_dir):
    """Its transfer failed: the service aborts it rather than releasing it."""
    eng = make(target_dir, max_num_batched_tokens=64)
    eng.add("a", BASE[:-1], last_token=BASE[-1])
    while eng.has_work():
        eng.step()
    assert "a" in eng.finished and eng.allocator.num_cached == 5
    eng.abort("a")
    assert eng.allocator.num_cached == 0


def test_salts_isolate(target_dir):
    eng = make(target_dir)
    assert run(eng, "a", BASE, salt="tenant-a")[0].num_cached == 0
    assert run(eng, "b", BASE, salt="tenant-b")[0].num_cached == 0
    assert run(eng, "c", BASE)[0].num_cached == 0
    assert run(eng, "d", BASE, salt="tenant-a")[0].num_cached == 20
    assert run(eng, "e", BASE, salt="")[0].num_cached == 0     # "" is not None


def test_eviction_under_a_small_pool_keeps_results_and_running_requests(target_dir):
    """A pool of 8 pages: a request of 7 must evict cached pages; one that holds cached
    pages while another's admission evicts keeps them intact."""
    eng = make(target_dir, num_pages=8, max_num_batched_tokens=4)
    plain = make(target_dir, caching=False)
    prompts = {"base": BASE, "long": OTHER + OTHER, "mixed": BASE[:10] + OTHER,
               "short": OTHER[:8]}
    ref = {name: run(plain, name, p) for name, p in prompts.items()}
    assert_same(run(eng, "a", BASE), ref["base"])
    assert eng.allocator.num_cached == 5
    got = run(eng, "b", prompts["long"])       # 7 pages: evicts BASE's last pages first
    assert got[0].num_cached == 0
    assert_same(got, ref["long"])
    assert eng.allocator.stats.evictions == 4
    again = run(eng, "c", BASE)
    assert again[0].num_cached == 4             # what survived: BASE's first page
    assert_same(again, ref["base"])
    # "d" holds two cached pages and computes for 4 steps; "e", admitted meanwhile,
    # evicts cached pages — none of those "d" holds
    d = eng.add("d", prompts["mixed"][:-1], last_token=prompts["mixed"][-1])
    eng.step()
    assert d.num_cached == 8 and not d.done
    evictions = eng.allocator.stats.evictions
    e = eng.add("e", prompts["short"][:-1], last_token=prompts["short"][-1])
    results = {}
    while eng.has_work():
        for r in eng.step():
            results[r.request_id] = (r, r.hidden.clone(),
                                     token_kv(eng.pool, r.pages, len(r.token_ids)).clone(), None)
    assert eng.allocator.stats.evictions > evictions
    assert_same(results["d"], ref["mixed"])
    assert_same(results["e"], ref["short"])
    eng.release("d"), eng.release("e")
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_caching_off_takes_nothing(target_dir):
    eng = make(target_dir, caching=False)
    run(eng, "a", BASE)
    assert run(eng, "b", BASE)[0].num_cached == 0 and eng.prefix_cache_stats() is None


def test_a_version_roll_drops_the_cache(target_dir):
    eng = make(target_dir)
    run(eng, "a", BASE)
    assert eng.reset_prefix_cache() == 5
    assert run(eng, "b", BASE)[0].num_cached == 0


def test_keys_are_the_colocated_engines(target_dir, random_mtp_dir):
    """A prefill's pages carry the keys a colocated engine of the same config gives the
    same prompt, so a decode cache keyed the colocated way matches what prefill sent."""
    from tandem.backends.engine import LLMEngine, SamplingParams
    spec = spec_for("mtp", target_dir, random_mtp_dir)
    eng = make(target_dir, spec)
    co = LLMEngine(EngineConfig(str(target_dir), dtype="float32", page_size=PAGE,
                                speculative=spec))
    req = eng.add("a", BASE[:-1], last_token=BASE[-1], cache_salt="s")
    seq = co.make_sequence(BASE, SamplingParams(max_tokens=1, cache_salt="s"), request_id="c")
    assert co.prefix._keys(seq, 5) == req.page_keys[:5]
