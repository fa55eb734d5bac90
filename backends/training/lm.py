"""Causal-LM training for the demo target and draft (``tandem train lm``).

AdamW with linear warm-up and cosine decay, bf16 autocast (fp32 master weights),
gradient clipping, periodic validation, optional distillation from a teacher's
logits. Every ``save_every_minutes`` the full training state goes to
``work_dir/state.pt`` and an HF-format bf16 export to ``work_dir/latest/``;
``--resume`` continues from the state, drawing the same batches an uninterrupted
run would. SIGTERM / SIGINT save the state before exiting. The loop is
:func:`.loop.run_training`; this module gives it the LM's batches, loss, evaluation
and exports.

>>> cfg = LMTrainConfig.from_file("configs/target.json")              # doctest: +SKIP
>>> train_lm(cfg, work_dir=".cache/train/target", out_dir="checkpoints/demo/target")  # doctest: +SKIP
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models import LlamaForCausalLM, ModelConfig, forward_dense, load_model
from .data import TokenData, next_token_windows, on_distill_rows, prepare_data, sample_batch
from .hf_export import save_hf_checkpoint
from .loop import (OptimConfig, StateFile, adamw, autocast, config_section, replacing_dir,
                   run_training)
from .tokenizer import TOKENIZER_FILES, special_ids

log = logging.getLogger("tandem.train")
SHIPPED_DATA_FILES = TOKENIZER_FILES + ("prompts.json", "corpus.json")
CONFIG_NAME = "training config"    # in its error messages


@dataclass(slots=True)
class DataConfig:
    vocab_size: int = 4096
    val_fraction: float = 0.05
    root: str | None = None         # corpus root; None = this interpreter's stdlib
    tokenizer: str | None = None    # reuse a tokenizer directory (a draft uses its target's)
    distill_data: str | None = None  # `tandem train distill-data` output: the target's own text
    distill_fraction: float = 1.0   # share of steps whose batch comes from distill_data


@dataclass(slots=True)
class DistillConfig:
    teacher: str                    # HF checkpoint dir sharing the tokenizer
    alpha: float = 0.5              # weight of the KL term; 1 - alpha on the hard labels
    temperature: float = 1.0


@dataclass(slots=True)
class LMTrainConfig:
    model: dict                     # HF Llama config fields (vocab_size comes from the tokenizer)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distill: DistillConfig | None = None
    init_from: str | None = None    # HF checkpoint to start from (e.g. distilling a trained draft)

    @classmethod
    def from_dict(cls, d: dict) -> "LMTrainConfig":
        allowed = {"model", "optim", "data", "distill", "init_from", "comment"}
        unknown = set(d) - allowed
        if unknown or "model" not in d:
            raise ValueError(f"{CONFIG_NAME}: unknown sections {sorted(unknown)} or no 'model'; "
                             f"allowed: {', '.join(sorted(allowed))}")
        distill = d.get("distill")
        return cls(model=dict(d["model"]),
                   optim=config_section(OptimConfig, d.get("optim", {}), CONFIG_NAME),
                   data=config_section(DataConfig, d.get("data", {}), CONFIG_NAME),
                   distill=config_section(DistillConfig, distill, CONFIG_NAME) if distill else None,
                   init_from=d.get("init_from"))

    @classmethod
    def from_file(cls, path: str | Path) -> "LMTrainConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return {"model": self.model, "optim": asdict(self.optim), "data": asdict(self.data),
                "distill": asdict(self.distill) if self.distill else None,
                "init_from": self.init_from}


def model_config(cfg: LMTrainConfig, vocab_size: int, ids: dict[str, int]) -> ModelConfig:
    d = {"model_type": "llama", "max_position_embeddings": cfg.optim.seq_len,
         "rms_norm_eps": 1e-5} | cfg.model | {"vocab_size": vocab_size}
    d.setdefault("bos_token_id", ids["bos"])
    d.setdefault("eos_token_id", ids["eos"])
    return ModelConfig.from_dict(d)


def init_weights(model: LlamaForCausalLM, std: float) -> None:
    """Normal(0, std) everywhere; residual output projections scaled by 1/sqrt(2 * layers)."""
    resid_std = std / math.sqrt(2 * max(1, model.config.num_hidden_layers))
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            torch.nn.init.ones_(p)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(p, 0.0, resid_std)
        else:
            torch.nn.init.normal_(p, 0.0, std)


def lm_loss(model: LlamaForCausalLM, batch: torch.Tensor, amp: str,
            teacher: LlamaForCausalLM | None = None,
            distill: DistillConfig | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of batch [B, T+1] (plus distillation if a teacher is given)."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    with autocast(amp):
        logits = model.compute_logits(forward_dense(model, inputs))
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    if teacher is None:
        return ce
    with torch.no_grad(), autocast(amp):
        t_logits = teacher.compute_logits(forward_dense(teacher, inputs))
    temp = distill.temperature
    kl = F.kl_div(F.log_softmax(logits / temp, -1).flatten(0, 1),
                  F.log_softmax(t_logits / temp, -1).flatten(0, 1),
                  log_target=True, reduction="batchmean") * temp ** 2
    return (1 - distill.alpha) * ce + distill.alpha * kl


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: torch.Tensor, amp: str, batch_size: int) -> float:
    """Mean next-token cross-entropy over validation windows [n, T+1]."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, windows.shape[0], batch_size):
        chunk = windows[i:i + batch_size]
        total += lm_loss(model, chunk, amp).item() * chunk.shape[0]
    model.train(was_training)
    return total / windows.shape[0]


