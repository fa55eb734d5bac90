"""Run tritonserver on Tandem's model repository, as a library: the CLI
(``tandem serve``), the e2e tests and the benchmarks share it.

:class:`TritonServer` renders the repository into a run directory, starts
tritonserver on it, waits until the server and its models are ready, and stops it
so that no process is left behind:

>>> with TritonServer(ServeOptions(model_dir="ckpt"), run_dir=tmp) as server:  # doctest: +SKIP
...     print(server.grpc_url)
127.0.0.1:41523
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .process_group import die_with_parent, killpg, live_processes, pids_in_group
from .repository import render_repository
from .serve_options import ServeOptions, ServerError
from .triton_env import STUB_NAME, find_triton, prepare_backend_dir, server_env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


@dataclass(slots=True)
class TritonServer:
    """A tritonserver process serving the rendered model repository.

    Ports default to free ones on ``host``; ``log_file`` None streams the
    server's log to this process's stdout/stderr.
    """

    options: ServeOptions = field(default_factory=ServeOptions)
    run_dir: Path | None = None
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    log_file: Path | None = None
    log_verbose: int = 0
    ready_timeout_s: float = 300.0
    cpus: tuple[int, ...] | None = None   # pin the server and its models (benchmarks)
    # "explicit": every model is loaded at start and the repository API (load / unload,
    # e.g. to roll a new version) is open; "none": the repository is fixed
    model_control_mode: str = "none"
    exit_timeout_s: int = 10
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _owns_run_dir: bool = field(default=False, init=False, repr=False)
    _log_handle: object = field(default=None, init=False, repr=False)
    _shm_prefix: str = field(default="", init=False, repr=False)
    _server_pids: list = field(default_factory=list, init=False, repr=False)

    # ---- endpoints -------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    # ---- lifecycle -------------------------------------------------------
    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "TritonServer":
        if self.options.model_dir is None:
            from .demo_checkpoint import default_model_dir

            self.options.model_dir = str(default_model_dir())
        if not (Path(self.options.model_dir) / "config.json").is_file():
            raise ServerError(f"--model: {self.options.model_dir} has no config.json (a Hugging Face checkpoint dir)")
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="tandem-serve-"))
            self._owns_run_dir = True
        self.run_dir = Path(self.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)

        layout = find_triton()
        backend_dir = prepare_backend_dir(layout, self.run_dir)
        repo = render_repository(self.run_dir / "model_repository", self.options.template_values(),
                                 models=self.options.models)
        pick = [name for name in ("http_port", "grpc_port", "metrics_port") if not getattr(self, name)]
        for attempt in range(3):
            for name in pick:
                setattr(self, name, free_port(self.host))
            self._launch(layout, backend_dir, repo)
            try:
                self.wait_ready()
                return self
            except ServerError as exc:
                in_use = "already in use" in self.log_tail()
                self.stop()
                if not (in_use and pick and attempt < 2):
                    raise exc
        return self  # unreachable

    def _launch(self, layout, backend_dir: Path, repo: Path) -> None:
        # A prefix per launch names the stubs' shared-memory regions, so stop()
        # can remove the ones a killed stub leaves in /dev/shm.
        self._shm_prefix = f"tandem_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        cmd = [
            str(layout.server_bin),
            f"--model-repository={repo}",
            f"--backend-directory={backend_dir}",
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            "--disable-auto-complete-config",
            f"--model-control-mode={self.model_control_mode}",
            *(["--load-model=*"] if self.model_control_mode == "explicit" else []),
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
        ]
        if self.log_file is not None:
            self._log_handle = open(self.log_file, "ab")
            out = err = self._log_handle
        else:
            out, err = None, None
        self.process = subprocess.Popen(
            cmd, env=server_env(layout), cwd=self.run_dir, stdin=subprocess.DEVNULL,
            stdout=out, stderr=err, preexec_fn=functools.partial(die_with_parent, self.cpus),
        )

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until ``/v2/health/ready`` and every model's ready endpoint answer 200."""
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        urls = [f"http://{self.http_url}/v2/health/ready",
                *(f"http://{self.http_url}/v2/models/{m}/ready" for m in self.options.models)]
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise ServerError(f"tritonserver exited with code {code} before it was ready{self._log_hint()}")
            if all(_http_ok(u) for u in urls):
                return
            time.sleep(0.2)
        raise ServerError(f"tritonserver not ready within {timeout_s or self.ready_timeout_s:.0f} s{self._log_hint()}")

    def is_ready(self) -> bool:
        return self.process is not None and self.process.poll() is None and _http_ok(
            f"http://{self.http_url}/v2/health/ready")

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM (graceful: models finalize), then SIGKILL the whole process group.

        Returns only when no process of the group (tritonserver and its
        Python backend stubs) is alive.
        """
        proc = self.process
        if proc is not None:
            pgid = proc.pid  # the child called setsid(): its pid is its group id
            grace = timeout_s if timeout_s is not None else self.exit_timeout_s + 5
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    killpg(pgid, signal.SIGKILL)
                    proc.wait()
            # Stubs notice their parent's death only after a health-check
            # period; do not wait for them.
            deadline = time.monotonic() + 5
            while pids_in_group(pgid) and time.monotonic() < deadline:
                killpg(pgid, signal.SIGKILL)
                time.sleep(0.05)
            self.process = None
            self._server_pids.append(pgid)
        self._cleanup_shm()
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def cleanup(self) -> None:
        """Stop, and remove the run directory if this object created it."""
        self.stop()
        if self._owns_run_dir and self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _cleanup_shm(self) -> None:
        if not self._shm_prefix:
            return
        shm = Path("/dev/shm")
        if shm.is_dir():
            # the stubs' regions, and the KV pool a killed kv_transfer/decode left
            # (named after the server's pid: tandem.backends.disagg.server_pool_name)
            regions = [*shm.glob(f"{self._shm_prefix}*"),
                       *(r for pid in self._server_pids for r in shm.glob(f"tandem-kv-{pid}-*"))]
            for region in regions:
                try:
                    region.unlink()
                except OSError:
                    pass

    def log_tail(self, n: int = 40) -> str:
        if self.log_file is None or not Path(self.log_file).exists():
            return ""
        lines = Path(self.log_file).read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def _log_hint(self) -> str:
        tail = self.log_tail()
        return f"; last log lines ({self.log_file}):\n{tail}" if tail else ""


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
