"""How the e2e tests talk to a running server: raw gRPC stream calls with hand-made
tensors (to send what the client library would not), HTTP generate / SSE, metrics."""
from __future__ import annotations

import json
import queue
import re
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np

TRITON_TYPES = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32", np.dtype(np.uint64): "UINT64",
                np.dtype(np.bool_): "BOOL", np.dtype(object): "BYTES"}


def tensors(**values: np.ndarray) -> list:
    """gRPC inputs exactly as given (shape and type included)."""
    import tritonclient.grpc as grpcclient

    out = []
    for name, arr in values.items():
        t = grpcclient.InferInput(name, list(arr.shape), TRITON_TYPES[arr.dtype])
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def first_answer(url: str, model: str, inputs: list, timeout_s: float = 60):
    """Send one request on a gRPC stream; return ``(result, error)`` of its first answer."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        return answers.get(timeout=timeout_s)
    finally:
        client.stop_stream()
        client.close()


def http_post(server, model: str, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/{path}",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


def metric(server, name: str, model: str, **labels) -> float:
    """The metric's value summed over the series that carry these labels (every
    incarnation of the model: a reloaded model's old and new stubs label apart)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return metric_in(text, name, model, other_labels={"incarnation"}, **labels)


def metric_in(text: str, name: str, model: str, other_labels: set[str] | None = None,
              **labels) -> float:
    """Sum of the Prometheus series ``name`` in ``text`` whose labels include these;
    ``other_labels``: the only further labels a series may have (None: any)."""
    want = {"model": model, "version": "1", **labels}
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m:
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if {k: have.get(k) for k in want} == want and \
                    (other_labels is None or set(have) - set(want) <= other_labels):
                total += float(m.group(2))
    return total


@contextmanager
def served(run_dir: Path, ready_timeout_s: float = 180, **options):
    """A server of ``ServeOptions.of(**options)`` in ``run_dir`` (its log there), started
    and stopped on exit, also when a test fails."""
    from tandem.client.serve.options import ServeOptions
    from tandem.client.serve.triton_server import TritonServer

    srv = TritonServer(ServeOptions.of(**options), run_dir=run_dir, log_file=run_dir / "tritonserver.log",
                       ready_timeout_s=ready_timeout_s, exit_timeout_s=30)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
