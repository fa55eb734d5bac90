"""A child process that leaves nothing behind (Linux): it leads its own process
group, gets SIGTERM when its parent dies, and the whole group can be found in
``/proc`` and killed.

>>> subprocess.Popen(cmd, preexec_fn=functools.partial(die_with_parent, None))  # doctest: +SKIP
>>> killpg(proc.pid, signal.SIGKILL); pids_in_group(proc.pid)                    # doctest: +SKIP
[]
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path
from typing import Iterator

try:
    _LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child after fork() only calls it
except OSError:  # pragma: no cover - not Linux
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def die_with_parent(cpus: tuple[int, ...] | None = None) -> None:
    """In the child: its own process group, SIGTERM when the parent dies (Linux), and
    the CPUs it (and every process it starts) may run on. "The parent" is the thread
    that started the child: start it from one that lives as long as it should."""
    os.setsid()
    if cpus:
        os.sched_setaffinity(0, cpus)
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def live_processes() -> Iterator[tuple[int, list[str], Path]]:
    """(pid, the fields of ``/proc/<pid>/stat`` after the command name — state, ppid,
    pgrp, ... —, ``/proc/<pid>``) of every process that is not a zombie."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name is in parentheses and may itself hold spaces or ")"
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            yield int(entry.name), fields, entry


def pids_in_group(pgid: int) -> list[int]:
    return [pid for pid, fields, _ in live_processes() if int(fields[2]) == pgid]


def killpg(pgid: int, sig: int) -> None:
    """Signal the group; one that is gone already is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(pgid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL every process left in the group until none is (at most ``timeout_s``):
    stubs notice their parent's death only after a health-check period."""
    deadline = time.monotonic() + timeout_s
    while pids_in_group(pgid) and time.monotonic() < deadline:
        killpg(pgid, signal.SIGKILL)
        time.sleep(0.05)