def export_checkpoint(model: LlamaForCausalLM, data_dir: Path, out_dir: str | Path,
                      ids: dict[str, int], summary: dict) -> Path:
    """HF bf16 weights + tokenizer + held-out prompts + training summary into out_dir."""
    with replacing_dir(out_dir) as tmp:
        save_hf_checkpoint(model, tmp, torch.bfloat16, ids)
        for name in SHIPPED_DATA_FILES:
            if (data_dir / name).is_file():
                shutil.copy2(data_dir / name, tmp / name)
        (tmp / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return Path(out_dir)


def train_lm(cfg: LMTrainConfig, work_dir: str | Path, out_dir: str | Path | None = None,
             resume: bool = False, max_steps: int | None = None,
             command: str | None = None) -> dict:
    """Train (or resume) and return the summary; ``max_steps`` stops early (tests, slices).

    ``work_dir`` holds the cached data, ``state.pt`` and ``latest/``; ``out_dir``, when
    given, receives the final export.
    """
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    o = cfg.optim
    states = StateFile(work / "state.pt", "model", cfg.to_dict())
    state = states.load(resume)
    if state is not None and state["config"]["model"] != cfg.model:
        raise ValueError(f"--resume: model section of the config differs from {states.path}")
    (work / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    d = cfg.data
    data: TokenData = prepare_data(work, d.vocab_size, d.val_fraction, d.root, d.tokenizer, o.seq_len)
    ids = special_ids(data.tokenizer)
    distilled = load_distilled_streams(d.distill_data, data) if d.distill_data else None
    model = build_model(cfg, model_config(cfg, data.tokenizer.get_vocab_size(), ids))
    opt = adamw(model, o)
    teacher = load_teacher(cfg.distill, model.config) if cfg.distill is not None else None
    progress = states.restore(state, model, opt)
    history = progress.history
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %s params %.2fM; train tokens %d, validation tokens %d; threads %d",
             json.dumps(cfg.model), n_params / 1e6, data.train.numel(), data.validation.numel(),
             torch.get_num_threads())
    val_eval = next_token_windows(data.validation, o.seq_len, o.eval_windows)
    val_distill = None
    if distilled is not None:
        log.info("self-distillation data %s: %d train tokens (%.0f%% of the steps), %d "
                 "validation tokens", d.distill_data, distilled["train"].numel(),
                 100 * d.distill_fraction, distilled["validation"].numel())
        if distilled["validation"].numel() > o.seq_len + 1:
            val_distill = next_token_windows(distilled["validation"], o.seq_len, o.eval_windows)

    def summary(final_val: float | None = None) -> dict:
        return {"params": n_params, "step": progress.step, "steps_planned": o.steps,
                "tokens_seen": progress.step * o.batch_size * o.seq_len,
                "wall_time_s": round(progress.wall_time_s, 1),
                "threads": torch.get_num_threads(), "seed": o.seed, "command": command,
                "val_loss_periodic": history[-1]["val_loss"] if history else None,
                "val_loss_full": final_val, "config": cfg.to_dict(), "history": history,
                "best_val_step": min(history, key=lambda h: h["val_loss"])["step"] if history else None}

    def train_loss(batch: torch.Tensor) -> tuple[torch.Tensor, tuple[float]]:
        loss = lm_loss(model, batch, o.amp, teacher, cfg.distill)
        return loss, (loss.item(),)

    def validate(figures) -> None:
        t_eval = time.monotonic()
        val = evaluate(model, val_eval, o.amp, o.batch_size)
        history.append({"step": progress.step, "train_loss": round(figures[0], 4),
                        "val_loss": round(val, 4), "wall_time_s": round(progress.wall_time_s, 1)})
        if val_distill is not None:     # the target's own continuations of validation prompts
            history[-1]["val_loss_distill"] = round(
                evaluate(model, val_distill, o.amp, o.batch_size), 4)
        log.info("step %d val_loss %.4f%s (eval %.1f s)", progress.step, val,
                 f" on the target's text {history[-1]['val_loss_distill']:.4f}"
                 if val_distill is not None else "", time.monotonic() - t_eval)
        if round(val, 4) <= min(h["val_loss"] for h in history):  # history holds rounded values
            # the corpus is small and repeated: keep the best weights seen
            export_checkpoint(model, data.tokenizer_dir, work / "best", ids, summary())

    def save() -> None:
        states.save(progress, model, opt)
        export_checkpoint(model, data.tokenizer_dir, work / "latest", ids, summary())

    def batch_at(step: int) -> torch.Tensor:
        if distilled is not None and on_distill_rows(o.seed, step, d.distill_fraction):
            return sample_batch(distilled["train"], o.batch_size, o.seq_len, o.seed, step)
        return sample_batch(data.train, o.batch_size, o.seq_len, o.seed, step)

    run_training(model, opt, o, progress, max_steps=max_steps, batch_at=batch_at,
                 train_loss=train_loss, evaluate=validate, save=save,
                 tokens_per_step=o.batch_size * o.seq_len)
    result = summary()
    if progress.step >= o.steps and out_dir is not None:
        val = evaluate(model, next_token_windows(data.validation, o.seq_len), o.amp, o.batch_size)
        log.info("finished: full validation loss %.4f over %d tokens", val, data.validation.numel())
        result = summary(round(val, 4))
        export_checkpoint(model, data.tokenizer_dir, out_dir, ids, result)
        log.info("exported to %s (best periodic val_loss at step %s: see %s)",
                 out_dir, result["best_val_step"], work / "best")
    return result


def load_distilled_streams(path: str | Path, data: TokenData) -> dict[str, torch.Tensor]:
    """The token streams of a ``tandem train distill-data`` directory (its rows
    concatenated), which must share the run's tokenizer."""
    path = Path(path)
    if not (path / "tokens.pt").is_file():
        raise FileNotFoundError(f"data.distill_data {path}: no tokens.pt; make it with "
                                "`tandem train distill-data --target ... --out DIR`")
    theirs, ours = path / "tokenizer.json", data.tokenizer_dir / "tokenizer.json"
    if theirs.is_file() and ours.is_file() and theirs.read_bytes() != ours.read_bytes():
        raise ValueError(f"data.distill_data {path}: its tokenizer.json differs from this "
                         f"run's ({ours})")
    return torch.load(path / "tokens.pt")


def build_model(cfg: LMTrainConfig, mcfg: ModelConfig) -> LlamaForCausalLM:
    """A model initialised from ``optim.seed`` or, with ``init_from``, that checkpoint's weights."""
    torch.manual_seed(cfg.optim.seed)
    model = LlamaForCausalLM(mcfg)
    init_weights(model, cfg.optim.init_std)
    if cfg.init_from is not None:
        init = load_model(cfg.init_from, "float32")
        if replace(init.config, torch_dtype=mcfg.torch_dtype) != mcfg:
            raise ValueError(f"init_from {cfg.init_from}: its config.json differs from the "
                             "model section of this config")
        model.load_state_dict(init.state_dict())
    return model


def load_teacher(distill: DistillConfig, student: ModelConfig) -> LlamaForCausalLM:
    teacher = load_model(distill.teacher, "float32")
    if teacher.config.vocab_size != student.vocab_size:
        raise ValueError(f"distill.teacher vocab {teacher.config.vocab_size} != "
                         f"student vocab {student.vocab_size}: they must share the tokenizer")
    return teacher


def export_from_work_dir(work_dir: str | Path, out_dir: str | Path, which: str = "latest") -> Path:
    """Copy ``work_dir/latest`` (last periodic save) or ``work_dir/best`` (lowest
    periodic validation loss) to out_dir; both are HF-format bf16 checkpoints."""
    if which not in ("latest", "best"):
        raise ValueError(f"export: {which!r} is not a saved checkpoint; allowed: latest, best")
    latest = Path(work_dir) / which
    if not (latest / "config.json").is_file():
        raise FileNotFoundError(f"{latest}: no saved checkpoint yet")
    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(latest, out)
    return out
