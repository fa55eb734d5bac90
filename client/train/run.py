"""What every resumable training run shares (``tandem train lm``, ``tandem train mtp``):
its options, its torch threads and log."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The options of a resumable training run (``lm``, ``mtp``)."""
    p.add_argument("--resume", action="store_true", help="continue from <work-dir>/state.pt")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many steps in this invocation (resume later)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--log", default=None, help="log file (default <work-dir>/train.log)")


def start_run(args: argparse.Namespace, work: Path, subcommand: str) -> str | None:
    """Set the torch threads and the log of a run; return its command line (for the
    training summary) when it came from ``sys.argv``."""
    import torch

    from tandem.backends.training.loop import setup_logging

    torch.set_num_threads(args.threads)
    setup_logging(args.log or work / "train.log")
    if subcommand not in sys.argv:
        return None
    rest = sys.argv[sys.argv.index(subcommand) + 1:]
    return f"tandem train {subcommand} " + " ".join(shlex.quote(a) for a in rest)
