"""``tandem train lora``: a LoRA adapter on a frozen base, trained on styled answers.

The base (bf16 by default, frozen) is wrapped by :func:`.lora.apply_lora`; only the
adapters' A/B (fp32) are trained, with the loop of ``tandem train lm`` / ``mtp``
(:mod:`.loop`: AdamW, warm-up + cosine, clipping, resumable ``state.pt``). A batch is
``batch_size`` rows (prompt + styled answer + EOS) drawn by (seed, step), right-padded;
the loss is the cross-entropy of the answer tokens only (logits computed at those
positions alone). Validation: that loss on held-out rows. At the end the adapter is
written in PEFT's format (``dtype``, bf16 by default: checkpoints/ has a size budget) and
measured, read back from disk: the share of greedy answers to held-out questions that are
in the style, with the adapter and without it (the base alone).

>>> cfg = LoRATrainConfig.from_dict({"style": "shout", "lora": {"r": 4},
...                                  "optim": {"steps": 300}})
>>> cfg.lora.r, cfg.optim.steps, cfg.style
(4, 300, 'shout')
"""
from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .lora import LoRAConfig, apply_lora, load_adapter, lora_modules, save_adapter, set_lora_enabled
from .lora_data import encode_rows, load_answers, style
from .loop import (OptimConfig, StateFile, adamw, autocast, config_section, replacing_dir,
                   run_training)

log = logging.getLogger("tandem.train")
CONFIG_NAME = "lora training config"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(slots=True)
class LoRATrainConfig:
    style: str = "shout"
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(
        batch_size=8, steps=300, lr=1e-3, warmup_steps=20, weight_decay=0.0, log_every=10,
        eval_every=100, eval_windows=32))
    base_dtype: str = "bfloat16"        # the frozen base's weights
    save_dtype: str = "bfloat16"        # the adapter's tensors on disk
    eval_prompts: int = 48              # held-out questions answered for the measurement
    eval_new_tokens: int = 96

    @classmethod
    def from_dict(cls, d: dict) -> "LoRATrainConfig":
        d = {k: v for k, v in d.items() if k != "comment"}
        cfg = config_section(cls, {k: v for k, v in d.items() if k not in ("lora", "optim")},
                             CONFIG_NAME)
        if "lora" in d:
            cfg.lora = config_section(LoRAConfig, d["lora"], CONFIG_NAME)
        if "optim" in d:
            cfg.optim = config_section(OptimConfig, asdict(cls().optim) | d["optim"], CONFIG_NAME)
        style(cfg.style)
        for name in (cfg.base_dtype, cfg.save_dtype):
            if name not in DTYPES:
                raise ValueError(f"{CONFIG_NAME}: dtype {name!r}; allowed: {', '.join(DTYPES)}")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "LoRATrainConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return asdict(self)


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_id: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids [B, T], labels [B, T]) of prompt + answer rows, right-padded: a label is
    the next token where that token is part of the answer, else -100.

    >>> ids, labels = pad_rows([([5, 6], [7, 2]), ([5], [2])], pad_id=0)
    >>> ids.tolist(), labels.tolist()
    ([[5, 6, 7], [5, 0, 0]], [[-100, 7, 2], [2, -100, -100]])
    """
    width = max(len(p) + len(a) for p, a in rows) - 1
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        seq = p + a
        ids[i, :len(seq) - 1] = torch.tensor(seq[:-1])
        labels[i, len(p) - 1:len(seq) - 1] = torch.tensor(a)
    return ids, labels


def answer_loss(model, ids: torch.Tensor, labels: torch.Tensor, amp: str) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens (the lm_head runs at those positions only)."""
    from ..models.llama import forward_dense
    mask = labels >= 0
    with autocast(amp):
        hidden = forward_dense(model, ids)
        logits = model.compute_logits(hidden[mask])
    return F.cross_entropy(logits, labels[mask])


def greedy_answers(model, tokenizer, prompts: list[list[int]], new_tokens: int, eos_id: int,
                   pad_id: int) -> list[str]:
    from .dense_generate import generate_dense
    with torch.no_grad():
        out = generate_dense(model, prompts, [0.0] * len(prompts), new_tokens, eos_id, 0, 16, pad_id)
    return [tokenizer.decode(o, skip_special_tokens=True) for o in out]


def measure(model, tokenizer, rows, style_name: str, new_tokens: int, eos_id: int,
            pad_id: int) -> dict:
    """Share of greedy answers in the style, with and without the adapter, and examples."""
    prompts = [tokenizer.encode(r.prompt).ids for r in rows]
    check = style(style_name).check
    result = {"prompts": len(rows), "new_tokens": new_tokens}
    for label, enabled in (("with_adapter", True), ("base", False)):
        set_lora_enabled(model, enabled)
        t0 = time.monotonic()
        texts = greedy_answers(model, tokenizer, prompts, new_tokens, eos_id, pad_id)
        result[label] = {"in_style": sum(map(check, texts)) / len(texts),
                         "seconds": round(time.monotonic() - t0, 1),
                         "examples": [{"question": r.question, "answer": t}
                                      for r, t in zip(rows[:4], texts[:4])]}
        log.info("effect (%s): %.3f of %d greedy answers in the style %r", label,
                 result[label]["in_style"], len(texts), style_name)
    set_lora_enabled(model, True)
    return result


