"""The CPU image and the compose stack, built and run with a real container engine
(podman). The test makes what it needs: podman, runc and mmdebstrap from apt where they
are missing; a Debian bookworm base with Python 3.11 (mmdebstrap + ``podman import``:
Docker Hub may be unreachable); a local package index (a directory mounted into the
build) of the wheels pip downloads on this host (the PyTorch index may be unreachable,
and the image's pip lacks this host's CA certificates). Then the image is built with
docker/Dockerfile.cpu's build arguments, and run:

- one container: ready within compose's start period, greedy text equal to the offline
  engine's (Triton's generate and the OpenAI API), SIGTERM drains a stream in flight and
  the container exits 0 within the grace period;
- docker/compose.yaml under podman-compose (host ports remapped to free ones, KV routed
  to the prefill server for every prompt): one prefill and two decode containers, the
  KV over UCX/TCP between containers, greedy text equal; one decode container stopped
  and started again while the other serves.

It skips, saying why, only where no container engine can run.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml

from tandem.backends.models.model_path import PACKAGED
from tandem.client.serve.triton_server import free_ports

from .test_multi_host import _get, _post as _post_text
from .triton_calls import eventually, metric_in

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
CACHE = ROOT / ".cache" / "images"
BASE = "localhost/tandem-base:bookworm"
IMAGE = "localhost/tandem:cpu"
# what python:3.11-slim-bookworm gives (libpython: the Python backend's stub links it)
BASE_PACKAGES = "python3.11,libpython3.11,python3-pip,python3.11-venv,ca-certificates"
# runc: crun fails here ("cgroups in hybrid mode not supported"); the default rlimits
# fail setrlimit in this machine kind's containers
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=16384:16384", "nproc=4096:4096"]
[engine]
runtime = "runc"
"""
READY_S = 300                 # compose's healthcheck start_period
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Path:"]
MAX_TOKENS = 12


