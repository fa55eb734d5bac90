"""Run tritonserver on Tandem's model repository, as a library: the CLI
(``tandem serve``), the e2e tests and the benchmarks share it.

:class:`TritonServer` renders the repository into a run directory, starts
tritonserver on it, waits until the server and its models are ready, supervises it
(:mod:`.supervisor`: a dead stub's model is reloaded, a dead server restarted), and
stops it so that no process and no shared-memory segment is left behind:

>>> with TritonServer(ServeOptions.of(model_dir="ckpt"), run_dir=tmp) as server:  # doctest: +SKIP
...     print(server.grpc_url)
...     pid = server.kill_stub("prefill")              # what the supervisor must survive
...     server.wait_model_ready("tandem", timeout_s=60)
127.0.0.1:41523
2.4
>>> server.supervisor.status().reload_seconds          # doctest: +SKIP
[2.3]
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from tandem.rdma.pool_layout import pid_exists

from tandem.client.paths import DEMO_MODEL
from tandem.client.serve.process_group import die_with_parent, kill_group, killpg
from tandem.backends.triton.settings import setting
from tandem.client.serve.repository import render_repository
from tandem.client.serve.options import ServeOptions, ServerError
from tandem.client.serve.stubs import Stub, find_stubs, proc_state, stub_processes  # noqa: F401 - stub_processes re-exported
from tandem.client.serve.supervisor import Supervisor
from tandem.client.serve.admin_key import AdminKeyError, resolve_key, restricted_api_args
from tandem.client.serve.allocator import CHOICES as MALLOC_CHOICES, AllocatorNotFound, find_allocator, preload_env
from tandem.client.serve.triton_env import TritonNotFound, find_triton, prepare_backend_dir, server_env
from tandem.client.serve.triton_http import TritonHTTP, http_ok

log = logging.getLogger("tandem.serve")
SHM_DIR = Path("/dev/shm")
PYTHON_ENV_DIR = "/tmp"   # where Triton's Python backend makes its python_env_* (hard-coded there)
FAULTS_ENV = "TANDEM_FAULTS"
# what this class names in /dev/shm: the stubs' regions (prefix per launch, keyed by the
# launching process's pid) and the decode KV pool (keyed by tritonserver's pid:
# tandem.backends.disagg.server_pool_name)
_STUB_REGION = re.compile(r"tandem_(\d+)_[0-9a-f]{8}_")
_POOL_FILE = re.compile(r"tandem-kv-(\d+)-")
_IN_ENGINE = re.compile(r"^tandem_requests_in_engine\{[^}]*\} (\S+)$", re.MULTILINE)
# a drain ends once the engines have held no request this long (a request admitted just
# before the drain reaches its engine within milliseconds)
DRAIN_QUIET_S = 1.0
# the model a draining server fails to load: it keeps the server not ready (drain())
DRAINING_MODEL = "draining"
# the same while an operator keeps a served model unloaded (the supervisor)
UNLOADED_MODEL = "operator_unloaded_a_model"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1", taken=()) -> list[int]:
    """``n`` distinct free ports, none in ``taken`` (the kernel may hand out a port it
    just freed again, so ``free_port`` twice can give one port twice)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports and port not in taken:
            ports.append(port)
    return ports


