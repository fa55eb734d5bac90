"""Whether a proposer checkpoint can serve a target, read from the two config.json files
alone (no torch): an MTP head reads the target's hidden states and shares its embeddings
and lm_head, so hidden size and vocabulary must match; a draft model's tokens are the
target's, so the vocabulary must. ``--spec auto`` skips a default proposer that does not
fit (any Llama-family target still starts); a proposer the user names is refused when it
loads.

>>> proposer_misfit({"architectures": ["TandemMTPHead"], "hidden_size": 384, "vocab_size": 4096},
...                 {"hidden_size": 576, "vocab_size": 49152})
'it was trained for hidden 384, vocab 4096; the target has hidden 576, vocab 49152'
>>> proposer_misfit({"hidden_size": 192, "vocab_size": 4096}, {"hidden_size": 384, "vocab_size": 4096})
''

A target's default proposer is the first of several checkpoints that fits it
(:func:`first_fitting`): the SmolLM2 head for SmolLM2, the demo's head for the demo target.
"""
from __future__ import annotations

import json
from pathlib import Path

MTP_ARCHITECTURE = "TandemMTPHead"   # as models/mtp.py writes it


def proposer_misfit(proposer: dict, target: dict) -> str:
    """Why a proposer with config ``proposer`` cannot serve a target with config
    ``target`` ("" when it can)."""
    is_head = MTP_ARCHITECTURE in proposer.get("architectures", [])
    keys = ("hidden_size", "vocab_size") if is_head else ("vocab_size",)
    if all(proposer.get(k) == target.get(k) for k in keys):
        return ""
    have = ", ".join(f"{k.removesuffix('_size')} {proposer.get(k)}" for k in keys)
    need = ", ".join(f"{k.removesuffix('_size')} {target.get(k)}" for k in keys)
    return f"it was trained for {have}; the target has {need}"


def checkpoint_misfit(proposer_dir: str | Path, target_dir: str | Path) -> str:
    """:func:`proposer_misfit` of two checkpoint directories; a proposer config that cannot
    be read is a misfit that says so, a target's is not judged here ("": loading it says)."""
    try:
        target = json.loads((Path(target_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    path = Path(proposer_dir) / "config.json"
    try:
        proposer = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"{path} cannot be read ({e})"
    return proposer_misfit(proposer, target)


def first_fitting(candidates, target_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The first of ``candidates`` (proposer checkpoint directories, in order of preference)
    that fits the target, or None; and each one passed over with why (:func:`checkpoint_misfit`:
    a missing checkpoint is passed over too). A target whose config.json cannot be read is
    not judged here: the last candidate (the general default) is returned for it."""
    candidates = [Path(c) for c in candidates]
    try:
        json.loads((Path(target_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return candidates[-1], []
    skipped = []
    for candidate in candidates:
        misfit = checkpoint_misfit(candidate, target_dir)
        if not misfit:
            return candidate, skipped
        skipped.append((candidate, misfit))
    return None, skipped
