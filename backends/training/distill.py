"""Self-distillation data (``tandem train distill-data``): the target's own continuations.

A proposer is scored on how often it predicts the *target's* next token on text the
target itself writes, so it is trained on that text (Medusa-2's self-distillation,
EAGLE's "data regeneration"): prompts are drawn from the training split, the target
continues each one through the engine (``LLM``, batched; greedy and/or sampled), and
every row ``prompt + continuation`` becomes training data for the draft (``tandem
train lm`` with ``data.distill_data``) and the MTP head (``tandem train mtp
--distill-data``; the hidden states and labels are then the target's over its own
generation).

Prompts are the last ``min_prompt_tokens..max_prompt_tokens`` tokens before a random
point of the training stream (any user's data) and, with ``header_fraction`` and a
corpus, the def/class/docstring headers of training files (the shape of the held-out
prompts, :func:`.corpus.extract_prompts`). Rows are right-padded to one width; their
``lengths`` say where the padding starts.

The output directory holds ``distill.pt`` (the rows), ``tokens.pt`` (the rows
concatenated, ``{"train", "validation"}`` as ``tandem train lm`` caches token streams,
so every ``--data`` consumer reads it), the target's tokenizer and ``distill.json``.

>>> rows = pack_rows([[5, 6], [7]], [[8, 9], [10, 11]], [0.0, 0.8], pad_id=2)
>>> rows.windows.tolist(), rows.lengths.tolist(), rows.prompt_lens.tolist()
([[5, 6, 8, 9], [7, 10, 11, 2]], [4, 3], [2, 1])
>>> rows.stream().tolist()
[5, 6, 8, 9, 7, 10, 11]
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .hidden_states import pick_forward, target_fingerprint
from .loop import config_section, replacing_dir

log = logging.getLogger("tandem.train")
ROWS_FILE = "distill.pt"
CONFIG_NAME = "distill-data config"
FORWARDS = ("auto", "engine", "paged", "dense")   # paged: the engine (as hidden states say it)


@dataclass(slots=True)
class DistillDataConfig:
    num_prompts: int = 4096             # training rows
    val_prompts: int = 64               # rows from the validation stream (model selection)
    min_prompt_tokens: int = 32
    max_prompt_tokens: int = 256
    new_tokens: int = 128               # the target's continuation per prompt
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.8])  # cycled over rows
    top_p: float = 1.0
    header_fraction: float = 0.5        # share of prompts cut at def/class headers (needs a corpus)
    batch: int = 128                    # sequences the engine runs at once
    dtype: str = "bfloat16"
    seed: int = 0
    stop_at_eos: bool = False           # a row ends at the target's EOS (chat answers)
    generator: str = "auto"             # engine, dense (.dense_generate), auto (dense on CUDA
                                        # without FlashInfer)

    @classmethod
    def from_dict(cls, d: dict) -> "DistillDataConfig":
        cfg = config_section(cls, {k: v for k, v in d.items() if k != "comment"}, CONFIG_NAME)
        if not 1 <= cfg.min_prompt_tokens <= cfg.max_prompt_tokens:
            raise ValueError(f"{CONFIG_NAME}: need 1 <= min_prompt_tokens <= max_prompt_tokens "
                             f"(got {cfg.min_prompt_tokens}, {cfg.max_prompt_tokens})")
        if cfg.new_tokens < 1 or not cfg.temperatures or min(cfg.temperatures) < 0:
            raise ValueError(f"{CONFIG_NAME}: need new_tokens >= 1 and temperatures >= 0 "
                             f"(got {cfg.new_tokens}, {cfg.temperatures})")
        if cfg.generator not in FORWARDS:
            raise ValueError(f"{CONFIG_NAME}: generator {cfg.generator!r} is invalid; allowed: "
                             "auto, engine, dense")
        if not 0.0 <= cfg.header_fraction <= 1.0:
            raise ValueError(f"{CONFIG_NAME}: header_fraction {cfg.header_fraction} is not in [0, 1]")
        return cfg

    @property
    def width(self) -> int:
        return self.max_prompt_tokens + self.new_tokens


@dataclass(slots=True)
class DistillRows:
    windows: torch.Tensor       # [n, W] int64: prompt + the target's continuation, right-padded
    lengths: torch.Tensor       # [n] int64: tokens before the padding
    prompt_lens: torch.Tensor   # [n] int64: tokens of the prompt (the rest was generated)
    temperatures: torch.Tensor  # [n] float32: 0 = greedy

    def __len__(self) -> int:
        return self.windows.shape[0]

    def stream(self) -> torch.Tensor:
        """The rows without their padding, concatenated (int32): a token stream."""
        if len(self) == 0:
            return torch.zeros(0, dtype=torch.int32)
        keep = torch.arange(self.windows.shape[1])[None, :] < self.lengths[:, None]
        return self.windows[keep].to(torch.int32)

    def to_dict(self) -> dict:
        return {"windows": self.windows, "lengths": self.lengths,
                "prompt_lens": self.prompt_lens, "temperatures": self.temperatures}


def pack_rows(prompts: list[list[int]], continuations: list[list[int]],
              temperatures: list[float], pad_id: int, width: int | None = None) -> DistillRows:
    """Rows ``prompt + continuation`` right-padded with ``pad_id`` to ``width`` (default
    the longest row)."""
    if not len(prompts) == len(continuations) == len(temperatures):
        raise ValueError(f"pack_rows: {len(prompts)} prompts, {len(continuations)} "
                         f"continuations, {len(temperatures)} temperatures")
    rows = [p + c for p, c in zip(prompts, continuations)]
    longest = max(map(len, rows), default=0)
    width = longest if width is None else width
    if longest > width:
        raise ValueError(f"pack_rows: a row has {longest} tokens, more than width {width}")
    windows = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        windows[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return DistillRows(windows, torch.tensor([len(r) for r in rows], dtype=torch.long),
                       torch.tensor([len(p) for p in prompts], dtype=torch.long),
                       torch.tensor(temperatures, dtype=torch.float32))


def window_prompts(stream: torch.Tensor, n: int, min_tokens: int, max_tokens: int,
                   seed: int) -> list[list[int]]:
    """``n`` prompts: the last ``min_tokens..max_tokens`` tokens (uniform) before random
    ends in ``stream``; deterministic in ``seed``."""
    if stream.numel() <= max_tokens:
        raise ValueError(f"token stream has {stream.numel()} tokens; prompts of up to "
                         f"{max_tokens} need more")
    g = torch.Generator().manual_seed(seed)
    ends = torch.randint(max_tokens, stream.numel() + 1, (n,), generator=g)
    lens = torch.randint(min_tokens, max_tokens + 1, (n,), generator=g)
    return [stream[e - k:e].tolist() for e, k in zip(ends.tolist(), lens.tolist())]


def header_prompts(docs, tokenizer, n: int, min_tokens: int, max_tokens: int,
                   seed: int) -> list[list[int]]:
    """Up to ``n`` prompts cut at def/class headers and docstring openings of ``docs``
    (:func:`.corpus.extract_prompts`), tokenized, the last ``max_tokens`` kept (as the
    held-out prompts are), those shorter than ``min_tokens`` dropped; a seeded sample."""
    from .corpus import extract_prompts
    pool = [p.prompt for d in docs for p in extract_prompts(d)]
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for i in order:
        ids = tokenizer.encode(pool[i]).ids[-max_tokens:]
        if len(ids) >= min_tokens:
            out.append(ids)
            if len(out) == n:
                break
    return out


def cycle_temperatures(n: int, temperatures: list[float]) -> list[float]:
    """Row i gets ``temperatures[i % len]``: every mix is present in any slice of rows.

    >>> cycle_temperatures(5, [0.0, 0.8])
    [0.0, 0.8, 0.0, 0.8, 0.0]
    """
    return [temperatures[i % len(temperatures)] for i in range(n)]


def generate(llm, prompts: list[list[int]], temperatures: list[float], new_tokens: int,
             top_p: float, seed: int, batch: int, ignore_eos: bool = True) -> list[list[int]]:
    """The engine's continuations of ``prompts`` (``new_tokens`` each, EOS ignored so
    every row has the same number of generated tokens, unless ``ignore_eos`` is False);
    sampled rows are seeded."""
    from ..engine.params import SamplingParams
    out: list[list[int]] = []
    t0 = time.monotonic()
    for a in range(0, len(prompts), batch):
        params = [SamplingParams(max_tokens=new_tokens, temperature=t, top_p=top_p,
                                 seed=None if t == 0 else seed * 1_000_003 + a + i,
                                 ignore_eos=ignore_eos)
                  for i, t in enumerate(temperatures[a:a + batch])]
        out += [o.token_ids for o in llm.generate(prompts[a:a + batch], params)]
        log.info("distill-data: %d/%d prompts continued (%.0f generated tok/s)", len(out),
                 len(prompts), len(out) * new_tokens / (time.monotonic() - t0))
    return out


def build_distill_data(target_dir: str | Path, train: torch.Tensor, validation: torch.Tensor,
                       out_dir: str | Path, cfg: DistillDataConfig, corpus=None,
                       device: str = "cpu", command: str | None = None) -> dict:
    """Generate the rows (train from ``train``'s windows and, with ``corpus``, its
    training files' headers; validation from ``validation``'s windows) and write
    ``out_dir``. Returns the summary written to ``distill.json``."""
    from ..models.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(target_dir)
    n_headers = round(cfg.num_prompts * cfg.header_fraction) if corpus is not None else 0
    prompts = (header_prompts(corpus.train, tokenizer, n_headers, cfg.min_prompt_tokens,
                              cfg.max_prompt_tokens, cfg.seed) if n_headers else [])
    prompts += window_prompts(train, cfg.num_prompts - len(prompts), cfg.min_prompt_tokens,
                              cfg.max_prompt_tokens, cfg.seed)
    # shuffle the two kinds together so any slice of rows (and every batch) has both
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.seed + 1))
    prompts = [prompts[i] for i in order.tolist()]
    val_prompts = window_prompts(validation, cfg.val_prompts, cfg.min_prompt_tokens,
                                 min(cfg.max_prompt_tokens, validation.numel() - 1), cfg.seed + 2)
    return continue_and_write(target_dir, {"train": prompts, "validation": val_prompts},
                              out_dir, cfg, device, command, {"header_prompts": n_headers})


def continue_and_write(target_dir: str | Path, prompts: dict[str, list[list[int]]],
                       out_dir: str | Path, cfg: DistillDataConfig, device: str = "cpu",
                       command: str | None = None, extra: dict | None = None) -> dict:
    """The target's continuations of each split's token-id ``prompts`` (``train``,
    ``validation``) packed into rows and written to ``out_dir`` (``distill.pt``,
    ``tokens.pt``, the tokenizer, ``distill.json``: the summary, with ``extra``), by the
    engine or the dense generator (``cfg.generator``). Returns the summary."""
    from .tokenizer import TOKENIZER_FILES
    target_dir = Path(target_dir)
    generator = pick_forward("paged" if cfg.generator == "engine" else cfg.generator, device)
    continue_split, pad = _continuer(target_dir, cfg, device, generator)
    t0 = time.monotonic()
    splits = {}
    for name, ps in prompts.items():
        temps = cycle_temperatures(len(ps), cfg.temperatures)
        splits[name] = pack_rows(ps, continue_split(ps, temps), temps, pad, cfg.width)
    wall = time.monotonic() - t0
    summary = {"target": str(target_dir), "target_fingerprint": target_fingerprint(target_dir),
               "config": asdict(cfg), "command": command, **(extra or {}),
               "generator": "engine" if generator == "paged" else generator,
               "rows": {k: len(v) for k, v in splits.items()},
               "generated_tokens": {k: int((v.lengths - v.prompt_lens).sum())
                                    for k, v in splits.items()},
               "stream_tokens": {k: int(v.lengths.sum()) for k, v in splits.items()},
               "width": cfg.width, "wall_time_s": round(wall, 1),
               "threads": torch.get_num_threads(), "device": device}
    with replacing_dir(out_dir) as tmp:
        tmp.mkdir(parents=True)
        torch.save({k: v.to_dict() for k, v in splits.items()}, tmp / ROWS_FILE)
        torch.save({k: v.stream() for k, v in splits.items()}, tmp / "tokens.pt")
        for name in TOKENIZER_FILES:
            if (target_dir / name).is_file():
                shutil.copy2(target_dir / name, tmp / name)
        (tmp / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("distill-data: %d + %d rows (%d generated tokens) in %.0f s -> %s",
             len(splits["train"]), len(splits["validation"]),
             sum(summary["generated_tokens"].values()), wall, out_dir)
    return summary


def _continuer(target_dir: Path, cfg: DistillDataConfig, device: str, generator: str):
    """(continue(prompts, temperatures) -> continuations, the pad id) by the engine
    (``paged``) or the dense generator."""
    from ..models.tokenizer import generation_eos_ids, load_tokenizer
    tokenizer = load_tokenizer(target_dir)
    pad = tokenizer.token_to_id("<pad>") if tokenizer is not None else None
    pad = 0 if pad is None else pad
    if generator == "dense":
        from ..models import load_model
        from .dense_generate import generate_dense
        model = load_model(target_dir, cfg.dtype, device)
        eos = (generation_eos_ids(target_dir) or (None,))[0] if cfg.stop_at_eos else None
        return (lambda ps, temps: generate_dense(model, ps, temps, cfg.new_tokens, eos, cfg.seed,
                                                 cfg.batch, pad)), pad
    from ..engine.llm import LLM
    llm = LLM(str(target_dir), dtype=cfg.dtype, device=device, max_num_seqs=cfg.batch,
              max_num_batched_tokens=max(2048, cfg.max_prompt_tokens), enforce_eager=True,
              enable_prefix_caching=False)
    return (lambda ps, temps: generate(llm, ps, temps, cfg.new_tokens, cfg.top_p, cfg.seed,
                                       cfg.batch, not cfg.stop_at_eos)), pad


def load_distill_rows(path: str | Path, target_dir: str | Path | None = None
                      ) -> dict[str, DistillRows]:
    """The ``train`` and ``validation`` rows of a ``tandem train distill-data`` directory;
    with ``target_dir``, refuses rows generated by other target weights."""
    path = Path(path)
    rows_file = path / ROWS_FILE if path.is_dir() else path
    if not rows_file.is_file():
        raise FileNotFoundError(f"--distill-data {path}: no {ROWS_FILE}; make one with "
                                "`tandem train distill-data --target ... --out DIR`")
    meta = rows_file.parent / "distill.json"
    if target_dir is not None and meta.is_file():
        made_for = json.loads(meta.read_text()).get("target_fingerprint")
        if made_for != target_fingerprint(target_dir):
            raise ValueError(f"--distill-data {path}: generated by target weights {made_for}, "
                             f"not {target_dir} ({target_fingerprint(target_dir)}); "
                             "regenerate it for this target")
    d = torch.load(rows_file)
    return {k: DistillRows(**v) for k, v in d.items()}
