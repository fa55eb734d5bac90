"""What every benchmark report carries (name, date, machine, the exact command, the
commit measured) and how its figures and markdown are written, so that each figure
names the machine, command and date."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_info(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and which of :data:`CPU_FLAGS` it has."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = "unknown", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags], "cores": os.cpu_count()}


def header(name: str, args: argparse.Namespace) -> dict:
    """``benchmark``, ``date``, ``machine`` (with the load average: a shared host shows
    it) and the ``command`` that reproduces the run."""
    try:
        load = " load average %.2f" % os.getloadavg()[0]
    except OSError:
        load = ""
    return {"benchmark": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()};{load}",
            "cpu": cpu_info(),   # bf16 runs ~60x slower without avx512_bf16/amx: compare within a CPU
            "command": command(name, args)}


def command(name: str, args: argparse.Namespace) -> str:
    """The ``tandem bench`` command line that reproduces the run, every option spelt out
    (a flag only when set; values quoted for the shell; ``_private`` values derived from
    the options are not options).

    >>> command("load", argparse.Namespace(modes="colocated,conditional", keep_work=False, spec=""))
    "tandem bench load --modes colocated,conditional --spec ''"
    """
    options = []
    for k, v in vars(args).items():
        if k in ("func", "command", "benchmark") or k.startswith("_") or v is None or v is False:
            continue
        option = f"--{k.replace('_', '-')}"
        options.append(option if v is True else f"{option} {shlex.quote(str(v))}")
    return f"tandem bench {name} {' '.join(options)}"


def write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


def save_figure(fig, path: Path, report: dict) -> Path:
    """Save with a footer naming the machine, the command and the date."""
    import matplotlib.pyplot as plt
    fig.text(0.01, 0.005, f"{report['date']}  {report['machine']}\n{report['command']}",
             fontsize=6, color="gray", va="bottom")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def git_state() -> str:
    """The commit measured, and whether the working tree differed from it."""
    from tandem.client.paths import REPO_ROOT
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' with uncommitted changes' if dirty else ''}" if head else "unknown"


def render(name: str, markdown: str, out: Path, draw: Callable[[], Path]) -> None:
    """A report's ``markdown`` written beside its JSON (``out`` as .md, under a title)
    and printed; then its figure drawn (``draw`` returns where it went)."""
    md = out.with_suffix(".md")
    md.write_text(f"# tandem bench {name}\n\n{markdown}\n")
    print(markdown)
    print(f"wrote {out}, {md}, {draw()}")