def _run(cmd: list[str], env: dict, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _apt_install(packages: list[str]) -> str:
    """Install what is missing with apt; '' on success, else why not."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "not root or no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            return f"{' '.join(cmd)}: {proc.stderr.strip()[-500:]}"
    return ""


@pytest.fixture(scope="module")
def podman(tmp_path_factory) -> dict:
    """The environment podman and podman-compose run in; skips where podman cannot run."""
    missing = [p for p, exe in (("podman", "podman"), ("runc", "runc"), ("mmdebstrap", "mmdebstrap"),
                                ("podman-compose", "podman-compose")) if not shutil.which(exe)]
    why = _apt_install(missing) if missing else ""
    if not shutil.which("podman"):
        pytest.skip(f"no container engine: podman is missing and apt could not install it ({why})")
    env = dict(os.environ)
    if shutil.which("runc"):
        conf = tmp_path_factory.mktemp("podman") / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        env["CONTAINERS_CONF"] = str(conf)
    info = subprocess.run(["podman", "info"], env=env, capture_output=True, text=True, timeout=120)
    if info.returncode != 0:
        pytest.skip(f"podman cannot run here: {info.stderr.strip()[-500:]}")
    return env


@pytest.fixture(scope="module")
def base_image(podman) -> str:
    """Debian bookworm with Python 3.11, made with mmdebstrap once per machine (a pulled
    base is cached the same way); where mmdebstrap is missing, the Dockerfile's default."""
    if _run(["podman", "image", "exists", BASE], podman, check=False).returncode == 0:
        return BASE
    if not shutil.which("mmdebstrap"):
        return "python:3.11-slim-bookworm"
    CACHE.mkdir(parents=True, exist_ok=True)
    rootfs = CACHE / "rootfs.tar"
    t0 = time.monotonic()
    _run(["mmdebstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(rootfs)],
         podman, timeout=900)
    _run(["podman", "import", str(rootfs), BASE], podman)
    rootfs.unlink()
    print(f"\nbase image {BASE}: {time.monotonic() - t0:.0f} s")
    return BASE


def _dependencies() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


@pytest.fixture(scope="module")
def package_index() -> Path:
    """A PEP 503 index (a directory) of the wheels the image installs, downloaded by this
    host's pip (its indexes, find-links and CA certificates)."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    wheels, index = CACHE / "wheels", CACHE / "index"
    wheels.mkdir(parents=True, exist_ok=True)
    # setuptools: the editable install's build backend (pyproject's build-system)
    _run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(wheels),
          *_dependencies(), "setuptools>=68", "wheel"], dict(os.environ), timeout=1200)
    # the real default model's wheel, without its dependencies (as the Dockerfile installs it)
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
          *(dist for _, _, dist in PACKAGED.values())], dict(os.environ), timeout=1200)
    shutil.rmtree(index, ignore_errors=True)
    for whl in wheels.glob("*.whl"):
        project = index / canonicalize_name(parse_wheel_filename(whl.name)[0])
        project.mkdir(parents=True, exist_ok=True)
        os.link(whl, project / whl.name)      # a hard link: it resolves inside the build too
    # pip reads a file:// index's pages from index.html
    for project in index.iterdir():
        links = "".join(f'<a href="{quote(f.name)}">{f.name}</a>\n' for f in sorted(project.glob("*.whl")))
        (project / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    return index


@pytest.fixture(scope="module")
def cpu_image(podman, base_image, package_index) -> str:
    """`make image` with a local base and index: the build arguments the Dockerfile takes.
    The index is mounted into the build at a fixed path, so the arguments, and with them
    the cached layers (torch's, the dependencies'), stay the same from run to run."""
    t0 = time.monotonic()
    _run(["podman", "build", "--network", "host", "-f", "docker/Dockerfile.cpu",
          "--ignorefile", "docker/Dockerfile.cpu.dockerignore", "--volume", f"{package_index}:/index:ro",
          "--build-arg", f"BASE_IMAGE={base_image}",
          "--build-arg", "TORCH_INDEX_URL=file:///index", "--build-arg", "PIP_INDEX_URL=file:///index",
          "-t", IMAGE, str(ROOT)], podman, timeout=1500)
    size = int(_run(["podman", "image", "inspect", "--format", "{{.Size}}", IMAGE], podman).stdout)
    print(f"\n{IMAGE}: built in {time.monotonic() - t0:.0f} s, {size / 1e9:.2f} GB")
    return IMAGE


# fp32, as every e2e test compares text: bf16's rounding can tip a near-tie between a
# speculative step and a plain one (seen here: the CPU has avx512_bf16, so auto is bf16)
DTYPE = "float32"


@pytest.fixture(scope="module")
def reference():
    """Greedy text of the offline engine with the image's model, plain decoding (the
    image speculates with MTP: lossless)."""
    import torch

    from tandem.backends.engine.llm import LLM
    from tandem.backends.engine.params import SamplingParams
    torch.set_num_threads(1)
    llm = LLM(str(ROOT / "checkpoints" / "demo" / "target"), dtype=DTYPE)
    return {p: llm.generate(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].text for p in PROMPTS}


# ---- HTTP --------------------------------------------------------------------------------
def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    status, text = _post_text(url, body, timeout)
    return status, json.loads(text) if text.startswith("{") else {"error": text}


def _generate(http_url: str, prompt: str) -> str:
    """Triton's generate: the completion (text_output echoes the prompt)."""
    status, out = _post(f"{http_url}/v2/models/tandem/generate",
                        {"text_input": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, out
    assert out["text_output"].startswith(prompt), out
    return out["text_output"][len(prompt):]


def _wait_ready(http_url: str, name: str, env: dict, timeout_s: float = READY_S) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if _get(f"{http_url}/v2/health/ready", 2)[0] == 200:
            return time.monotonic() - t0
        state, restart = _run(["podman", "inspect", "--format", "{{.State.Status}}|{{.HostConfig.RestartPolicy.Name}}",
                               name], env).stdout.strip().split("|")
        # compose's restart: on-failure brings a server that died back
        assert state == "running" or (state == "exited" and restart == "on-failure" and _exit_code(name, env)), \
            f"{name} is {state}:\n{_logs(name, env)}"
        time.sleep(1)
    raise AssertionError(f"{name} not ready within {timeout_s} s:\n{_logs(name, env)}")


def _logs(name: str, env: dict) -> str:
    proc = _run(["podman", "logs", "--tail", "40", name], env, check=False)
    return proc.stdout + proc.stderr


def _exit_code(name: str, env: dict) -> int:
    return int(_run(["podman", "inspect", "--format", "{{.State.ExitCode}}", name], env).stdout)


# ---- the image -------------------------------------------------------------------------------
def test_dockerfile_installs_torch_before_the_code():
    """Layers: torch (pyproject's pin), then the dependencies from pyproject.toml alone,
    then the code, so a code change reinstalls neither."""
    text = (DOCKER / "Dockerfile.cpu").read_text()
    torch_pin = next(d for d in _dependencies() if d.startswith("torch=="))
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}\n" in text
    steps = [text.index(s) for s in ('"torch==${TORCH_VERSION}"', "COPY pyproject.toml ./", "COPY . .",
                                     "--no-deps -e .")]
    assert steps == sorted(steps)
    for arg in ("BASE_IMAGE=python:3.11-slim-bookworm", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu",
                "PIP_INDEX_URL=https://pypi.org/simple"):
        assert f"ARG {arg}\n" in text


def test_image_size(cpu_image, podman):
    size = int(_run(["podman", "image", "inspect", "--format", "{{.Size}}", cpu_image], podman).stdout)
    assert size <= 2.5e9, f"{cpu_image} is {size / 1e9:.2f} GB"


def test_image_holds_the_default_model(cpu_image, podman):
    """The image's default model (SmolLM2's GGUF, from its wheel) is there, where
    --model smollm2-135m-instruct looks for it."""
    script = ("import os; from tandem.backends.models.model_path import packaged_model; "
              "p = packaged_model(os.environ['TANDEM_MODEL']); print(p.stat().st_size)")
    out = _run(["podman", "run", "--rm", "--entrypoint", "python", cpu_image, "-c", script], podman)
    assert int(out.stdout.split()[-1]) > 50e6, out.stdout


@pytest.fixture(scope="module")
def container(cpu_image, podman, reference):
    """The image as `docker run` runs it, its ports published on free host ports; started
    after the reference is made (two cores)."""
    name = f"tandem-image-test-{os.getpid()}"
    ports = dict(zip((8000, 9000), free_ports(2)))
    started = time.monotonic()
    _run(["podman", "run", "-d", "--name", name, "--shm-size", "2g", "-e", f"TANDEM_DTYPE={DTYPE}",
          "-e", "TANDEM_MODEL=demo",   # the reference's model (the image's default: test_image_holds_...)
          *[a for c, h in ports.items() for a in ("-p", f"127.0.0.1:{h}:{c}")], cpu_image], podman)
    try:
        yield name, f"http://127.0.0.1:{ports[8000]}", f"http://127.0.0.1:{ports[9000]}", started
    finally:
        _run(["podman", "rm", "-f", "-t", "0", name], podman, check=False)


def test_container_is_ready_and_greedy_text_equals_the_engine(container, podman, reference):
    name, http_url, openai_url, started = container
    _wait_ready(http_url, name, podman, READY_S - (time.monotonic() - started))
    print(f"\nready {time.monotonic() - started:.0f} s after podman run")
    for prompt in PROMPTS:
        assert _generate(http_url, prompt) == reference[prompt]
    # structured output: xgrammar in the image masks CPU logits without OpenAI's triton
    status, out = _post(f"{http_url}/v2/models/tandem/generate",
                        {"text_input": "Answer:", "max_tokens": 4, "temperature": 0,
                         "guided_decoding_guide_type": "regex", "guided_decoding_guide": "(yes|no)"})
    assert status == 200 and out["text_output"] in ("Answer:yes", "Answer:no"), out
    # the API starts once Triton is ready
    deadline = time.monotonic() + 30
    while _get(f"{openai_url}/v1/models")[0] != 200:
        assert time.monotonic() < deadline, f"no OpenAI API 30 s after ready:\n{_logs(name, podman)}"
        time.sleep(0.5)
    status, out = _post(f"{openai_url}/v1/completions", {"model": "tandem", "prompt": PROMPTS[0],
                                                          "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, out
    assert out["choices"][0]["text"] == reference[PROMPTS[0]]


# run inside the container: send a signal to the stubs of the engine that streams tokens
_SIGNAL_ENGINE = """
import os, signal, sys
from tandem.client.serve.process_group import live_processes
from tandem.client.serve.stubs import Stub
hit = []
for pid, _, entry in live_processes():
    try:
        argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\\0")]
    except OSError:
        continue
    stub = Stub.from_argv(pid, argv)
    if stub is not None and stub.model in ("decode", "llm"):
        os.kill(pid, getattr(signal, sys.argv[1]))
        hit.append(pid)
print(len(hit))
"""


def _signal_engine(name: str, env: dict, sig: str) -> int:
    """``sig`` to the container's decode (or colocated llm) stubs; how many got it."""
    return int(_run(["podman", "exec", name, "python", "-c", _SIGNAL_ENGINE, sig], env).stdout)


def test_sigterm_drains_the_stream_in_flight_and_the_container_exits_0(container, podman):
    """`docker stop`: SIGTERM to tini, on to tandem serve; the grace period is compose's.

    The engine's stub is stopped (SIGSTOP) from before the signal until readiness has
    been read, so the stream is in flight by construction while the drain runs, however
    fast the machine generates."""
    name, http_url, _, _ = container
    _wait_ready(http_url, name, podman)
    grace_s = float(yaml.safe_load((DOCKER / "compose.yaml").read_text())["x-tandem"]["stop_grace_period"]
                    .rstrip("s"))
    tokens = 200
    req = urllib.request.Request(
        f"{http_url}/v2/models/tandem/generate_stream",
        data=json.dumps({"text_input": "def main():", "max_tokens": tokens, "min_tokens": tokens,
                         "temperature": 0, "stream": True}).encode(), headers={"Content-Type": "application/json"})
    stream = urllib.request.urlopen(req, timeout=120)
    first = stream.readline()
    assert first.startswith(b"data:"), first
    assert _signal_engine(name, podman, "SIGSTOP") >= 1, "no decode stub in the container"
    t_term = time.monotonic()
    readiness = []
    try:
        _run(["podman", "kill", "--signal", "TERM", name], podman)
        # until tandem serve has taken the signal the server is ready; after, it must not
        # be, while it drains (the deadline only keeps a broken drain from hanging the test)
        while not readiness or readiness[-1] == 200:
            assert time.monotonic() - t_term < grace_s, f"still ready {grace_s:.0f} s after SIGTERM"
            readiness.append(_get(f"{http_url}/v2/health/ready", 2)[0])
            time.sleep(0.05)
    finally:
        _signal_engine(name, podman, "SIGCONT")
    assert readiness[-1] != 0, f"the server stopped answering while its stream was in flight: {readiness}"
    after_term = [json.loads(line[5:]) for line in stream if line.startswith(b"data:")]
    assert after_term, "the stream ended at SIGTERM: nothing drained"
    last = after_term[-1]
    assert (last.get("finish_reason"), last.get("num_output_tokens")) == ("length", tokens), last
    rc = int(_run(["podman", "wait", name], podman, timeout=grace_s + 30).stdout.strip())
    took = time.monotonic() - t_term
    assert rc == 0, _logs(name, podman)
    assert took <= grace_s, f"exited {took:.0f} s after SIGTERM, grace period {grace_s:.0f} s"
    print(f"\nnot ready after SIGTERM ({readiness}), exit 0 {took:.1f} s after it")


# ---- compose ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(cpu_image, podman, reference, tmp_path_factory):
    """docker/compose.yaml under podman-compose with the built image, each published host
    port remapped to a free one (other servers may hold 8000 here), every prompt
    prefilled on the prefill server (else short prompts stay in decode: no KV moves), one
    torch thread per engine (three servers on a small machine; the reference's threads),
    the reference's dtype."""
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    compose.pop("x-tandem")
    published: dict[str, dict[int, int]] = {}
    inside = {name: [int(p.split(":")[-1]) for p in svc.pop("ports", [])]
              for name, svc in compose["services"].items()}
    hosts = iter(free_ports(sum(map(len, inside.values()))))   # distinct across services too
    for svc_name, svc in compose["services"].items():
        svc.pop("build")
        svc["image"] = cpu_image
        svc["environment"].update(TANDEM_DISAGG_POLICY="remote", TANDEM_THREADS="1", TANDEM_DTYPE=DTYPE,
                                  TANDEM_MODEL="demo")
        ports = {c: next(hosts) for c in inside[svc_name]}
        if ports:
            svc["ports"] = [f"127.0.0.1:{h}:{c}" for c, h in ports.items()]
        published[svc_name] = ports
    path = tmp_path_factory.mktemp("compose") / "compose.yaml"
    path.write_text(yaml.safe_dump(compose))
    project = f"tandem-compose-test-{os.getpid()}"
    cmd = ["podman-compose", "-p", project, "-f", str(path)]
    if not shutil.which("podman-compose"):
        pytest.fail("podman-compose is missing and apt could not install it")
    try:
        _run([*cmd, "up", "-d"], podman, timeout=300)
        names = {svc: _run(["podman", "ps", "-a", "--format", "{{.Names}}",
                            "--filter", f"label=io.podman.compose.project={project}",
                            "--filter", f"label=com.docker.compose.service={svc}"], podman).stdout.split()[0]
                 for svc in compose["services"]}
        # podman-compose does not wait for depends_on's service_healthy: the prefill
        # server, unpublished, through compose's own healthcheck
        deadline = time.monotonic() + READY_S
        while _run(["podman", "healthcheck", "run", names["prefill"]], podman, check=False).returncode != 0:
            assert time.monotonic() < deadline, f"prefill not healthy in {READY_S} s:\n{_logs(names['prefill'], podman)}"
            time.sleep(2)
        for svc in ("decode-0", "decode-1"):
            _wait_ready(f"http://127.0.0.1:{published[svc][8000]}", names[svc], podman)
        restarts = {svc: _run(["podman", "inspect", "--format", "{{.RestartCount}}", n], podman).stdout.strip()
                    for svc, n in names.items()}
        print(f"\ncompose stack ready; restarts: {restarts}")
        yield names, published
    finally:
        _run([*cmd, "down", "-t", "5"], podman, timeout=300, check=False)
        # podman-compose 1.0 leaves its network behind
        _run(["podman", "network", "rm", "-f", f"{project}_default"], podman, check=False)


def _decode_url(published, svc: str, port: int = 8000) -> str:
    return f"http://127.0.0.1:{published[svc][port]}"


def _tcp_peers(name: str, env: dict) -> set[tuple[str, int, int]]:
    """(remote address, local port, remote port) of the container's established TCP
    connections, from /proc/net/tcp (the image has no ss)."""
    peers = set()
    for line in _run(["podman", "exec", name, "cat", "/proc/net/tcp"], env).stdout.splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if state == "01":
            addr, port = remote.split(":")
            ip = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
            peers.add((ip, int(local.split(":")[1], 16), int(port, 16)))
    return peers


def _remote_requests_counted(metrics_url: str) -> str:
    """The metrics text once kv_transfer counts every prompt as prefilled remotely (its
    metrics thread refreshes them a poll later)."""
    def counted():
        _, metrics = _get(f"{metrics_url}/metrics")
        assert metric_in(metrics, "tandem_disagg_requests_total", "kv_transfer", path="remote") >= len(PROMPTS)
        return metrics
    return eventually(counted)


def test_compose_greedy_text_with_the_kv_over_tcp_between_containers(stack, podman, reference):
    names, published = stack
    prefill_ip = _run(["podman", "inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                       names["prefill"]], podman).stdout.strip()
    for svc in ("decode-0", "decode-1"):
        for prompt in PROMPTS:
            assert _generate(_decode_url(published, svc), prompt) == reference[prompt], svc
        _remote_requests_counted(_decode_url(published, svc, 8002))

        def received():   # polled by kv_transfer's metrics thread: asked until it is there
            _, metrics = _get(f"{_decode_url(published, svc, 8002)}/metrics")
            assert metric_in(metrics, "tandem_kv_received_bytes_total", "kv_transfer") > 0
            return metrics
        metrics = eventually(received)
        # the KV came over the link: no transfer failed and was prefilled by decode instead
        assert metric_in(metrics, "tandem_kv_transfer_recomputed_total", "decode") == 0
        # UCX's connections with the prefill container, beside gRPC's to its port 8001
        ucx = {p for p in _tcp_peers(names[svc], podman) if p[0] == prefill_ip and 8001 not in p[1:]}
        assert ucx, f"{svc}: no TCP connection with the prefill container but gRPC's"
    # compose's healthcheck, as the engine runs it (what depends_on: service_healthy waits for)
    for name in names.values():
        proc = _run(["podman", "healthcheck", "run", name], podman, check=False)
        assert proc.returncode == 0, f"{name}: healthcheck {proc.stdout} {proc.stderr}"


def test_compose_a_decode_container_stops_and_starts_while_the_other_serves(stack, podman, reference):
    names, published = stack
    served, stop_at = [], threading.Event()

    def serve_on():
        while not stop_at.is_set():
            served.append(_generate(_decode_url(published, "decode-0"), PROMPTS[1]))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        client = pool.submit(serve_on)
        t0 = time.monotonic()
        _run(["podman", "stop", "-t", "40", names["decode-1"]], podman, timeout=120)
        stopped_after = time.monotonic() - t0
        assert _exit_code(names["decode-1"], podman) == 0, _logs(names["decode-1"], podman)
        _run(["podman", "start", names["decode-1"]], podman)
        ready_after = _wait_ready(_decode_url(published, "decode-1"), names["decode-1"], podman)
        stop_at.set()
        client.result(timeout=180)
    assert served and set(served) == {reference[PROMPTS[1]]}, served
    for prompt in PROMPTS:
        assert _generate(_decode_url(published, "decode-1"), prompt) == reference[prompt]
    _remote_requests_counted(_decode_url(published, "decode-1", 8002))   # the new process's
    print(f"\ndecode-1: exit 0 {stopped_after:.1f} s after stop, ready {ready_after:.0f} s after start; "
          f"decode-0 served {len(served)} requests meanwhile")
