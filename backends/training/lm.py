"""Causal-LM training for the demo target and draft (``tandem train lm``).

AdamW with linear warm-up and cosine decay, bf16 autocast (fp32 master weights),
gradient clipping, periodic validation, optional distillation from a teacher's
logits. Every ``save_every_minutes`` the full training state goes to
``work_dir/state.pt`` and an HF-format bf16 export to ``work_dir/latest/``;
``--resume`` continues from the state, drawing the same batches an uninterrupted
run would. SIGTERM / SIGINT save the state before exiting.

>>> cfg = LMTrainConfig.from_file("configs/target.json")              # doctest: +SKIP
>>> train_lm(cfg, work_dir=".cache/train/target", out_dir="checkpoints/demo/target")  # doctest: +SKIP
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models import LlamaForCausalLM, ModelConfig, forward_dense, load_model
from .data import TokenData, prepare_data, sample_batch, validation_windows
from .hf_export import save_hf_checkpoint
from .tokenizer import TOKENIZER_FILES, special_ids

log = logging.getLogger("tandem.train")
SHIPPED_DATA_FILES = TOKENIZER_FILES + ("prompts.json", "corpus.json")


@dataclass(slots=True)
class OptimConfig:
    batch_size: int = 8
    seq_len: int = 512
    steps: int = 4000
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    init_std: float = 0.02
    amp: str = "bf16"               # "bf16" autocast or "none"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 48          # validation windows per periodic eval (all at the end)
    save_every_minutes: float = 10.0


@dataclass(slots=True)
class DataConfig:
    vocab_size: int = 4096
    val_fraction: float = 0.05
    root: str | None = None         # corpus root; None = this interpreter's stdlib
    tokenizer: str | None = None    # reuse a tokenizer directory (a draft uses its target's)


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
            raise ValueError(f"training config: unknown sections {sorted(unknown)} or no 'model'; "
                             f"allowed: {', '.join(sorted(allowed))}")
        return cls(model=dict(d["model"]),
                   optim=_build(OptimConfig, d.get("optim", {})),
                   data=_build(DataConfig, d.get("data", {})),
                   distill=_build(DistillConfig, d["distill"]) if d.get("distill") else None,
                   init_from=d.get("init_from"))

    @classmethod
    def from_file(cls, path: str | Path) -> "LMTrainConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return {"model": self.model, "optim": asdict(self.optim), "data": asdict(self.data),
                "distill": asdict(self.distill) if self.distill else None,
                "init_from": self.init_from}


def _build(cls, d: dict):
    names = {f.name for f in fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"training config: unknown {cls.__name__} keys {sorted(unknown)}; "
                         f"allowed: {', '.join(sorted(names))}")
    return cls(**d)


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


def lr_at(step: int, o: OptimConfig) -> float:
    """Linear warm-up to ``lr``, cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, o.steps - o.warmup_steps))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(amp: str):
    if amp == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16) if not torch.cuda.is_available() \
            else torch.autocast("cuda", dtype=torch.bfloat16)
    if amp == "none":
        return nullcontext()
    raise ValueError(f"optim.amp {amp!r} is not supported; allowed: bf16, none")


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


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop saves and exits at the next step boundary."""

    def __init__(self):
        self.set = False
        self._previous = {}

    def __enter__(self) -> "_StopFlag":
        if threading.current_thread() is threading.main_thread():   # signal() needs it
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        log.info("signal %d: saving state and stopping after this step", signum)
        self.set = True


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def export_checkpoint(model: LlamaForCausalLM, data_dir: Path, out_dir: str | Path,
                      ids: dict[str, int], summary: dict) -> Path:
    """HF bf16 weights + tokenizer + held-out prompts + training summary into out_dir."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_checkpoint(model, tmp, torch.bfloat16, ids)
    for name in SHIPPED_DATA_FILES:
        if (data_dir / name).is_file():
            shutil.copy2(data_dir / name, tmp / name)
    (tmp / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def setup_logging(log_file: str | Path | None) -> None:
    log.setLevel(logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S")
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in log.handlers):
        sh = logging.StreamHandler()
        sh.setFormatter(fmt)
        log.addHandler(sh)
    for h in [h for h in log.handlers if isinstance(h, logging.FileHandler)]:
        log.removeHandler(h)
        h.close()
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(log_file)
        fh.setFormatter(fmt)
        log.addHandler(fh)


def train_lm(cfg: LMTrainConfig, work_dir: str | Path, out_dir: str | Path | None = None,
             resume: bool = False, max_steps: int | None = None,
             command: str | None = None) -> dict:
    """Train (or resume) and return the summary; ``max_steps`` stops early (tests, slices).

    ``work_dir`` holds the cached data, ``state.pt`` and ``latest/``; ``out_dir``, when
    given, receives the final export.
    """
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "state.pt"
    o = cfg.optim
    state = None
    if resume:
        if not state_path.is_file():
            raise FileNotFoundError(f"--resume: no {state_path}; start without --resume")
        state = torch.load(state_path, weights_only=False)
        if state["config"]["model"] != cfg.model:
            raise ValueError(f"--resume: model section of the config differs from {state_path}")
    elif state_path.is_file():
        raise FileExistsError(f"{state_path} exists; pass --resume to continue it "
                              "or choose another --work-dir")
    (work / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    d = cfg.data
    data: TokenData = prepare_data(work, d.vocab_size, d.val_fraction, d.root, d.tokenizer, o.seq_len)
    ids = special_ids(data.tokenizer)
    mcfg = model_config(cfg, data.tokenizer.get_vocab_size(), ids)
    torch.manual_seed(o.seed)
    model = LlamaForCausalLM(mcfg)
    init_weights(model, o.init_std)
    if cfg.init_from is not None:
        init = load_model(cfg.init_from, "float32")
        if replace(init.config, torch_dtype=mcfg.torch_dtype) != mcfg:
            raise ValueError(f"init_from {cfg.init_from}: its config.json differs from the "
                             "model section of this config")
        model.load_state_dict(init.state_dict())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2))
    teacher = None
    if cfg.distill is not None:
        teacher = load_model(cfg.distill.teacher, "float32")
        if teacher.config.vocab_size != mcfg.vocab_size:
            raise ValueError(f"distill.teacher vocab {teacher.config.vocab_size} != "
                             f"student vocab {mcfg.vocab_size}: they must share the tokenizer")

    step, wall, history = 0, 0.0, []
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, wall, history = state["step"], state["wall_time_s"], state["history"]
        log.info("resumed at step %d (%.0f s of training so far)", step, wall)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %s params %.2fM; train tokens %d, validation tokens %d; threads %d",
             json.dumps(cfg.model), n_params / 1e6, data.train.numel(), data.validation.numel(),
             torch.get_num_threads())
    val_eval = validation_windows(data.validation, o.seq_len, o.eval_windows)

    def summary(final_val: float | None = None) -> dict:
        return {"params": n_params, "step": step, "steps_planned": o.steps,
                "tokens_seen": step * o.batch_size * o.seq_len, "wall_time_s": round(wall, 1),
                "threads": torch.get_num_threads(), "seed": o.seed, "command": command,
                "val_loss_periodic": history[-1]["val_loss"] if history else None,
                "val_loss_full": final_val, "config": cfg.to_dict(), "history": history,
                "best_val_step": min(history, key=lambda h: h["val_loss"])["step"] if history else None}

    def save_state() -> None:
        _atomic_save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                      "config": cfg.to_dict(), "wall_time_s": wall, "history": history}, state_path)
        export_checkpoint(model, data.tokenizer_dir, work / "latest", ids, summary())
        log.info("saved state at step %d", step)

    with _StopFlag() as stop:
        model.train()
        end = o.steps if max_steps is None else min(o.steps, step + max_steps)
        last_save = time.monotonic()
        t_log, loss_sum, n_log = time.monotonic(), 0.0, 0
        while step < end and not stop.set:
            t0 = time.monotonic()
            lr = lr_at(step, o)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = sample_batch(data.train, o.batch_size, o.seq_len, o.seed, step)
            loss = lm_loss(model, batch, o.amp, teacher, cfg.distill)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            wall += time.monotonic() - t0
            loss_sum, n_log = loss_sum + loss.item(), n_log + 1
            if step % o.log_every == 0 or step == end:
                dt = time.monotonic() - t_log
                log.info("step %d/%d loss %.4f lr %.2e gnorm %.2f %.0f tok/s", step, o.steps,
                         loss_sum / n_log, lr, gnorm, n_log * o.batch_size * o.seq_len / dt)
                t_log, loss_sum, n_log = time.monotonic(), 0.0, 0
            if step % o.eval_every == 0 or step == end:
                t_eval = time.monotonic()
                val = evaluate(model, val_eval, o.amp, o.batch_size)
                history.append({"step": step, "train_loss": round(loss.item(), 4),
                                "val_loss": round(val, 4), "wall_time_s": round(wall, 1)})
                log.info("step %d val_loss %.4f (eval %.1f s)", step, val, time.monotonic() - t_eval)
                if round(val, 4) <= min(h["val_loss"] for h in history):  # history holds rounded values
                    # the corpus is small and repeated: keep the best weights seen
                    export_checkpoint(model, data.tokenizer_dir, work / "best", ids, summary())
                t_log += time.monotonic() - t_eval
            if time.monotonic() - last_save > o.save_every_minutes * 60:
                save_state()
                last_save = time.monotonic()
    save_state()
    result = summary()
    if step >= o.steps and out_dir is not None:
        val = evaluate(model, validation_windows(data.validation, o.seq_len), o.amp, o.batch_size)
        log.info("finished: full validation loss %.4f over %d tokens", val, data.validation.numel())
        result = summary(round(val, 4))
        export_checkpoint(model, data.tokenizer_dir, out_dir, ids, result)
        log.info("exported to %s (best periodic val_loss at step %s: see %s)",
                 out_dir, result["best_val_step"], work / "best")
    return result


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
