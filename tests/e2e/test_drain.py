"""Graceful termination of ``tandem serve``, as Kubernetes stops a pod: SIGTERM stops
admitting at once (readiness 4xx, new requests refused), lets the streams in flight end
with every token, then stops the server and exits 0, leaving no process and no file in
/dev/shm, also while a client leaves an idle stream open. The server is configured from
the environment (``TANDEM_<OPTION>``), as the containers configure it.

The model is the demo checkpoint with its layers repeated: deep enough that a long
stream is still running while the drain is checked.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tandem.client.generate import GenerateError, build_inputs, parse_response, stream_generate
from tandem.client.serve.process_group import kill_group, live_processes
from tandem.client.serve.triton_server import free_ports, remove_orphan_segments, stub_processes

from .triton_calls import http_get

pytestmark = pytest.mark.e2e
TOKENS = 1500
LAYERS = 24


@pytest.fixture(scope="module")
def deep_checkpoint(demo_checkpoint, tmp_path_factory):
    """The demo checkpoint with its 2 layers repeated to LAYERS (slower decode steps)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("deep") / "deep"
    shutil.copytree(demo_checkpoint, out)
    cfg = json.loads((out / "config.json").read_text())
    weights = load_file(out / "model.safetensors")
    for i in range(cfg["num_hidden_layers"], LAYERS):
        src = f"model.layers.{i % cfg['num_hidden_layers']}."
        weights.update({k.replace(src, f"model.layers.{i}.", 1): v.clone()
                        for k, v in list(weights.items()) if k.startswith(src)})
    cfg["num_hidden_layers"] = LAYERS
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def http_status(url: str) -> int:
    return http_get(url, 5)[0]     # 0: nothing listens (the server is gone)


def children(pid: int) -> list[int]:
    return [p for p, fields, _ in live_processes() if int(fields[1]) == pid]


