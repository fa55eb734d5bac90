"""Log probabilities a request asks for, against HF transformers' fp32 logits: the prompt's
tokens' (raw model, every architecture, chunked, cached prefixes ignored, preempted), and
the k most likely alternatives at each generated position (the sampler's distribution,
plain and speculative)."""
from __future__ import annotations

import functools

import pytest
import torch

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.engine.logprobs import PromptLogprobs, ranked

from ..engine_runs import run_all
from ..hf_reference import prompts

K = 5


@functools.lru_cache(maxsize=None)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row j is log p(. | ids[:j + 1])."""
    return hf_model(str(model_dir))(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_prompt_logprobs(model_dir, prompt: list[int], got: PromptLogprobs, k: int = K):
    ref = hf_logprobs(model_dir, prompt)
    assert got.token_ids == prompt
    assert got.logprobs[0] is None and got.top[0].token_ids == []
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor(got.logprobs[1:]), want, atol=1e-4, rtol=0)
    for j, top in enumerate(got.top[1:]):
        values, _ = ref[j].topk(k)
        assert len(top.token_ids) == k
        torch.testing.assert_close(torch.tensor(top.logprobs), values, atol=1e-4, rtol=0)
        # the listed ids carry the listed values (ties aside, the same as HF's top-k)
        torch.testing.assert_close(ref[j, top.token_ids], values, atol=1e-4, rtol=0)
        # a prompt token that is its position's most likely one has the same float twice
        if top.token_ids[0] == prompt[j + 1]:
            assert top.logprobs[0] == got.logprobs[j + 1]


@pytest.mark.parametrize("chunk", [512, 8])
def test_prompt_logprobs_match_hf(tiny_checkpoint, chunk):
    """Every architecture, the prompt in one chunk or in chunks of 8 beside others."""
    llm = LLM(tiny_checkpoint, dtype="float32", page_size=7, max_num_batched_tokens=chunk)
    ps = prompts(llm.engine.model.config.vocab_size)[:4]
    outs = llm.generate(ps, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=K))
    for p, o in zip(ps, outs):
        check_prompt_logprobs(tiny_checkpoint, p, o.prompt_logprobs)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def run(llm, prompts_, params):
    """(sequences, the prompt tokens the cache served each)."""
    seqs, finals = run_all(llm, prompts_, [params] * len(prompts_))
    return seqs, [finals[s.request_id].num_cached_tokens for s in seqs]


def test_prompt_logprobs_ignore_the_prefix_cache(target_dir):
    """A cached prefix has no logits: the request computes its prompt again, and gets
    the tokens the cached request got."""
    llm = LLM(target_dir, dtype="float32", page_size=4, enable_prefix_caching=True)
    p = prompts(llm.engine.model.config.vocab_size)[4]          # 30 tokens
    greedy = SamplingParams(max_tokens=3, temperature=0)
    (first,), _ = run(llm, [p], greedy)
    (hit,), (hit_tokens,) = run(llm, [p], greedy)
    assert hit_tokens == 28                                     # the cache serves 7 pages
    (seq,), (computed,) = run(llm, [p], SamplingParams(max_tokens=3, temperature=0,
                                                        prompt_logprobs=K))
    assert computed == 0
    check_prompt_logprobs(target_dir, p, seq.prompt_logprobs)
    assert seq.output_ids == hit.output_ids == first.output_ids


def test_prompt_logprobs_survive_preemption(target_dir):
    """Preempted sequences compute their prompts again without recording anything twice."""
    llm = LLM(target_dir, dtype="float32", page_size=4, num_pages=32)
    p = prompts(llm.engine.model.config.vocab_size)[4]
    seqs, _ = run(llm, [p] * 6, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                               prompt_logprobs=1))
    assert sum(s.num_preemptions for s in seqs) > 0
    for s in seqs:
        check_prompt_logprobs(target_dir, p, s.prompt_logprobs, k=1)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def test_prompt_logprobs_come_once_on_the_first_output(target_dir):
    llm = LLM(target_dir, dtype="float32")
    p = prompts(llm.engine.model.config.vocab_size)[2]
    deltas = list(llm.stream(p, SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0)))
    assert deltas[0].prompt_logprobs is not None and deltas[0].prompt_logprobs.complete
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert all(t.token_ids == [] for t in deltas[0].prompt_logprobs.top)   # k = 0
    plain = list(llm.stream(p, SamplingParams(max_tokens=2, temperature=0)))
    assert all(d.prompt_logprobs is None for d in plain)


SPECS = {None: lambda d: None,
         "draft_target_self": lambda d: SpeculativeConfig("draft_target", 3, draft_model=str(d))}


@pytest.mark.parametrize("spec", list(SPECS))
def test_top_logprobs_of_greedy_tokens_match_hf(target_dir, spec):
    """The generated token is the first alternative, with the very same float; the k
    values are HF's top-k at that position (greedy: the raw logits' log-softmax)."""
    llm = LLM(target_dir, dtype="float32", speculative=SPECS[spec](target_dir))
    ps = prompts(llm.engine.model.config.vocab_size)[:3]
    outs = llm.generate(ps, SamplingParams(max_tokens=12, temperature=0, logprobs=True,
                                           top_logprobs=K))
    for p, o in zip(ps, outs):
        assert len(o.top_logprobs) == len(o.token_ids) == len(o.logprobs)
        ref = hf_logprobs(target_dir, p + o.token_ids)[len(p) - 1:-1]
        for n, (token, lp, top) in enumerate(zip(o.token_ids, o.logprobs, o.top_logprobs)):
            assert top.token_ids[0] == token and top.logprobs[0] == lp
            torch.testing.assert_close(torch.tensor(top.logprobs), ref[n].topk(K).values,
                                       atol=1e-4, rtol=0)


def test_top_logprobs_of_sampled_tokens_are_of_the_filtered_distribution(target_dir):
    """Sampled with top-k 3: three finite alternatives, the rest -inf, the drawn token
    among them with its own value."""
    llm = LLM(target_dir, dtype="float32")
    ps = prompts(llm.engine.model.config.vocab_size)[:2]
    outs = llm.generate(ps, SamplingParams(max_tokens=8, temperature=0.8, top_k=3, seed=5,
                                           logprobs=True, top_logprobs=4))
    for o in outs:
        for token, lp, top in zip(o.token_ids, o.logprobs, o.top_logprobs):
            assert all(v > float("-inf") for v in top.logprobs[:3]) and top.logprobs[3] == float("-inf")
            assert lp == top.logprobs[top.token_ids.index(token)]
            assert sum(torch.tensor(top.logprobs[:3]).exp()) == pytest.approx(1.0, abs=1e-5)


def test_no_alternatives_unless_asked(target_dir):
    llm = LLM(target_dir, dtype="float32")
    o = llm.generate(prompts(llm.engine.model.config.vocab_size)[0],
                     SamplingParams(max_tokens=4, temperature=0, logprobs=True))[0]
    assert o.top_logprobs is None and o.prompt_logprobs is None and len(o.logprobs) == 4


def test_ranked_keeps_the_chosen_float_among_the_alternatives():
    lp = torch.randn(6, 50).log_softmax(-1)
    best = lp.argmax(-1).tolist()
    r = ranked(lp, best, 3)
    assert [t.token_ids[0] for t in r.top] == best
    assert [t.logprobs[0] for t in r.top] == r.chosen


@pytest.mark.parametrize("field, value", [("top_logprobs", 21), ("top_logprobs", -1),
                                          ("prompt_logprobs", 21), ("prompt_logprobs", True)])
def test_out_of_range_counts_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(logprobs=True, **{field: value}).validate()
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=2).validate()     # alternatives need logprobs
