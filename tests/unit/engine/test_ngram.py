"""The ngram method (prompt lookup): the proposal is the continuation of the latest
earlier match, and speculation with it is lossless."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.engine.proposers.ngram import propose_ngram

from ..tiny_checkpoints import make_checkpoint


def brute_force(tokens, k, max_n, min_n):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        if n < 1:
            break
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return None


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40), k=st.integers(1, 5),
       max_n=st.integers(1, 4), min_n=st.integers(1, 4))
def test_the_proposal_is_the_continuation_of_the_latest_longest_match(tokens, k, max_n, min_n):
    if min_n > max_n:
        min_n, max_n = max_n, min_n
    assert propose_ngram(tokens, k, max_n, min_n) == brute_force(tokens, k, max_n, min_n)


@pytest.fixture(scope="module")
def target_dir(checkpoint_root):
    return make_checkpoint("llama_gqa_untied", checkpoint_root)


def repetitive_prompts():
    base = [[11, 12, 13, 14, 15] * 4, [7, 8, 9] * 6 + [7], list(range(20, 40)) + list(range(20, 30))]
    return base + [[3, 4, 5, 6]]   # one without any repetition


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_is_identical_with_ngram_speculation(target_dir, k):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ps = repetitive_prompts()
    plain = LLM(target_dir, page_size=4).generate(ps, params)
    llm = LLM(target_dir, page_size=4, speculative=SpeculativeConfig("ngram", k))
    outs = llm.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    single = llm.generate(ps[0], params)[0]
    assert single.token_ids == plain[0].token_ids
    assert llm.engine.spec_metrics.num_drafts > 0            # it did speculate
    a = llm.engine.allocator
    assert a.num_free == a.num_pages and not llm.engine.has_unfinished()


def test_seeded_sampling_reproduces_with_ngram(target_dir):
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    llm = LLM(target_dir, speculative=SpeculativeConfig("ngram", 3))
    first = llm.generate(repetitive_prompts(), params)
    again = llm.generate(repetitive_prompts(), params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]


def test_bad_lookup_sizes_are_refused(target_dir):
    with pytest.raises(ValueError, match="prompt_lookup_min=3, prompt_lookup_max=2"):
        LLM(target_dir, speculative=SpeculativeConfig("ngram", 3, prompt_lookup_max=2, prompt_lookup_min=3))
