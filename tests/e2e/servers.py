"""The servers the e2e tests start: :func:`served`, a TritonServer of this process, and
:func:`serve_command`, ``tandem serve`` as a user runs it."""
from __future__ import annotations

import functools
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tandem.client.serve.process_group import die_with_parent


@contextmanager
def served(run_dir: Path, ready_timeout_s: float = 180, exit_timeout_s: int = 30,
           model_control_mode: str = "explicit", admin_key: str = "", **options):
    """A server of ``ServeOptions.of(**options)`` in ``run_dir`` (its log there), started
    and stopped on exit, also when a test fails."""
    from tandem.client.serve.options import ServeOptions
    from tandem.client.serve.triton_server import TritonServer

    srv = TritonServer(ServeOptions.of(**options), run_dir=run_dir, log_file=run_dir / "tritonserver.log",
                       ready_timeout_s=ready_timeout_s, exit_timeout_s=exit_timeout_s,
                       model_control_mode=model_control_mode, admin_key=admin_key)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@dataclass
class ServeCommand:
    proc: subprocess.Popen
    output: list[str]      # every line it printed, read as it comes
    banner: list[str]      # the lines up to "Ctrl-C to stop."


@contextmanager
def serve_command(*args: str, ready_timeout_s: float):
    """``tandem serve *args`` in its own process group (SIGTERM when this process dies:
    no orphan if pytest is killed), up once it printed "Ctrl-C to stop."; Ctrl-C (SIGINT)
    on exit, SIGKILL if it has not stopped 90 s later."""
    proc = subprocess.Popen([sys.executable, "-m", "tandem.client.cli", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=functools.partial(die_with_parent, None))
    output: list[str] = []
    started = threading.Event()

    def drain():   # read everything it prints, so it never blocks on a full pipe
        for line in proc.stdout:
            output.append(line)
            if line.startswith("Ctrl-C to stop."):
                started.set()
        started.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert started.wait(ready_timeout_s) and proc.poll() is None, "".join(output)
        yield ServeCommand(proc, output, list(output))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

