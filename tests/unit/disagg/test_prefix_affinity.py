"""Cache-aware choice of a prefill endpoint (backends/disagg/prefix_affinity.py): a
repeated prefix goes where it went before, distinct prompts spread by load, a hot
prefix spills when its endpoint is far more loaded, a down endpoint is tried last and
its index forgotten, memory is bounded, and the same inputs give the same choices."""
from __future__ import annotations

import pytest

from tandem.backends.disagg.prefix_affinity import (AffinityPolicy, PageLRU, PrefixAffinity, prompt_keys,
                                                    try_order)

UP4 = [True] * 4


def prompt(prefix: int, length: int, suffix: int = 0) -> list[int]:
    """``length`` tokens shared by every prompt of ``prefix``, then a few of ``suffix``."""
    return [prefix * 1000 + i for i in range(length)] + [50_000 + suffix, 50_001 + suffix, 7]


def send(a: PrefixAffinity, ids, now: float, start: int = 0, usable=UP4) -> int:
    """Route one job; the first endpoint of the order takes it."""
    p = a.plan(ids, usable, start, now)
    a.taken(p, p.order[0], now)
    return p.order[0]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_repeated_prefix_goes_to_the_endpoint_that_prefilled_it(page_size):
    a = PrefixAffinity(4, AffinityPolicy(page_size=page_size, tokens_per_s=1000))
    now, first = 0.0, {}
    for turn in range(3):
        for prefix in range(8):
            now += 1.0                                   # each backlog drained by the next job
            went = send(a, prompt(prefix, 64, suffix=turn), now, start=int(now) % 4)
            assert first.setdefault(prefix, went) == went, (prefix, turn)
    assert sorted(first.values()) == [0, 0, 1, 1, 2, 2, 3, 3]   # the cold ones spread


def test_distinct_prompts_spread_over_the_endpoints_by_load():
    a = PrefixAffinity(4)
    taken = [send(a, prompt(p, 200 + 50 * (p % 2)), now=0.0, start=p % 4) for p in range(40)]
    counts = [taken.count(e) for e in range(4)]
    assert min(counts) >= 9, counts
    backlogs = [a.backlog_tokens(e, 0.0) for e in range(4)]
    assert max(backlogs) - min(backlogs) <= 250          # within one job


def hot_traffic(a: PrefixAffinity, jobs: int, every_s: float) -> list[int]:
    """A 512-token prefix with 64 new tokens each time; the first job done before the rest come."""
    return [send(a, prompt(1, 512, suffix=s)[:512] + list(range(64 * s, 64 * s + 64)),
                 now=0.0 if s == 0 else 1.0 + every_s * s, start=s % 2, usable=[True, True]) for s in range(jobs)]


def test_a_hot_prefix_spills_to_another_endpoint_when_its_own_is_much_more_loaded():
    a = PrefixAffinity(2, AffinityPolicy(tokens_per_s=1000))
    taken = hot_traffic(a, 200, every_s=0.01)           # 6400 new tokens/s at one that does 1000
    first_spill = taken.index(1)
    # the cached endpoint keeps it until its backlog outweighs the 512 cached tokens
    assert taken[:first_spill] == [0] * first_spill and first_spill > 5
    ids = prompt(1, 512)
    assert a.plan(ids, [True, True], 0, 0.0).overlap_tokens == (512, 512)    # now both hold it
    assert 80 < taken.count(1) < 120                     # and share the load from then on


def test_a_hot_prefix_stays_while_its_endpoint_keeps_up():
    a = PrefixAffinity(2, AffinityPolicy(tokens_per_s=1000))
    assert set(hot_traffic(a, 200, every_s=0.1)) == {0}  # 640 new tokens/s


def test_the_cache_weight_sets_how_soon_a_hot_prefix_spills():
    spills = []
    for weight in (0.0, 0.25, 1.0, 4.0):
        taken = hot_traffic(PrefixAffinity(2, AffinityPolicy(cache_weight=weight, tokens_per_s=1000)), 200, 0.01)
        spills.append(taken.index(1))
    assert spills[0] == 1 and spills == sorted(set(spills)), spills   # 0: least loaded only


def test_a_down_endpoint_is_tried_last_and_its_index_forgotten():
    a = PrefixAffinity(3)
    ids = prompt(1, 256)
    p = a.plan(ids, [True] * 3, 1, 0.0)
    a.taken(p, 1, 0.0)
    assert a.plan(ids, [True] * 3, 0, 5.0).order[0] == 1
    assert a.plan(ids, [True, False, True], 0, 5.0).order == (0, 2, 1)   # down: only a last resort
    a.forget(1)                               # it failed: restarted with an empty cache?
    assert (a.pages(1), a.backlog_tokens(1, 0.0)) == (0, 0.0)
    assert a.plan(ids, [True] * 3, 2, 5.0).overlap_tokens == (0, 0, 0)


def test_the_index_is_bounded_and_keeps_the_recently_used_prefixes():
    a = PrefixAffinity(1, AffinityPolicy(max_pages=64))
    system = prompt(0, 128)                   # 8 pages, resent every few prompts
    for p in range(1, 200):
        send(a, prompt(p, 160), now=float(p), usable=[True])
        if p % 4 == 0:
            send(a, system, now=float(p), usable=[True])
        assert a.pages(0) <= 64
    assert a.plan(system, [True], 0, 999.0).overlap_tokens == (128,)
    assert a.plan(prompt(3, 160), [True], 0, 999.0).overlap_tokens == (0,)   # long evicted


def test_eviction_takes_a_chains_tail_before_its_head():
    lru = PageLRU(cap=4)
    lru.add(prompt_keys(prompt(1, 64), 16))                    # 4 pages
    lru.add(prompt_keys(prompt(2, 16), 16))                    # 1 more: one of prompt 1's goes
    assert lru.match(prompt_keys(prompt(1, 64), 16)) == 3      # its first three still match


def test_the_same_inputs_give_the_same_choices():
    def run():
        a = PrefixAffinity(3, AffinityPolicy(page_size=8, tokens_per_s=800))
        return [send(a, prompt(p % 5, 100 + 13 * p, suffix=p), now=0.05 * p, start=p % 3,
                     usable=[p % 7 != 0, True, p % 5 != 1]) for p in range(60)]
    assert run() == run()


def test_keys_cover_the_full_pages_prefill_computes():
    assert len(prompt_keys(range(17), 16)) == 1          # prompt[:-1] = 16 tokens: one full page
    assert len(prompt_keys(range(16), 16)) == 0
    assert prompt_keys([1, 2, 3, 4, 9], 2) == prompt_keys([1, 2, 3, 4, 8], 2)   # the last token is decode's


def test_round_robin_ignores_the_cache():
    assert try_order([0, 999, 0], [0, 0, 0], [True] * 3, start=2, cache_aware=False) == (2, 0, 1)
    assert try_order([0, 999, 0], [0, 0, 0], [True, True, False], start=2, cache_aware=False) == (0, 1, 2)


@pytest.mark.parametrize("bad", [dict(page_size=0), dict(cache_weight=-1), dict(tokens_per_s=0),
                                 dict(max_pages=0)])
def test_a_policy_out_of_range_is_refused_with_what_is_allowed(bad):
    with pytest.raises(ValueError, match="allowed"):
        AffinityPolicy(**bad)
