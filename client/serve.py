"""Start tritonserver on Tandem's model repository: ``tandem serve``.

:func:`render_repository` fills the ``${...}`` placeholders of
``model_repository/*/config.pbtxt`` into a run directory; :class:`TritonServer`
starts tritonserver on it, waits until the server and its models are ready,
and stops it so that no process is left behind. The CLI and the e2e tests
share it:

>>> with TritonServer(ServeOptions(model_dir="ckpt"), run_dir=tmp) as server:  # doctest: +SKIP
...     print(server.grpc_url)
127.0.0.1:41523
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .triton_env import find_triton, prepare_backend_dir, server_env

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_CHECKPOINTS = REPO_ROOT / "checkpoints" / "demo"
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
STUB_NAME = "triton_python_backend_stub"
# the ensembles clients call, with what each is for (the other models are their steps)
ENSEMBLES = {
    "tandem": "text, disaggregated prefill/decode",
    "tandem_tokens": "token ids, disaggregated prefill/decode",
    "tandem_colocated": "text, colocated (the baseline)",
}
COLOCATED = ("preprocess", "llm", "postprocess", "tandem_colocated")
PREFILL = ("prefill",)   # a prefill server: decode servers send it jobs (--prefill-endpoints)
DISAGGREGATED = ("preprocess", "kv_transfer", "prefill", "decode", "postprocess", "tandem", "tandem_tokens")
# the models each mode serves; "both" puts the two paths side by side for benchmarks
MODES = {
    "disaggregated": DISAGGREGATED,
    "colocated": COLOCATED,
    "both": DISAGGREGATED + tuple(m for m in COLOCATED if m not in DISAGGREGATED),
    "prefill": PREFILL,
}


@dataclass(slots=True)
class ServeOptions:
    """What ``tandem serve`` puts into the model configs (see backends/triton/settings.py)."""

    model_dir: str | None = None          # None: the demo checkpoint
    dtype: str = "float32"
    page_size: int = 16
    num_pages: int = 0                    # 0: the engine sizes the pool
    kv_layout: str = "HND"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    torch_threads: int = 0                # 0: all cores (disaggregated: half each for prefill, decode)
    spec_method: str = "none"             # none | draft_target | mtp
    num_speculative_tokens: int = 3
    draft_model: str = ""                 # "": checkpoints/demo/draft with draft_target
    mtp_head: str = ""                    # "": checkpoints/demo/mtp with mtp
    mode: str = "disaggregated"           # disaggregated | colocated | both | prefill (MODES)
    prefill_endpoints: str = ""           # "host:port,...": remote prefill servers' gRPC

    @property
    def models(self) -> tuple[str, ...]:
        if self.mode not in MODES:
            raise ServerError(f"mode={self.mode!r}; allowed: {', '.join(MODES)}")
        if self.prefill_endpoints:
            from tandem.backends.triton.prefill_router import parse_endpoints
            if "prefill" not in MODES[self.mode] or self.mode == "prefill":
                raise ServerError(f"--prefill-endpoints is for a decode server (--mode "
                                  f"disaggregated or both), not --mode {self.mode}")
            try:
                parse_endpoints(self.prefill_endpoints)
            except ValueError as e:
                raise ServerError(str(e).replace("prefill_endpoints", "--prefill-endpoints")) from None
        return MODES[self.mode]

    @property
    def ensembles(self) -> tuple[str, ...]:
        return tuple(m for m in self.models if m in ENSEMBLES)

    def template_values(self) -> dict[str, str]:
        values = {k: str(v) for k, v in asdict(self).items()}
        if self.torch_threads == 0 and "prefill" in self.models and self.mode != "prefill":
            # prefill and decode run side by side: a half of the cores each, not all twice
            values["torch_threads"] = str(max(1, (os.cpu_count() or 2) // 2))
        values["model_dir"] = str(Path(self.model_dir).resolve())
        for key, demo in (("draft_model", "draft"), ("mtp_head", "mtp")):
            path = values[key] or (str(DEMO_CHECKPOINTS / demo) if self._uses(key) else "")
            values[key] = str(Path(path).resolve()) if path else ""
        return values

    def _uses(self, key: str) -> bool:
        return (self.spec_method, key) in (("draft_target", "draft_model"), ("mtp", "mtp_head"))


class ServerError(RuntimeError):
    """tritonserver failed to start or to become ready."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def render_repository(dst: Path, values: dict[str, str], src: Path = MODEL_REPOSITORY,
                      models: tuple[str, ...] | None = None) -> Path:
    """Copy ``src`` (only ``models``, default all) to ``dst`` with each config.pbtxt's
    ``${name}`` placeholders filled."""
    if dst.exists():
        shutil.rmtree(dst)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    ignore = skip if models is None else (
        lambda d, names: set(skip(d, names)) | ({n for n in names if n not in models}
                                                if Path(d) == Path(src) else set()))
    shutil.copytree(src, dst, ignore=ignore)
    for config in dst.glob("*/config.pbtxt"):
        try:
            text = string.Template(config.read_text()).substitute(values)
        except KeyError as exc:
            raise ServerError(f"{config.relative_to(dst)}: no value for placeholder ${{{exc.args[0]}}}") from None
        except ValueError as exc:  # a stray "$"; write "$$" for a literal one
            raise ServerError(f"{config.relative_to(dst)}: {exc}") from None
        config.write_text(text)
    return dst


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child after fork() only calls it
except OSError:  # pragma: no cover - not Linux
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent(cpus: tuple[int, ...] | None = None) -> None:
    """In the child: its own process group, SIGTERM when the parent dies (Linux), and
    the CPUs it (and every model process it starts) may run on."""
    os.setsid()
    if cpus:
        os.sched_setaffinity(0, cpus)
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _pids_in_group(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the parenthesised command name: state ppid pgrp ...
        fields_ = stat.rsplit(")", 1)[1].split()
        if int(fields_[2]) == pgid and fields_[0] != "Z":
            pids.append(int(entry.name))
    return pids


def stub_processes(run_dir: Path | None = None) -> list[int]:
    """Pids of live Python backend stubs (optionally only those started from ``run_dir``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmd.endswith(STUB_NAME) and state != "Z" and (run_dir is None or cmd.startswith(str(run_dir))):
            pids.append(int(entry.name))
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
            stdout=out, stderr=err, preexec_fn=functools.partial(_die_with_parent, self.cpus),
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
                    _killpg(pgid, signal.SIGKILL)
                    proc.wait()
            # Stubs notice their parent's death only after a health-check
            # period; do not wait for them.
            deadline = time.monotonic() + 5
            while _pids_in_group(pgid) and time.monotonic() < deadline:
                _killpg(pgid, signal.SIGKILL)
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


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


# ---- CLI ------------------------------------------------------------------
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="start tritonserver with Tandem's models",
                              description="Start tritonserver with Tandem's model repository and wait for Ctrl-C.")
    p.add_argument("--model", dest="model_dir", help="HF checkpoint directory (default: checkpoints/demo/target "
                   "if trained, else an untrained demo checkpoint in .cache/demo-untrained)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: 16)")
    p.add_argument("--num-pages", type=int, default=0, help="KV pages in the pool (default: 0 = automatic)")
    p.add_argument("--kv-layout", choices=("HND", "NHD"), default="HND")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step (default: 512)")
    p.add_argument("--threads", type=int, default=0, help="torch threads of each engine process (default: 0 = all cores; disaggregated: half each for prefill and decode)")
    p.add_argument("--spec", dest="spec_method", choices=("none", "draft_target", "mtp"), default="none",
                   help="speculative decoding method (default: none)")
    p.add_argument("--k", dest="num_speculative_tokens", type=int, default=3,
                   help="draft tokens per step with --spec (default: 3)")
    p.add_argument("--draft-model", default="", help="draft checkpoint (default: checkpoints/demo/draft)")
    p.add_argument("--mtp-head", default="", help="MTP head checkpoint (default: checkpoints/demo/mtp)")
    p.add_argument("--prefill-endpoints", default="",
                   help="host:port,... gRPC endpoints of prefill servers (`tandem serve --mode "
                        "prefill`) that this decode server sends its prefills to (default: its own)")
    p.add_argument("--mode", choices=tuple(MODES), default="disaggregated",
                   help="disaggregated (default): the ensembles tandem and tandem_tokens (preprocess, "
                        "kv_transfer, prefill, decode and postprocess in their own processes); colocated: "
                        "the ensemble tandem_colocated (preprocess, llm, postprocess); both: all of them; "
                        "prefill: a prefill server for decode servers started with --prefill-endpoints")
    p.add_argument("--model-control-mode", choices=("none", "explicit"), default="none",
                   help="explicit: open Triton's repository API (load/unload models, roll versions)")
    p.add_argument("--run-dir", type=Path, help="where the rendered repository and backend go (default: a temp dir)")
    p.add_argument("--log-file", type=Path, help="write tritonserver's log here instead of the terminal")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness (default: 300)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_pages < 0 or args.threads < 0:
        raise SystemExit("--num-pages and --threads must be >= 0 (0 = automatic)")
    options = ServeOptions(
        model_dir=args.model_dir, dtype=args.dtype, page_size=args.page_size, num_pages=args.num_pages,
        kv_layout=args.kv_layout, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, torch_threads=args.threads,
        spec_method=args.spec_method, num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model, mtp_head=args.mtp_head, mode=args.mode,
        prefill_endpoints=args.prefill_endpoints,
    )
    server = TritonServer(options, run_dir=args.run_dir, host=args.host, http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port, log_file=args.log_file,
                          log_verbose=args.log_verbose, ready_timeout_s=args.ready_timeout,
                          model_control_mode=args.model_control_mode)
    stop = threading.Event()
    phase = ["starting"]

    def on_signal(signum, _frame):
        if phase[0] == "starting":
            raise KeyboardInterrupt  # unwind out of start(); finally stops the server
        stop.set()  # serving: leave the wait loop; while stopping: already on the way out

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        phase[0] = "serving"
        print(f"tandem: serving {options.model_dir} ({options.mode})", flush=True)
        for name in options.ensembles:
            print(f"  ensemble {name:<17} {ENSEMBLES[name]}")
        if options.ensembles:
            print(f"  HTTP     http://{server.http_url}   (POST /v2/models/{options.ensembles[0]}/generate_stream)")
        else:
            print(f"  HTTP     http://{server.http_url}   (model prefill: decode servers' jobs)")
        print(f"  gRPC     {server.grpc_url}")
        print(f"  metrics  {server.metrics_url}")
        print("Ctrl-C to stop.", flush=True)
        while not stop.is_set():
            if server.process is None or server.process.poll() is not None:
                print("tandem: tritonserver exited unexpectedly", file=sys.stderr)
                return 1
            stop.wait(0.5)
        print("tandem: shutting down", flush=True)
        return 0
    except ServerError as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tandem: interrupted, shutting down", file=sys.stderr, flush=True)
        return 130
    finally:
        phase[0] = "stopping"
        server.cleanup()
        for s, handler in previous.items():
            signal.signal(s, handler)
