"""Token streams for LM training: corpus -> tokenizer -> one id stream per split.

Documents (``<s> text </s>``) are concatenated in corpus order; training batches
are random windows of that stream, drawn from a generator seeded by (seed, step)
so a resumed run sees exactly the batches an uninterrupted one would. Everything
is cached in the work directory so restarts skip tokenization.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .corpus import build_corpus, held_out_prompts, save_prompts
from .tokenizer import encode_documents, load_tokenizer, save_tokenizer, train_tokenizer


@dataclass(slots=True)
class TokenData:
    tokenizer: Tokenizer
    tokenizer_dir: Path         # tokenizer files (+ prompts.json, corpus.json) to ship with a checkpoint
    train: torch.Tensor         # int32 [n_train]
    validation: torch.Tensor    # int32 [n_val]


def prepare_data(work_dir: str | Path, vocab_size: int = 4096, val_fraction: float = 0.05,
                 root: str | Path | None = None, tokenizer_dir: str | Path | None = None,
                 model_max_length: int = 512) -> TokenData:
    """Build (or reuse from ``work_dir/data``) tokenizer, id streams and held-out prompts.

    With ``tokenizer_dir`` (e.g. the target's checkpoint when training its draft)
    that tokenizer is reused instead of training a new one.
    """
    data_dir = Path(work_dir) / "data"
    cache = data_dir / "tokens.pt"
    if cache.is_file():
        streams = torch.load(cache)
        return TokenData(load_tokenizer(data_dir), data_dir, streams["train"], streams["validation"])
    data_dir.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(root, val_fraction)
    if not corpus.train or not corpus.validation:
        raise ValueError(f"corpus under {corpus.root}: need train and validation files "
                         f"(got {len(corpus.train)} / {len(corpus.validation)}); "
                         "add files or change val_fraction")
    if tokenizer_dir is not None:
        tok = load_tokenizer(tokenizer_dir)
    else:
        tok = train_tokenizer(corpus.train, vocab_size)
    save_tokenizer(tok, data_dir, model_max_length)
    save_prompts(held_out_prompts(corpus), data_dir / "prompts.json")
    manifest = corpus.manifest() | {"python": sys.version.split()[0], "val_fraction": val_fraction}
    (data_dir / "corpus.json").write_text(json.dumps(manifest, indent=1) + "\n")

    def stream(docs) -> torch.Tensor:
        ids = encode_documents(tok, [d.text for d in docs])
        return torch.tensor([i for doc in ids for i in doc], dtype=torch.int32)

    streams = {"train": stream(corpus.train), "validation": stream(corpus.validation)}
    torch.save(streams, cache)
    return TokenData(tok, data_dir, streams["train"], streams["validation"])


def batch_generator(seed: int, step: int) -> torch.Generator:
    """The generator that draws the batch of ``step``: seeded by (seed, step) alone, so a
    resumed run draws the batches an uninterrupted one would."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def on_distill_rows(seed: int, step: int, fraction: float) -> bool:
    """Whether step ``step`` trains on the self-distillation rows (else on the corpus):
    a draw of its own seeded by (seed, step), so resumed runs agree.

    >>> [on_distill_rows(0, s, 1.0) for s in range(3)], [on_distill_rows(0, s, 0.0) for s in range(3)]
    ([True, True, True], [False, False, False])
    """
    u = torch.rand((), generator=batch_generator(seed + 1, step))
    return bool(u < fraction)


def sample_batch(stream: torch.Tensor, batch_size: int, seq_len: int, seed: int,
                 step: int) -> torch.Tensor:
    """[batch_size, seq_len + 1] random windows; deterministic in (seed, step)."""
    if stream.numel() <= seq_len + 1:
        raise ValueError(f"training stream has {stream.numel()} tokens, "
                         f"fewer than seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,),
                           generator=batch_generator(seed, step))
    offsets = torch.arange(seq_len + 1)
    return stream[starts[:, None] + offsets].long()


def next_token_windows(stream: torch.Tensor, seq_len: int,
                       limit: int | None = None) -> torch.Tensor:
    """[n, seq_len + 1] windows from the start of the validation stream, ``seq_len`` apart:
    inputs and their next-token labels, each token a label once (consecutive windows share
    one token, the last label of one being the first input of the next)."""
    n = (stream.numel() - 1) // seq_len
    if limit is not None:
        n = min(n, limit)
    if n == 0:
        raise ValueError(f"validation stream has {stream.numel()} tokens, "
                         f"fewer than seq_len + 1 = {seq_len + 1}")
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)
    return stream[idx].long()
