"""Offline evaluation of MTP heads (``tandem train mtp-offline-eval``): several heads on the
same held-out windows in one run, with the training forward (teacher-forced), so heads the
engine cannot serve yet (an EAGLE-3-style fused head) are compared with those it can.

Per head and held-out set: top-1 agreement with the target's next token for draft steps
1..3 (steps 2, 3 read the head's own output as the hidden state), KL, and the
teacher-forced chained acceptance length at k=3 (:func:`.mtp.chained_acceptance`).
Acceptance through the engine is :mod:`.acceptance` (``tandem train mtp-eval``).

>>> report = evaluate_heads("checkpoints/demo/target", {"mtp": "checkpoints/demo/mtp"},
...                         {"rows": (windows, lengths)}, ".cache/train/mtp-hidden")  # doctest: +SKIP
>>> report["mtp"]["rows"]["top1"]                                                   # doctest: +SKIP
[0.64, 0.6, 0.59]
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..models import load_model
from ..models.mtp import load_mtp_head
from .hidden_states import load_or_compute
from .mtp import MTPConfig, evaluate

log = logging.getLogger("tandem.train")


def evaluate_heads(target_dir: str | Path, heads: dict[str, str | Path],
                   sets: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                   cache: str | Path, dtype: str = "bfloat16", device: str = "cpu",
                   amp: str = "bf16", batch_size: int = 8) -> dict:
    """``{head: {set: figures}}`` for heads (name -> directory) on held-out sets (name ->
    (windows [n, W], lengths [n] or None)); hidden states (and a fused head's layer
    outputs) through the engine's forward in ``dtype``, cached in ``cache``."""
    serving = load_model(target_dir, dtype, device)
    target = load_model(target_dir, "float32", device)     # its norm and lm_head, as in training
    report: dict = {}
    for name, head_dir in heads.items():
        head = load_mtp_head(head_dir, target)
        fuse = head.fuse_layers
        report[name] = {"dir": str(head_dir), "fuse_layers": list(fuse) if fuse else None}
        for set_name, (windows, lengths) in sets.items():
            hs = load_or_compute(target_dir, windows, cache, dtype, device, serving, lengths, fuse)
            t0 = time.monotonic()
            val = evaluate(head, target, hs, MTPConfig(), amp, batch_size)
            report[name][set_name] = {k: [round(x, 4) for x in v] for k, v in val.items()}
            log.info("%s on %s (%d windows): top1 %s kl %s accept@3 %.3f (%.0f s)", name,
                     set_name, len(windows), "/".join(f"{x:.4f}" for x in val["top1"]),
                     "/".join(f"{x:.4f}" for x in val["kl"]), val["accept"][0],
                     time.monotonic() - t0)
    return report


def format_report(report: dict) -> str:
    """A Markdown table: one row per (head, set)."""
    lines = ["| head | held-out set | top-1 step 1 / 2 / 3 | KL step 1 | accept. length k=3 "
             "(teacher-forced) |", "|---|---|---|---:|---:|"]
    for name, per_set in report.items():
        for set_name, v in per_set.items():
            if not isinstance(v, dict):
                continue
            lines.append(f"| {name} | {set_name} | {' / '.join(f'{x:.3f}' for x in v['top1'])} "
                         f"| {v['kl'][0]:.3f} | {v['accept'][0]:.3f} |")
    return "\n".join(lines)
