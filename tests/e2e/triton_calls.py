"""How the e2e tests talk to a running server: raw gRPC stream calls with hand-made
tensors (to send what the client library would not), HTTP (generate / SSE, the
repository API, JSON posts), and metrics — read as the models' threads refresh them."""
from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request
from typing import Callable, TypeVar

import numpy as np

T = TypeVar("T")
TRITON_TYPES = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32", np.dtype(np.uint64): "UINT64",
                np.dtype(np.uint8): "UINT8", np.dtype(np.bool_): "BOOL", np.dtype(object): "BYTES"}
# how long a wait on the server may take before it is a hang: never a measure of speed
# (a loaded 2-core machine takes seconds for what an idle one does in 0.5 s)
HANG_S = 60.0


# -- gRPC ------------------------------------------------------------------------------
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


# -- HTTP ------------------------------------------------------------------------------
def http_get(url: str, timeout_s: float = 10) -> tuple[int, str]:
    """``(status, body)``; status 0 when nothing answers (the body then says why)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, repr(e)


def post(url: str, body: dict, timeout_s: float = 120) -> tuple[int, str]:
    """POST ``body`` as JSON: ``(status, response body)``."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post_json(url: str, body: dict, timeout_s: float = 120) -> tuple[int, dict]:
    """:func:`post` of an API that answers JSON, errors included: ``(status, answer)``."""
    status, text = post(url, body, timeout_s)
    return status, json.loads(text)


def http_post(server, model: str, path: str, body: dict) -> tuple[int, str]:
    """POST to ``/v2/models/<model>/<path>`` (generate, generate_stream)."""
    return post(f"http://{server.http_url}/v2/models/{model}/{path}", body)


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


def load_model(server, model: str, timeout_s: float = 120, action: str = "load",
               headers: dict | None = None) -> int | str:
    """Triton's repository API: (re)load ``model`` (or unload it). 200, or what went wrong."""
    req = urllib.request.Request(f"http://{server.http_url}/v2/repository/models/{model}/{action}",
                                 data=b"{}", method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return f"{e.code}: {e.read().decode(errors='replace')}"
    except OSError as e:   # a timeout: the server no longer answers
        return repr(e)


def version_ready(server, model: str, version: int) -> bool:
    return http_get(f"http://{server.http_url}/v2/models/{model}/versions/{version}/ready")[0] == 200


# -- metrics ---------------------------------------------------------------------------
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


def busy_pages(server, *models: str) -> tuple[float, ...]:
    """The KV pages in use and reserved, per model in order."""
    return tuple(metric(server, "tandem_kv_pages", model, state=state)
                 for model in models for state in ("in_use", "reserved"))


def eventually(check: Callable[[], T], timeout_s: float = HANG_S) -> T:
    """``check()`` once its assertions hold. What the metrics endpoint shows is refreshed
    by each model's metrics thread (every 0.5 s, later when the machine is busy), so a
    test asks until the value is there instead of sleeping for a poll; ``timeout_s`` only
    ends a hang, with ``check``'s last AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.1)


def settled(read: Callable[[], T], quiet_s: float = 1.2, timeout_s: float = HANG_S) -> T:
    """``read()`` once it stopped changing: equal for ``quiet_s``, more than two polls of
    the metrics threads. For a value with no expected end: a baseline, or one that must
    not move."""
    value, since = read(), time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"still changing after {timeout_s:.0f} s: {value}"
        time.sleep(0.2)
        if (now := read()) != value:
            value, since = now, time.monotonic()
    return value


def metric_reaches(server, name: str, model: str, value: float, failing: str, **labels) -> None:
    """Wait until the metric (a counter, a gauge that must rise) is at least ``value``;
    ``failing``: the message if it never is."""
    def reached():
        assert (now := metric(server, name, model, **labels)) >= value, f"{failing}: {name} is {now}, not {value}"
    eventually(reached)


def pages_back(server, idle: tuple[float, ...], *models: str, failing: str) -> None:
    """Wait until :func:`busy_pages` of ``models`` is ``idle`` again; ``failing``: the
    message if it never is."""
    def back():
        assert (busy := busy_pages(server, *models)) == idle, f"{failing}: {busy}, idle {idle}"
    eventually(back)