def train_lora(cfg: LoRATrainConfig, target: str, target_dir: Path, data: str | Path,
               work_dir: str | Path, out_dir: str | Path, resume: bool = False,
               max_steps: int | None = None, command: str | None = None) -> dict:
    """Train (or resume) an adapter, write it to ``out_dir`` with ``training.json`` (the
    record: config, command, data, loss history, measured effect) and return the record."""
    from ..engine.compiled_decode import _cpu_model
    from ..models import load_model
    from ..models.tokenizer import generation_eos_ids, load_tokenizer
    from .hidden_states import target_fingerprint

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    o = cfg.optim
    rows, data_summary = load_answers(data)
    tokenizer = load_tokenizer(target_dir)
    eos_id = generation_eos_ids(target_dir)[0]
    pad_id = eos_id
    train = encode_rows(rows["train"], tokenizer, cfg.style, eos_id)
    n_val = min(o.eval_windows, len(rows["held_out"]) // 2)
    val = encode_rows(rows["held_out"][:n_val], tokenizer, cfg.style, eos_id)
    eval_rows = rows["held_out"][n_val:n_val + cfg.eval_prompts]

    model = load_model(target_dir, cfg.base_dtype)
    apply_lora(model, cfg.lora, o.seed)
    # only A/B go to the optimizer and state.pt (the base is frozen and not saved)
    module = torch.nn.ParameterList(p for w in lora_modules(model).values()
                                    for p in w.parameters() if p.requires_grad)
    opt = adamw(module, o)
    states = StateFile(work / "state.pt", "adapter", cfg.to_dict())
    progress = states.restore(states.load(resume, can_restart=True), module, opt)
    tokens = sum(len(a) for _, a in train) / len(train) * o.batch_size

    def batch_at(step: int):
        g = torch.Generator().manual_seed(o.seed * 1_000_003 + step)
        idx = torch.randint(0, len(train), (o.batch_size,), generator=g).tolist()
        return pad_rows([train[i] for i in idx], pad_id)

    def train_loss(batch):
        loss = answer_loss(model, *batch, o.amp)
        return loss, (loss.item(),)

    def val_loss() -> float:
        with torch.no_grad():
            losses = [answer_loss(model, *pad_rows(val[i:i + 8], pad_id), o.amp).item()
                      * len(val[i:i + 8]) for i in range(0, len(val), 8)]
        return sum(losses) / len(val)

    def evaluate(figures) -> None:
        v = val_loss()
        progress.history.append({"step": progress.step, "train_loss": round(figures[0], 4),
                                 "val_loss": round(v, 4), "wall_time_s": round(progress.wall_time_s, 1)})
        log.info("step %d: validation answer loss %.4f", progress.step, v)

    if progress.step == 0:
        set_lora_enabled(model, False)
        base_val = val_loss()
        set_lora_enabled(model, True)
        progress.history.append({"step": 0, "val_loss": round(base_val, 4), "wall_time_s": 0.0})
        log.info("step 0 (the base alone): validation answer loss %.4f", base_val)
    run_training(module, opt, o, progress, batch_at=batch_at, train_loss=train_loss,
                 evaluate=evaluate, save=lambda: states.save(progress, module, opt),
                 tokens_per_step=int(tokens), max_steps=max_steps)

    record = {"style": cfg.style, "description": style(cfg.style).description,
              "target": target, "target_fingerprint": target_fingerprint(target_dir),
              "config": cfg.to_dict(), "command": command, "step": progress.step,
              "steps_planned": o.steps, "wall_time_s": round(progress.wall_time_s, 1),
              "data": {"path": str(data), "train_rows": len(train), "validation_rows": len(val),
                       "eval_prompts": len(eval_rows),
                       "train_answer_tokens": sum(len(a) for _, a in train),
                       "generated_by": data_summary},
              "history": progress.history, "threads": torch.get_num_threads(),
              "cpu": _cpu_model() or platform.machine(),
              "date": time.strftime("%Y-%m-%d", time.gmtime())}
    with replacing_dir(out_dir) as tmp:
        save_adapter(model, tmp, cfg.lora, target, DTYPES[cfg.save_dtype])
        # the effect of the adapter as shipped (its on-disk dtype), read back from disk
        check = load_model(target_dir, cfg.base_dtype)
        load_adapter(check, tmp)
        record["effect"] = measure(check, tokenizer, eval_rows, cfg.style, cfg.eval_new_tokens,
                                   eos_id, pad_id)
        (tmp / "training.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return record
