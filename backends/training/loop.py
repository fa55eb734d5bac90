"""The training loop of ``tandem train lm`` and ``tandem train mtp``.

AdamW (weight decay on matrices only), linear warm-up then cosine decay, gradient
clipping, a log line every ``log_every`` steps, an evaluation every ``eval_every``
steps and at the last one, the state saved every ``save_every_minutes`` and when the
loop ends. SIGTERM / SIGINT stop it at the next step boundary, after which the state
is saved. The batch of a step depends on the step alone, so ``--resume`` draws the
batches an uninterrupted run would.

What differs between the runs is passed in: the batch of a step, the loss of a batch,
the evaluation (it records the history and exports the best weights) and the save
(``state.pt`` through :class:`StateFile`, plus any export).

>>> states = StateFile(work / "state.pt", "model", cfg.to_dict())          # doctest: +SKIP
>>> opt = adamw(model, cfg.optim)                                           # doctest: +SKIP
>>> progress = states.restore(states.load(resume), model, opt)              # doctest: +SKIP
>>> run_training(model, opt, cfg.optim, progress, batch_at=..., train_loss=...,
...              evaluate=..., save=..., tokens_per_step=8 * 512)          # doctest: +SKIP
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tandem.train")


@dataclass(slots=True)
class OptimConfig:
    """The ``optim`` section of a training config: the loop's settings."""
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


def config_section(cls, d: dict, what: str):
    """``cls(**d)`` for a config section, refusing keys ``cls`` lacks (``what``: the
    config's name in the message)."""
    names = {f.name for f in fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"{what}: unknown {cls.__name__} keys {sorted(unknown)}; "
                         f"allowed: {', '.join(sorted(names))}")
    return cls(**d)


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


def adamw(module: torch.nn.Module, o: OptimConfig) -> torch.optim.AdamW:
    """AdamW decaying the matrices only: norms and biases keep weight decay 0."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=o.lr, betas=(o.beta1, o.beta2))


@dataclass(slots=True)
class Progress:
    """How far a run got; saved in ``state.pt`` and advanced by :func:`run_training`."""
    step: int = 0
    wall_time_s: float = 0.0        # time in training steps (not evaluations or saves)
    history: list[dict] = field(default_factory=list)   # one entry per evaluation


@dataclass(slots=True)
class StateFile:
    """``state.pt``: the weights under ``key``, the optimizer, the config, the progress and
    what a run adds (``extra``)."""
    path: Path
    key: str                        # "model" (lm) or "head" (mtp)
    config: dict

    def load(self, resume: bool, can_restart: bool = False) -> dict | None:
        """The state to continue (``resume``), or None for a fresh run, which refuses to
        overwrite one (``can_restart``: the CLI offers ``--restart`` too)."""
        if resume:
            if not self.path.is_file():
                raise FileNotFoundError(f"--resume: no {self.path}; start without --resume")
            return torch.load(self.path, weights_only=False)
        if self.path.is_file():
            restart = ", --restart to start over," if can_restart else ""
            raise FileExistsError(f"{self.path} exists; pass --resume to continue it{restart} "
                                  "or choose another --work-dir")
        return None

    def restore(self, state: dict | None, module: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> Progress:
        """Load a state from :meth:`load` into module and optimizer; a fresh Progress if None."""
        if state is None:
            return Progress()
        module.load_state_dict(state[self.key])
        optimizer.load_state_dict(state["optimizer"])
        progress = Progress(state["step"], state["wall_time_s"], state["history"])
        log.info("resumed at step %d (%.0f s of training so far)", progress.step,
                 progress.wall_time_s)
        return progress

    def save(self, progress: Progress, module: torch.nn.Module,
             optimizer: torch.optim.Optimizer, **extra) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save({"step": progress.step, self.key: module.state_dict(),
                    "optimizer": optimizer.state_dict(), "config": self.config,
                    "wall_time_s": progress.wall_time_s, "history": progress.history, **extra}, tmp)
        os.replace(tmp, self.path)


@contextmanager
def replacing_dir(out: str | Path) -> Iterator[Path]:
    """A fresh ``<out>.tmp`` to fill; it replaces ``out`` only when the block succeeds,
    so ``out`` is never a half-written checkpoint."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    yield tmp
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


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


def run_training(module: torch.nn.Module, optimizer: torch.optim.Optimizer, o: OptimConfig,
                 progress: Progress, *, batch_at: Callable[[int], Any],
                 train_loss: Callable[[Any], tuple[torch.Tensor, Sequence[float]]],
                 evaluate: Callable[[Sequence[float]], None], save: Callable[[], None],
                 tokens_per_step: int, log_format: str = "loss %.4f",
                 max_steps: int | None = None) -> None:
    """Train from ``progress.step`` to ``o.steps`` (or ``max_steps`` more), then save.

    - ``batch_at(step)``: the batch of a step, a function of the step alone;
    - ``train_loss(batch)``: the loss to backpropagate and the figures the log line shows,
      averaged over the steps since the last one, formatted by ``log_format``;
    - ``evaluate(figures)``: validation after the step whose figures are given (appends
      to ``progress.history``; may export);
    - ``save()``: the state (:meth:`StateFile.save`) and any export.
    """
    def checkpoint() -> None:
        save()
        log.info("saved state at step %d", progress.step)

    end = o.steps if max_steps is None else min(o.steps, progress.step + max_steps)
    with _StopFlag() as stop:
        module.train()
        last_save = t_log = time.monotonic()
        sums, n_log = None, 0
        while progress.step < end and not stop.set:
            t0 = time.monotonic()
            lr = lr_at(progress.step, o)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, figures = train_loss(batch_at(progress.step))
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(module.parameters(), o.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            progress.wall_time_s += time.monotonic() - t0
            step = progress.step
            sums = list(figures) if sums is None else [a + x for a, x in zip(sums, figures)]
            n_log += 1
            if step % o.log_every == 0 or step == end:
                log.info(f"step %d/%d {log_format} lr %.2e gnorm %.2f %.0f tok/s", step, o.steps,
                         *(x / n_log for x in sums), lr, gnorm,
                         n_log * tokens_per_step / (time.monotonic() - t_log))
                t_log, sums, n_log = time.monotonic(), None, 0
            if step % o.eval_every == 0 or step == end:
                t_eval = time.monotonic()
                evaluate(figures)
                t_log += time.monotonic() - t_eval      # tok/s counts training time only
            if time.monotonic() - last_save > o.save_every_minutes * 60:
                checkpoint()
                last_save = time.monotonic()
    checkpoint()


def setup_logging(log_file: str | Path | None) -> None:
    """The ``tandem.train`` log to stderr and, when given, to ``log_file`` (replacing
    the file of a previous call)."""
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
