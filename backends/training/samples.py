"""Greedy samples from a trained checkpoint on its held-out prompts (for model cards).

Uses the dense training forward (no KV cache): fine for a few short samples of a
demo model; acceptance figures come from the engine, not from here.

>>> for s in sample_prompts("checkpoints/demo/target", n=3): print(s.completion)  # doctest: +SKIP
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import forward_dense, load_model
from .corpus import PROMPT_KINDS, load_prompts
from .tokenizer import load_tokenizer


@dataclass(slots=True, frozen=True)
class Sample:
    kind: str
    path: str
    line: int
    prompt: str
    completion: str
    parses: bool            # prompt + completion (cut at the last full line) is valid Python


@torch.no_grad()
def greedy(model, ids: list[int], max_new_tokens: int, eos: int | None = None,
           max_len: int | None = None) -> list[int]:
    """Greedy continuation ids (without the prompt), stopping at eos."""
    out: list[int] = []
    x = torch.tensor([ids])
    for _ in range(max_new_tokens):
        window = x if max_len is None else x[:, -max_len:]
        nxt = int(model.compute_logits(forward_dense(model, window))[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return out


def header_block(prompt: str, completion: str) -> str:
    """The last def/class header of the prompt and what follows it inside its block, dedented."""
    lines = (prompt + completion).split("\n")
    n_prompt = prompt.count("\n")
    start = next((i for i in range(n_prompt, -1, -1)
                  if lines[i].lstrip().startswith(("def ", "async def ", "class "))), 0)
    indent = len(lines[start]) - len(lines[start].lstrip())
    block = [lines[start][indent:]]
    for i, line in enumerate(lines[start + 1:], start + 1):
        if i > n_prompt and line.strip() and not line[:indent + 1].isspace():
            break           # back at or above the header's indentation: the block ended
        block.append(line[indent:])
    if len(lines) > start + len(block):
        return "\n".join(block) + "\n"
    return "\n".join(block[:-1]) + "\n"   # the last line may be cut mid-token


def parses_as_python(source: str) -> bool:
    """Whether source compiles, allowing an open block or docstring at the cut."""
    for suffix in ("", "    pass\n", "        pass\n", '"""\n', '    """\n'):
        try:
            ast.parse(source + suffix)
            return True
        except SyntaxError:
            continue
    return False


def sample_prompts(model_dir: str | Path, n: int = 3, max_new_tokens: int = 96,
                   kinds: tuple[str, ...] = PROMPT_KINDS) -> list[Sample]:
    """Greedy completions for the first ``n`` held-out prompts of each kind in ``kinds``."""
    model_dir = Path(model_dir)
    model = load_model(model_dir, "float32")
    tok = load_tokenizer(model_dir)
    eos = tok.token_to_id("</s>")
    prompts = load_prompts(model_dir / "prompts.json")
    samples = []
    for kind in kinds:
        for p in [p for p in prompts if p.kind == kind][:n]:
            ids = tok.encode(p.prompt).ids
            new = greedy(model, ids, max_new_tokens, eos, model.config.max_position_embeddings)
            completion = tok.decode(new, skip_special_tokens=False)
            samples.append(Sample(kind, p.path, p.line, p.prompt, completion,
                                  parses_as_python(header_block(p.prompt, completion))))
    return samples