def metric_sum(metrics_url: str, series: re.Pattern) -> float | None:
    """The sum of the values ``series`` (a multi-line pattern whose group 1 is the value)
    matches on the metrics endpoint; None when the metrics cannot be read."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as r:
            text = r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None
    return sum(float(m.group(1)) for m in series.finditer(text))


def requests_in_engine(metrics_url: str) -> float | None:
    """Requests the engine models (``llm``, ``decode``) hold, from their
    ``tandem_requests_in_engine`` gauges; None when the metrics cannot be read."""
    return metric_sum(metrics_url, _IN_ENGINE)


@dataclass(slots=True)
class TritonServer:
    """A tritonserver process serving the rendered model repository.

    Ports default to free ones on ``host``; ``log_file`` None streams the
    server's log to this process's stdout/stderr.
    """

    options: ServeOptions = field(default_factory=ServeOptions)
    run_dir: Path | None = setting(None, "--run-dir", "where the rendered repository and backend go "
                                   "(default: a temp dir)")
    host: str = setting("127.0.0.1", "--host", "address to bind (default: %(default)s)")
    # 0: a free port (tests, benchmarks); tandem serve listens on Triton's usual ones
    http_port: int = setting(0, "--http-port", flag_default=8000)
    grpc_port: int = setting(0, "--grpc-port", flag_default=8001)
    metrics_port: int = setting(0, "--metrics-port", flag_default=8002)
    log_file: Path | None = setting(None, "--log-file", "write tritonserver's log here instead of the terminal")
    log_verbose: int = setting(0, "--log-verbose")
    ready_timeout_s: float = setting(300.0, "--ready-timeout", "seconds to wait for readiness (default: 300)")
    cpus: tuple[int, ...] | None = None   # pin the server and its models (benchmarks)
    # "explicit": every model is loaded at start and the repository API (load / unload,
    # e.g. to roll a new version, or the supervisor's reloads) is open; "none": the
    # repository is fixed (the supervisor can then only restart the server)
    model_control_mode: str = setting(
        "explicit", "--model-control-mode", choices=("none", "explicit"), help=(
            "explicit (default): every model loaded at start, Triton's repository API open (load/unload "
            "models, roll versions; the supervisor reloads a dead model through it); none: a fixed "
            "repository (the supervisor can only restart the server)"))
    # watch the stubs and the server; recover (supervisor.py)
    supervise: bool = setting(True, "--no-supervise", "do not watch the model processes: a dead stub stays "
                              "dead (debugging)")
    exit_timeout_s: int = 10
    # the binary; "": the nvidia-pytriton wheel's (triton_env)
    tritonserver: str = setting("", "--tritonserver", metavar="PATH", help=(
        "the tritonserver (2.51) binary to run, e.g. /opt/tritonserver/bin/tritonserver in NVIDIA's Triton "
        "container (default: the one in the nvidia-pytriton wheel)"))
    # Triton's control APIs locked to this key (admin_key.py); beyond loopback always
    admin_key: str = setting("", "--admin-key", help=(
        "the key Triton's model-repository, shared-memory, logging and trace APIs require (HTTP header "
        "'admin-key', gRPC metadata 'triton-grpc-protocol-admin-key'). Bound beyond loopback the server is always locked: without this option it "
        "makes a key and writes it to <run dir>/admin-key"))
    # preloaded into tritonserver and every stub (allocator.py)
    malloc: str = setting("system", "--malloc", choices=MALLOC_CHOICES, help=(
        "the memory allocator of tritonserver and its model processes: system (glibc, default), jemalloc or "
        "tcmalloc (preloaded; Debian's libjemalloc2 / libtcmalloc-minimal4; jemalloc makes tritonserver "
        "2.51 answer request errors with HTTP 500 instead of 400)"))
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    supervisor: Supervisor | None = field(default=None, init=False, repr=False)
    _owns_run_dir: bool = field(default=False, init=False, repr=False)
    _log_handle: object = field(default=None, init=False, repr=False)
    _launch_args: tuple = field(default=(), init=False, repr=False)
    _shm_prefixes: list = field(default_factory=list, init=False, repr=False)
    _server_pids: list = field(default_factory=list, init=False, repr=False)
    _preload: str | None = field(default=None, init=False, repr=False)   # --malloc's library
    _admin_key: str = field(default="", init=False, repr=False)          # the key in force
    _launched_at: float = field(default=0.0, init=False, repr=False)     # time.time() of the last launch
    _killed_at: list = field(default_factory=list, init=False, repr=False)  # launches that were killed
    # held while the process is swapped (the supervisor's restart) or stopped
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

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

    @property
    def http(self) -> TritonHTTP:
        return TritonHTTP(self.http_url, self._admin_key)

    # ---- lifecycle -------------------------------------------------------
    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "TritonServer":
        if self.options.engine.model_dir in ("", DEMO_MODEL):   # the demo target
            from tandem.client.demo_checkpoint import default_model_dir

            self.options.engine = replace(self.options.engine, model_dir=str(default_model_dir()))
        from tandem.backends.models.model_path import resolve_model_path   # a GGUF: its converted dir
        model_dir = str(resolve_model_path(self.options.engine.model_dir))
        self.options.engine = replace(self.options.engine, model_dir=model_dir)
        if not (Path(model_dir) / "config.json").is_file():
            raise ServerError(f"--model: {model_dir} has no config.json (a Hugging Face checkpoint dir)")
        if self.model_control_mode not in ("none", "explicit"):
            raise ServerError(f"model_control_mode={self.model_control_mode!r}; allowed: none, explicit")
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="tandem-serve-"))
            self._owns_run_dir = True
        self.run_dir = Path(self.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._register_adapters()
        remove_orphan_segments()

        try:
            layout = find_triton(server_bin=self.tritonserver or None)
        except TritonNotFound as exc:
            raise ServerError(str(exc)) from None
        try:
            self._preload = find_allocator(self.malloc)
            self._admin_key, key_file = resolve_key(self.admin_key, self.host, self.run_dir)
        except (AllocatorNotFound, AdminKeyError) as exc:
            raise ServerError(str(exc)) from None
        if self._preload:
            log.info("memory allocator: %s", self._preload)
        if key_file is not None:
            log.warning("%s is reachable beyond loopback: Triton's repository, shared-memory, logging and trace "
                        "APIs need the header 'admin-key' with the key in %s (or pass --admin-key)",
                        self.host, key_file)
        backend_dir = prepare_backend_dir(layout, self.run_dir)
        repo = render_repository(self.run_dir / "model_repository", self.options.template_values(),
                                 models=self.options.models, aliases=self.options.aliases)
        self._launch_args = (layout, backend_dir, repo)
        pick = [name for name in ("http_port", "grpc_port", "metrics_port") if not getattr(self, name)]
        for attempt in range(3):
            taken = {getattr(self, n) for n in ("http_port", "grpc_port", "metrics_port") if n not in pick} - {0, None}
            for name, port in zip(pick, free_ports(len(pick), self.host, taken)):
                setattr(self, name, port)
            self._launch()
            try:
                self.wait_ready()
                break
            except ServerError as exc:
                tail = self.log_tail()
                in_use = "already in use" in tail or "cannot listen" in tail
                self.stop()
                if not (in_use and pick and attempt < 2):
                    raise exc
        if self.supervise:
            self.supervisor = Supervisor(self).start()
        return self

    def _register_adapters(self) -> None:
        """With ``--max-loras``: the adapter registry the models read (``<run dir>/loras``),
        holding the ``--lora-modules`` adapters, each checked against the base model first
        (a ServerError names the one that does not fit). A restart keeps what is there,
        the adapters loaded at run time included."""
        engine = self.options.engine
        pairs = self.options.adapters()
        if engine.max_loras < 1:
            return
        if not engine.lora_dir:
            engine = dataclasses.replace(engine, lora_dir=str(self.run_dir / "loras"))
            self.options = dataclasses.replace(self.options, engine=engine)
        registry = engine.adapters()
        for name, path in pairs:
            if registry.get(name) is not None:
                continue
            try:
                registry.check(name, path)
                registry.add(name, str(Path(path).resolve()))
            except (ValueError, OSError) as e:
                raise ServerError(f"--lora-modules: {e}") from None

    def _launch(self) -> None:
        layout, backend_dir, repo = self._launch_args
        # A prefix per launch names the stubs' shared-memory regions, so stop()
        # can remove the ones a killed stub (or a killed server) leaves in /dev/shm.
        prefix = f"tandem_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self._shm_prefixes.append(prefix)
        self._launched_at = time.time()
        cmd = [
            str(layout.server_bin),
            f"--model-repository={repo}",
            f"--backend-directory={backend_dir}",
            f"--backend-config=python,shm-region-prefix-name={prefix}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            "--disable-auto-complete-config",
            f"--model-control-mode={self.model_control_mode}",
            "--strict-readiness=true",   # ready only while every model is (supervisor.py relies on it)
            *(["--load-model=*"] if self.model_control_mode == "explicit" else []),
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
            *restricted_api_args(self._admin_key),
        ]
        if self.log_file is not None:
            if self._log_handle is None:
                self._log_handle = open(self.log_file, "ab")
            out = err = self._log_handle
        else:
            out, err = None, None
        env = preload_env(server_env(layout), self._preload)
        # fault injection (tests, benchmarks): the models read it here or from their
        # config's "faults" parameter; never inherited from the caller's shell
        env.pop(FAULTS_ENV, None)
        if self.options.engine.faults:
            env[FAULTS_ENV] = self.options.engine.faults
        self.process = subprocess.Popen(
            cmd, env=env, cwd=self.run_dir, stdin=subprocess.DEVNULL,
            stdout=out, stderr=err, preexec_fn=functools.partial(die_with_parent, self.cpus),
        )

    def wait_ready(self, timeout_s: float | None = None, abort: threading.Event | None = None) -> None:
        """Block until ``/v2/health/ready`` and every model's ready endpoint answer 200."""
        limit = timeout_s or self.ready_timeout_s
        deadline = time.monotonic() + limit
        urls = [f"http://{self.http_url}/v2/health/ready",
                *(f"http://{self.http_url}/v2/models/{m}/ready" for m in self.options.models)]
        while time.monotonic() < deadline:
            if abort is not None and abort.is_set():
                raise ServerError("stopped while waiting for readiness")
            proc = self.process
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise ServerError(f"tritonserver exited with code {code} before it was ready{self._log_hint()}")
            if all(http_ok(u) for u in urls):
                return
            time.sleep(0.2)
        raise ServerError(f"tritonserver not ready within {limit:.0f} s{self._log_hint()}")

    def is_ready(self) -> bool:
        return self.process is not None and self.process.poll() is None and self.http.server_ready()

    def drain(self, timeout_s: float, abort: threading.Event | None = None) -> bool:
        """Stop admitting requests and let the ones in flight finish (``tandem serve`` on
        SIGTERM; :meth:`stop` follows). True once nothing is in flight, False when
        ``timeout_s`` passed first or ``abort`` was set.

        It unloads the models clients call (the ensembles; ``prefill`` on a prefill server):
        Triton refuses new requests to them, while the models beneath keep serving the
        streams already admitted (a prefill server's ``prefill`` answers at once and
        streams the KV after: its unload waits for the jobs it took to finish their
        transfers). (Triton's own shutdown on SIGTERM would not do: its models
        stop taking requests, the ensembles' own steps included, so every open stream
        stalls.) Nothing is in flight once those models are unloaded (their streams ended
        and closed), or once the engines have held no request for :data:`DRAIN_QUIET_S`: a
        client that keeps an idle gRPC stream open keeps its ensemble loaded.

        Readiness goes false first, and stays so: Triton's strict readiness counts an
        unloaded model as fine but not one that failed to load, so a model
        :data:`DRAINING_MODEL` that cannot load is loaded.
        """
        if self.supervisor is not None:
            self.supervisor.pause()    # an unload is no death to recover from
        if self.model_control_mode != "explicit":
            log.warning("draining needs --model-control-mode explicit (the repository API); stopping at once")
            return False
        self.hold_not_ready(DRAINING_MODEL)
        entry = self.options.ensembles or self.options.models
        for model in entry:
            try:
                self.http.unload(model)
            except ServerError as exc:
                log.warning("draining: %s", exc)
        deadline, quiet_since = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline and not (abort is not None and abort.is_set()):
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                if all(self.http.index().get(m, ("",))[0] != "UNLOADING" for m in entry):
                    return True
            except ServerError:
                pass
            now = time.monotonic()
            if requests_in_engine(self.metrics_url) != 0:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= DRAIN_QUIET_S:
                return True
            time.sleep(0.1)
        return False

    def failure(self) -> str:
        """Why this server can serve no more ("" while it can, or is being recovered)."""
        if self.supervisor is not None:
            return self.supervisor.status().failed
        proc = self.process
        if proc is None or proc.poll() is not None:
            return f"tritonserver exited with code {None if proc is None else proc.returncode}"
        return ""

    def relaunch(self, abort: threading.Event | None = None) -> None:
        """Kill tritonserver and its stubs at once and start it again on the same ports
        (the supervisor's restart). Its open streams end with UNAVAILABLE."""
        for attempt in range(3):
            with self._lock:
                if abort is not None and abort.is_set():
                    raise ServerError("stopping")
                self._kill_now()
                self._cleanup_shm()
                self._launch()
            try:
                self.wait_ready(abort=abort)
                return
            except ServerError as exc:
                if attempt == 2 or (abort is not None and abort.is_set()):
                    raise
                # e.g. a port the killed server held is not free yet
                log.warning("restarting tritonserver failed (%s); trying again", str(exc).splitlines()[0])
                time.sleep(1.0)

    def _kill_now(self) -> None:
        proc = self.process
        if proc is None:
            return
        pgid = proc.pid
        killpg(pgid, signal.SIGKILL)
        proc.wait()
        self._killed_at.append(self._launched_at)
        kill_group(pgid)
        self.process = None
        self._server_pids.append(pgid)

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM (graceful: models finalize), then SIGKILL the whole process group.

        Returns only when no process of the group (tritonserver and its Python backend
        stubs) is alive, and every shared-memory segment of this server is removed.
        """
        if self.supervisor is not None:
            self.supervisor.request_stop()
        with self._lock:
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
                        self._killed_at.append(self._launched_at)
                kill_group(pgid)
                self.process = None
                self._server_pids.append(pgid)
        if self.supervisor is not None:
            self.supervisor.join(timeout_s=30)
        self._cleanup_shm()
        self._cleanup_python_envs()
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def hold_not_ready(self, marker: str) -> None:
        """Make the server answer not ready, whatever its models: load a model ``marker``
        that cannot load (Triton's strict readiness counts an unloaded model as fine, a
        failed one not). Its name says why in the repository index."""
        path = self._launch_args[2] / marker
        (path / "1").mkdir(parents=True, exist_ok=True)
        (path / "config.pbtxt").write_text(f'name: "{marker}"\nbackend: "{marker}"\n')
        try:
            self.http.load(marker, timeout_s=10)
        except ServerError:
            pass   # it fails, as it should: "unable to find backend library for backend '<marker>'"

    def release_not_ready(self, marker: str) -> None:
        """Undo :meth:`hold_not_ready`: the server is ready again once its models are.
        Triton keeps counting a model that failed to load, even once unloaded and gone
        from the repository, so the marker becomes a model that loads (a Python model
        that does nothing), is loaded, then unloaded: deliberately unloaded is fine."""
        path = self._launch_args[2] / marker
        (path / "config.pbtxt").write_text(
            f'name: "{marker}"\nbackend: "python"\nmax_batch_size: 0\n'
            'input [{ name: "x", data_type: TYPE_BOOL, dims: [1] }]\n'
            'output [{ name: "y", data_type: TYPE_BOOL, dims: [1] }]\n')
        (path / "1" / "model.py").write_text(
            "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n")
        self.http.load(marker, timeout_s=60)
        self.http.unload(marker)
        shutil.rmtree(path, ignore_errors=True)   # a restarted server must not load it

    def cleanup(self, timeout_s: float | None = None) -> None:
        """Stop (``timeout_s``: as :meth:`stop`), and remove the run directory if this
        object created it, unless a process of the server died meanwhile: then the
        directory (its log, with the crash's Python stacks) is kept and named."""
        crashes = self.crashes()
        self.stop(timeout_s)
        if self._owns_run_dir and self.run_dir is not None:
            if crashes:
                log.warning("kept %s for the traces of %s", self.run_dir, "; ".join(crashes))
            else:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    def crashes(self) -> list[str]:
        """What died while this server ran (the supervisor's record), e.g. "model 'decode'
        (stub pid 4242) was killed by signal 11 (SIGSEGV)"; [] without a supervisor."""
        if self.supervisor is None:
            return []
        return [f"model {r.model!r} (stub pid {r.pid}) {r.cause}" if r.model else f"tritonserver: {r.cause}"
                for r in self.supervisor.status().recoveries]

    # ---- faults, for tests and benchmarks ---------------------------------
    def stubs(self) -> list[Stub]:
        """The live stubs of this server."""
        proc = self.process
        return [] if proc is None else find_stubs(proc.pid)

    def kill_stub(self, model: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (SIGKILL: what the OOM killer does; SIGSEGV: a crash) to the stub
        process of ``model``; returns its pid once it is dead and, when supervised, once
        the supervisor has seen it (so :meth:`wait_model_ready` afterwards waits for the
        recovery)."""
        stub = self._stub(model)
        if self.supervisor is not None:
            self.supervisor.watch(stub)
        os.kill(stub.pid, sig)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            state = proc_state(stub.pid)
            if state is None or state.state == "Z":
                break
            time.sleep(0.01)
        if self.supervisor is not None:
            self.supervisor.wait_noticed(stub.pid)
        return stub.pid

    def pause_stub(self, model: str, seconds: float) -> int:
        """SIGSTOP the stub process of ``model``, SIGCONT it ``seconds`` later (what a
        frozen cgroup or a stalled host does to it); returns its pid."""
        stub = self._stub(model)
        os.kill(stub.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            try:
                os.kill(stub.pid, signal.SIGCONT)
            except ProcessLookupError:   # Triton killed it meanwhile (a stub it found unhealthy)
                pass
        return stub.pid

    def roll_version(self, model: str, timeout_s: float = 300.0) -> int:
        """Roll ``model`` as an operator does: a copy of its newest version next to it as
        version n+1, then a load through the repository API (Triton loads n+1, then drains
        and unloads n). Returns n+1."""
        root = self.run_dir / "model_repository" / model
        old = max(int(p.name) for p in root.iterdir() if p.name.isdigit())
        shutil.copytree(root / str(old), root / str(old + 1), ignore=shutil.ignore_patterns("__pycache__"))
        self.http.load(model, timeout_s=timeout_s)
        return old + 1

    def _stub(self, model: str) -> Stub:
        """The stub serving ``model``'s newest version (during a roll the old version's
        stub drains alongside it)."""
        stubs = [s for s in self.stubs() if s.model == model]
        if not stubs:
            have = sorted({s.model for s in self.stubs()})
            raise ServerError(f"no live stub of model {model!r}; stubs run for: {', '.join(have) or 'none'}")
        return max(stubs, key=lambda s: (int(s.version) if s.version.isdigit() else -1, s.pid))

    def wait_model_ready(self, model: str, timeout_s: float = 120.0) -> float:
        """Seconds until ``model`` and the server answer ready (and no recovery is under
        way); raises ServerError when that takes longer than ``timeout_s``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.failure():
                raise ServerError(self.failure())
            busy = self.supervisor is not None and self.supervisor.status().recovering
            if not busy and self.is_ready() and self.http.model_ready(model):
                return time.monotonic() - t0
            time.sleep(0.05)
        raise ServerError(f"model {model!r} not ready within {timeout_s:.0f} s{self._log_hint()}")

    # ---- /dev/shm ------------------------------------------------------------
    def remove_shm_region(self, name: str) -> None:
        """Remove a dead stub's region (only one this server's launches named)."""
        if any(name.startswith(p) for p in self._shm_prefixes) and "/" not in name:
            _unlink(SHM_DIR / name)

    def owned_segments(self) -> list[str]:
        """What in ``/dev/shm`` belongs to this server's launches, live or gone (empty
        after :meth:`stop`)."""
        if not SHM_DIR.is_dir():
            return []
        pids = {*self._server_pids, *([self.process.pid] if self.process is not None else [])}
        return sorted(e.name for e in SHM_DIR.iterdir()
                      if any(e.name.startswith(p) for p in self._shm_prefixes)
                      or ((m := _POOL_FILE.match(e.name)) and int(m.group(1)) in pids))

    def _cleanup_python_envs(self) -> None:
        """Triton's Python backend makes an empty ``/tmp/python_env_*`` directory when it
        starts and removes it when it exits, unless it is killed: remove the empty ones
        made since a launch that had to be killed."""
        while self._killed_at:
            since = self._killed_at.pop()
            for d in Path(PYTHON_ENV_DIR).glob("python_env_*"):
                try:
                    if d.stat().st_mtime >= since and not any(d.iterdir()):
                        d.rmdir()
                except OSError:
                    pass   # gone already, or not empty after all

    def _cleanup_shm(self) -> None:
        """The regions of every launch whose server is gone, and their KV pool files."""
        if not SHM_DIR.is_dir():
            return
        live = self.process.pid if self.process is not None else None
        prefixes = self._shm_prefixes if live is None else self._shm_prefixes[:-1]
        for entry in SHM_DIR.iterdir():
            name = entry.name
            pool = _POOL_FILE.match(name)
            if any(name.startswith(p) for p in prefixes) or (
                    pool and int(pool.group(1)) in self._server_pids and int(pool.group(1)) != live):
                _unlink(entry)

    def log_tail(self, n: int = 40) -> str:
        if self.log_file is None or not Path(self.log_file).exists():
            return ""
        lines = Path(self.log_file).read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def _log_hint(self) -> str:
        tail = self.log_tail()
        return f"; last log lines ({self.log_file}):\n{tail}" if tail else ""


def remove_orphan_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove what servers started by a process that is gone left in ``/dev/shm`` (a
    ``tandem serve`` killed with SIGKILL never ran its cleanup): stub regions named
    after a dead launcher, KV pool files named after a dead tritonserver."""
    removed = []
    if not shm_dir.is_dir():
        return removed
    for entry in shm_dir.iterdir():
        m = _STUB_REGION.match(entry.name) or _POOL_FILE.match(entry.name)
        if m and not pid_exists(int(m.group(1))):
            _unlink(entry)
            removed.append(entry.name)
    return removed


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
