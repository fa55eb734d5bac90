"""Greedy token-for-token parity with HF transformers generate (fp32)."""
from __future__ import annotations

import pytest

from tandem.backends import LLM, SamplingParams

from ..hf_reference import NEW_TOKENS, hf_greedy, prompts

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [1, 16, 7])
def test_batched_greedy_matches_hf(tiny_checkpoint, kv_layout, page_size):
    ref = hf_greedy(str(tiny_checkpoint))
    llm = LLM(tiny_checkpoint, dtype="float32", page_size=page_size, kv_layout=kv_layout)
    vocab = llm.engine.model.config.vocab_size
    outs = llm.generate(prompts(vocab), GREEDY)
    for i, out in enumerate(outs):
        assert tuple(out.token_ids) == ref[i], f"prompt {i} diverged from HF"
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def test_single_request_matches_hf(tiny_checkpoint):
    ref = hf_greedy(str(tiny_checkpoint))
    llm = LLM(tiny_checkpoint, dtype="float32", page_size=16)
    p = prompts(llm.engine.model.config.vocab_size)[1]
    assert tuple(llm.generate(p, GREEDY)[0].token_ids) == ref[1]


def test_stream_yields_same_tokens_as_generate(tiny_checkpoint):
    ref = hf_greedy(str(tiny_checkpoint))
    llm = LLM(tiny_checkpoint, dtype="float32", page_size=16)
    p = prompts(llm.engine.model.config.vocab_size)[2]
    deltas = list(llm.stream(p, GREEDY))
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    assert tuple(t for d in deltas for t in d.new_token_ids) == ref[2]