@pytest.fixture
def server(deep_checkpoint, tmp_path):
    """``tandem serve`` (disaggregated) configured by TANDEM_* variables; killed with
    everything it started if the test leaves it running."""
    ports = dict(zip(("http", "grpc", "metrics"), free_ports(3)))
    env = {**os.environ, "TANDEM_MODEL": str(deep_checkpoint), "TANDEM_HOST": "127.0.0.1",
           "TANDEM_HTTP_PORT": str(ports["http"]), "TANDEM_GRPC_PORT": str(ports["grpc"]),
           "TANDEM_METRICS_PORT": str(ports["metrics"]), "TANDEM_OPENAI_PORT": "0", "TANDEM_THREADS": "1", "TANDEM_DTYPE": "float32", "TANDEM_ENFORCE_EAGER": "1",
           "TANDEM_DRAIN_TIMEOUT": "90", "TANDEM_RUN_DIR": str(tmp_path / "run"),
           "TANDEM_LOG_FILE": str(tmp_path / "server.log")}
    proc = subprocess.Popen([sys.executable, "-m", "tandem.client.cli", "serve"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen = []
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("Ctrl-C to stop.") for line in seen):
            assert proc.poll() is None and time.monotonic() < deadline, "tandem serve did not start:\n" + \
                "".join(seen) + (tmp_path / "server.log").read_text(errors="replace")[-3000:]
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        triton = [pid for pid in children(proc.pid) if "tritonserver" in _cmdline(pid)]
        assert len(triton) == 1, "".join(seen)
        yield proc, ports, triton[0], lines, tmp_path
    finally:
        if proc.poll() is None:
            for pid in children(proc.pid):
                kill_group(pid)
            proc.kill()
        proc.wait()
        remove_orphan_segments()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _long_stream(grpc_url: str):
    """A greedy stream of TOKENS tokens, under way: (its client, its answers, the first)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("tandem", build_inputs("def main():", max_tokens=TOKENS, min_tokens=TOKENS,
                                                     temperature=0.0), enable_empty_final_response=True)
    result, error = results.get(timeout=120)
    assert error is None, error
    return client, results, result


def test_sigterm_drains_the_streams_in_flight_then_exits_0(server):
    import tritonclient.grpc as grpcclient

    proc, ports, triton_pid, lines, tmp = server
    grpc_url, ready_url = f"127.0.0.1:{ports['grpc']}", f"http://127.0.0.1:{ports['http']}/v2/health/ready"
    assert http_status(ready_url) == 200
    client, results, first = _long_stream(grpc_url)
    responses = [parse_response(first)]
    # a client that keeps its gRPC stream open after its request (as tritonclient's do):
    # it keeps its ensemble loaded, so the drain must see the engines idle instead
    idle = grpcclient.InferenceServerClient(grpc_url)
    idle_results: queue.Queue = queue.Queue()
    idle.start_stream(callback=lambda result, error: idle_results.put((result, error)))
    idle.async_stream_infer("tandem", build_inputs("x", max_tokens=2), enable_empty_final_response=True)
    while not parse_response(idle_results.get(timeout=60)[0]).final:
        pass

    # readiness, watched from SIGTERM until the process is gone
    statuses, watching = [], threading.Event()

    def watch():
        while proc.poll() is None:
            statuses.append(http_status(ready_url))
            watching.set()
            time.sleep(0.02)
    watcher = threading.Thread(target=watch, daemon=True)
    proc.send_signal(signal.SIGTERM)
    t_term = time.monotonic()
    deadline = t_term + 5
    while http_status(ready_url) == 200:
        assert time.monotonic() < deadline, "still ready 5 s after SIGTERM"
        time.sleep(0.01)
    watcher.start()
    watching.wait(5)
    with pytest.raises(GenerateError, match="'tandem'"):
        list(stream_generate(grpc_url, "x = 1", model="tandem", max_tokens=3, timeout_s=30))
    t_refused = time.monotonic()

    while not responses[-1].final:
        result, error = results.get(timeout=120)
        assert error is None, error
        responses.append(parse_response(result))
    t_final = time.monotonic()
    client.stop_stream()
    client.close()
    assert responses[-1].num_output_tokens == TOKENS and responses[-1].finish_reason == "length"
    # every token came, in order: the cumulative counts rise to TOKENS (a response may carry
    # several steps' tokens: the reply pump coalesces what queued while it was sending)
    counts = [r.num_output_tokens for r in responses if r.num_output_tokens]
    assert counts == sorted(set(counts)) and counts[-1] == TOKENS
    assert t_final > t_refused, "the stream ended before the drain was checked: make it longer"

    assert proc.wait(timeout=60) == 0
    watcher.join(10)
    idle.stop_stream()
    idle.close()
    out = []
    while not lines.empty():
        out.append(lines.get())
    assert any(line.startswith("tandem: draining") for line in out), "".join(out)
    assert any(line.startswith("tandem: drained") for line in out), "".join(out)
    assert statuses and all(400 <= s < 500 or s == 0 for s in statuses), statuses
    print(f"drain: stream ended {t_final - t_term:.1f} s after SIGTERM, "
          f"exit {time.monotonic() - t_term:.1f} s after it")

    # nothing left: tritonserver, its stubs, their shared memory and the KV pool
    assert not os.path.exists(f"/proc/{triton_pid}") or open(f"/proc/{triton_pid}/stat").read().split()[2] == "Z"
    assert stub_processes(tmp / "run") == []
    left = [n for n in os.listdir("/dev/shm")
            if n.startswith(f"tandem_{proc.pid}_") or n.startswith(f"tandem-kv-{triton_pid}-")]
    assert left == [], left


def test_a_second_sigterm_cuts_the_drain_and_leaves_nothing(server):
    """A second signal while draining (or Ctrl-C) stops at once: the open stream is cut
    (a client error, not its last token), the server exits, and nothing of it is left —
    processes, shared memory, nor the empty /tmp/python_env_* Triton's Python backend
    leaves when it is killed."""
    import glob

    proc, ports, triton_pid, lines, tmp = server
    envs_before = set(glob.glob("/tmp/python_env_*"))
    client, results, _ = _long_stream(f"127.0.0.1:{ports['grpc']}")
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not any(line.startswith("tandem: draining") for line in list(lines.queue)):
        assert time.monotonic() < deadline, "no drain began"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    answers = []
    while True:
        result, error = results.get(timeout=30)
        answers.append((result, error))
        if error is not None or parse_response(result).final:
            break
    client.stop_stream()
    client.close()
    assert answers[-1][1] is not None, "the stream ran to its end: the second SIGTERM did not cut it"
    assert stub_processes(tmp / "run") == []
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"tandem_{proc.pid}_")]
    left = [d for d in set(glob.glob("/tmp/python_env_*")) - envs_before if not os.listdir(d)]
    assert left == [], left
