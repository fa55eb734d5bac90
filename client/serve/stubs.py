"""The Python-backend stub processes of a tritonserver, read from ``/proc``.

Triton's Python backend runs each model instance in a stub process, a child of
tritonserver, started as::

    triton_python_backend_stub <repo>/<model>/<version>/model.py <shm region> <shm size>
        <shm growth> <server pid> <backend dir> <ipc handle> <instance name> <model dir>

so its command line names its model, version, instance and shared-memory region
(``/dev/shm/<region>``). Triton reaps a stub only when it unloads the instance: a stub
that died on its own (killed, crashed, or exited because its engine died) stays a
zombie until then, which tells a crash from an orderly unload, and its exit status
tells how it died.

>>> Stub.from_argv(42, ["/run/backends/python/triton_python_backend_stub",
...     "/run/model_repository/prefill/1/model.py", "tandem_1_ab_0f", "1048576", "1048576",
...     "7", "/run/backends/python", "336", "prefill_0_0", "DEFAULT"])
Stub(pid=42, model='prefill', version='1', instance='prefill_0_0', shm_region='tandem_1_ab_0f')
>>> describe_exit(9), describe_exit(70 << 8)
('killed by SIGKILL', 'exited with status 70')
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from tandem.client.serve.process_group import live_processes
from tandem.client.serve.triton_env import STUB_NAME


@dataclass(frozen=True, slots=True)
class Stub:
    """One stub process: the model instance it runs and its shared-memory region."""

    pid: int
    model: str
    version: str
    instance: str       # Triton's instance name, e.g. "prefill_0_0"
    shm_region: str     # /dev/shm/<shm_region>, created by tritonserver for this stub

    @classmethod
    def from_argv(cls, pid: int, argv: list[str]) -> "Stub | None":
        """The stub a command line starts, or None when it is no stub's."""
        if len(argv) < 9 or not argv[0].endswith(STUB_NAME):
            return None
        model_py = Path(argv[1])
        return cls(pid, model_py.parent.parent.name, model_py.parent.name, argv[8], argv[2])


@dataclass(frozen=True, slots=True)
class ProcState:
    state: str          # "R", "S", ..., "Z" for a zombie
    ppid: int
    exit_status: int    # as waitpid reports it; meaningful for a zombie only


def proc_state(pid: int) -> ProcState | None:
    """The state of ``pid`` (zombies included), or None when no such process exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()   # the command name may hold spaces or ")"
    # fields[0] is field 3 of proc(5) (state); exit_code is field 52, the last one
    return ProcState(fields[0], int(fields[1]), int(fields[-1]) if len(fields) >= 50 else 0)


def describe_exit(status: int | None) -> str:
    """A waitpid status in words."""
    if status is None:
        return "died (exit status unknown)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def died_of_signal(status: int | None) -> bool:
    """Whether a stub was killed (SIGKILL, SIGSEGV, ...) rather than exiting by itself;
    an unknown status counts as killed."""
    return status is None or os.WIFSIGNALED(status)


def find_stubs(server_pid: int) -> list[Stub]:
    """The live stubs of the tritonserver ``server_pid`` (zombies have no command line)."""
    stubs = []
    for pid, fields, entry in live_processes():
        if int(fields[1]) != server_pid:
            continue
        try:
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        stub = Stub.from_argv(pid, argv)
        if stub is not None:
            stubs.append(stub)
    return stubs


def stub_processes(run_dir: Path | None = None) -> list[int]:
    """Pids of live Python backend stubs (optionally only those started from ``run_dir``)."""
    pids = []
    for pid, _, entry in live_processes():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if cmd.endswith(STUB_NAME) and (run_dir is None or cmd.startswith(str(run_dir))):
            pids.append(pid)
    return pids
