"""Cached pages that can be checked (backends/kv_cache/page_audit.py): a test flips bytes
in a cached page, and with ``kv_audit=1`` the next hit finds it every time — the page is
dropped and recomputed, the output equals the uncached engine's, the metric counts it;
with the target's and the proposer's KV both cached, a flip in either is found; a page
another sequence still holds is never served again, even to a hit the audit did not
sample; and the prefill engine's own cache is audited the same way."""
from __future__ import annotations

import random

import pytest
import torch

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.engine.prefix_caching import PrefixCacheStats
from tandem.backends.kv_cache.page_audit import PageAudit

PAGE = 8
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def run(llm, prompt):
    """Greedy token ids of ``prompt`` and how many of its tokens the cache served."""
    eng = llm.engine
    rid = eng.add_request(prompt, GREEDY)
    toks, cached = [], None
    while cached is None:
        for o in eng.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                cached = o.num_cached_tokens if o.finished else None
    return toks, cached


def cached_pages(llm, prompt) -> list[int]:
    """The pages the engine's cache holds for ``prompt``'s full pages (looked up, not taken)."""
    prefix, eng = llm.engine.prefix, llm.engine
    keys = prefix.keys(prompt[:((len(prompt) - 1) // PAGE) * PAGE], None)
    pages = eng.allocator.match(keys)
    eng.allocator.free(pages)
    return pages


def flip(pool, page, rng):
    """Flip one byte somewhere in ``page`` of ``pool`` (any layer, K or V)."""
    layer = rng.randrange(pool.kv.shape[0])
    flat = pool.kv[layer, page].view(-1).view(torch.uint8)   # contiguous: a view into the pool
    i = rng.randrange(flat.numel())
    flat[i] ^= 0xFF


def test_every_flipped_page_is_found_dropped_and_recomputed(target_dir):
    prompt = tokens(41, 1)          # 5 full cached pages
    reference = LLM(target_dir, dtype="float32", page_size=PAGE, enable_prefix_caching=False)
    want, _ = run(reference, prompt)
    llm = LLM(target_dir, dtype="float32", page_size=PAGE, kv_audit=1.0)
    assert run(llm, prompt) == (want, 0)
    rng = random.Random(7)
    for attempt in range(1, 9):
        pages = cached_pages(llm, prompt)
        assert len(pages) == 5
        bad = rng.randrange(5)
        flip(llm.engine.pool, pages[bad], rng)
        got, cached = run(llm, prompt)
        assert got == want, f"attempt {attempt}: a changed page was served"
        assert cached == bad * PAGE            # the hit stopped short of it
        stats = PrefixCacheStats.of(llm.engine.prefix)
        assert stats.corrupt_pages == attempt
        assert run(llm, prompt) == (want, 40)  # recomputed and cached again: a whole hit
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def test_the_proposers_cached_kv_is_checked_too(target_dir, random_mtp_dir):
    prompt = tokens(33, 2)
    spec = SpeculativeConfig("mtp", 2, mtp_head=str(random_mtp_dir))
    reference = LLM(target_dir, dtype="float32", page_size=PAGE, speculative=spec, enable_prefix_caching=False)
    want, _ = run(reference, prompt)
    llm = LLM(target_dir, dtype="float32", page_size=PAGE, speculative=spec, kv_audit=1.0)
    run(llm, prompt)
    page = cached_pages(llm, prompt)[1]
    flip(llm.engine.proposer.runner.pool, page, random.Random(1))
    got, cached = run(llm, prompt)
    assert got == want and cached == PAGE
    assert PrefixCacheStats.of(llm.engine.prefix).corrupt_pages == 1


def test_a_changed_page_another_sequence_holds_is_not_served_to_unsampled_hits(target_dir):
    prompt = tokens(41, 3)
    llm = LLM(target_dir, dtype="float32", page_size=PAGE, kv_audit=1.0)
    run(llm, prompt)
    eng = llm.engine
    holder = eng.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    eng.step()                                        # holds the 5 cached pages
    page = eng.seqs[holder].pages[2]
    flip(eng.pool, page, random.Random(2))
    assert run(llm, prompt)[1] == 2 * PAGE            # found: cut there, but still cached (held)
    eng.prefix.audit.rate = 0.0                       # no more sampling: the record stays
    assert run(llm, prompt)[1] == 2 * PAGE
    eng.abort(holder)


def test_no_audit_no_checksums(target_dir):
    llm = LLM(target_dir, dtype="float32", page_size=PAGE, kv_audit=0.0)
    assert llm.engine.prefix.audit is None
    with pytest.raises(ValueError, match="kv_audit=1.5; allowed: 0 to 1"):
        LLM(target_dir, dtype="float32", page_size=PAGE, kv_audit=1.5)


def test_the_prefill_engines_cache_is_audited(target_dir):
    from tandem.backends.engine.config import EngineConfig
    from tandem.backends.engine.prefill_engine import PrefillEngine

    eng = PrefillEngine.from_config(EngineConfig(str(target_dir), dtype="float32", page_size=PAGE,
                                                 kv_audit=1.0))
    prompt = tokens(40, 4)

    def prefill(rid):
        req = eng.add(rid, prompt)
        while eng.has_work():
            eng.step()
        cached = req.num_cached
        eng.release(rid)
        return cached

    assert prefill("a") == 0 and prefill("b") == 4 * PAGE      # all but the page of the last token
    keys = eng.prefix.keys(prompt, None)
    pages = eng.allocator.match(keys)
    eng.allocator.free(pages)
    flip(eng.pool, pages[2], random.Random(3))
    assert prefill("c") == 2 * PAGE
    assert eng.prefix_cache_stats().corrupt_pages == 1


def test_page_audit_refuses_a_rate_out_of_range():
    with pytest.raises(ValueError, match="kv_audit 2; allowed: 0 to 1"):
        PageAudit([], 2)


# -- the recompute audit: a page wrong when it was published -----------------------------

def rewrite_as_published(llm, page, other_page):
    """Make ``page`` hold ``other_page``'s KV and record that as its published content:
    the checksum agrees, as it would with a page written wrong before publication."""
    pool = llm.engine.pool
    pool.kv[:, page] = pool.kv[:, other_page]
    llm.engine.prefix.audit.record(page)


def test_a_page_wrong_when_published_is_found_by_recomputing(target_dir):
    """Checksums pass a page that was wrong from the start; with kv_audit_recompute=1 the
    hit is declined, the recomputed page disagrees with the cached one, the cached one
    is replaced, and no output ever carries it."""
    prompt, other = tokens(41, 3), tokens(41, 4)
    reference = LLM(target_dir, dtype="float32", page_size=PAGE, enable_prefix_caching=False)
    want, _ = run(reference, prompt)
    checked = LLM(target_dir, dtype="float32", page_size=PAGE, kv_audit=1.0)
    recomputing = LLM(target_dir, dtype="float32", page_size=PAGE, kv_audit=1.0, kv_audit_recompute=1.0)
    for llm in (checked, recomputing):
        assert run(llm, prompt) == (want, 0)
        run(llm, other)
        rewrite_as_published(llm, cached_pages(llm, prompt)[2], cached_pages(llm, other)[2])
    # checksums alone pass it: the wrong page is served
    assert run(checked, prompt)[1] == 40
    stats = PrefixCacheStats.of(recomputing.engine.prefix)
    assert run(recomputing, prompt) == (want, 0)          # declined: computed afresh
    after = PrefixCacheStats.of(recomputing.engine.prefix)
    assert after.recompared_pages - stats.recompared_pages == 6   # 5 of the prompt, 1 of its output
    assert after.disagreeing_pages == 1 and after.corrupt_pages == 0
    recomputing.engine.prefix.audit.recompute_rate = 0.0   # hits used again: the fresh page is cached
    assert run(recomputing, prompt) == (want, 40)


def test_recomputed_pages_agree_whatever_the_batch(target_dir):
    """No false alarm: the same prefixes recomputed in other batches and chunkings (bf16,
    where rounding differs most) always agree with the cached pages."""
    llm = LLM(target_dir, dtype="bfloat16", page_size=PAGE, kv_audit_recompute=1.0, max_num_batched_tokens=24)
    prompts = [tokens(40 + 3 * i, 10 + i % 3) for i in range(9)]   # 3 shared prefixes, other lengths
    llm.generate(prompts[:3], GREEDY)
    for _ in range(2):
        llm.generate(prompts, GREEDY)
    stats = PrefixCacheStats.of(llm.engine.prefix)
    assert stats.recompared_pages > 20 and stats.disagreeing_pages == 0
