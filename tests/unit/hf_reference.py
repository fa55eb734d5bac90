"""The HF transformers reference the engine's tests compare against: greedy generations
of fixed random prompts (fp32), cached per checkpoint."""
from __future__ import annotations

import functools

import torch

NEW_TOKENS = 64
# lengths chosen so that page size 7 divides none of them
PROMPT_LENS = [3, 9, 17, 22, 30, 5, 12, 40]


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@functools.lru_cache(maxsize=None)
def hf_greedy(model_dir: str) -> tuple[tuple[int, ...], ...]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts(model.config.vocab_size):
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=0)
        outs.append(tuple(gen[0, len(p):].tolist()))
    return tuple(outs)
