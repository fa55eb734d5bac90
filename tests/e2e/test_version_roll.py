"""Version rolls under load.

With ``--model-control-mode explicit``, a model can be rolled in two ways while
streams are in flight: a new version next to the old one (``<model>/<v+1>/``, then
``POST /v2/repository/models/<model>/load``; Triton loads v+1, then drains and
unloads v), or a reload in place (the same version's files change, the same POST).
Either way Triton builds the new instance before it tears down the old one, so
for a while both live in one server.

Each roll here runs with 8 greedy streams in flight in the ``tandem`` ensemble, and
``decode``, ``kv_transfer`` and ``prefill`` are each rolled several times in a row,
both ways. After every roll:

- every stream ended without an error and with the offline engine's greedy text;
- the old instance finished unloading, and the server log holds no abort (glibc's
  heap checks, ``Signal (6) received``: tritonserver's own crash handler);
- the metrics endpoint answers and still exports the rolled model's series (a
  series that vanished while its model is loaded means the new instance writes to
  a metric the old one deleted).

A note on reloads in place: Triton re-creates a model's instances only when a file
other than ``config.pbtxt`` changed (a touched ``config.pbtxt`` alone keeps the
running instances), so a reload touches the version's ``model.py``.

A server that aborted, or lost a loaded model's series, is not rolled again (its
crash handler deadlocks in a thread that still holds a malloc arena, and the old
instance never finishes unloading): the later rolls fail at once, naming the first
sign. When the module is done with the server, its fixture checks that the server
answers every endpoint after the rolls that ran.
"""
from __future__ import annotations

import os
import re
import shutil
import threading
import time

import pytest

from tandem.client.generate import build_inputs, parse_response, stream_generate

from .triton_calls import http_get, http_post, load_model, sse_events, version_ready

pytestmark = pytest.mark.e2e

SETTINGS = dict(max_num_seqs=8, page_size=4, max_num_batched_tokens=8)
NUM_STREAMS = 8
# long enough that the streams are still running while the new instance loads and
# the old one drains (8 streams of 200 tokens take ~2.5 s on 2 cores)
MAX_TOKENS = 200
PROMPTS = [f"def f{i}(x):\n    return x * {i}" + " + 1" * i for i in range(NUM_STREAMS)]
ROLLS = 2   # of each model, each way, in a row
# (model, how); versions first: a reload in place that aborts leaves a server that
# cannot be rolled again, and the version rolls still say what they have to say
SCENARIOS = [("decode", "version"), ("kv_transfer", "version"), ("prefill", "version"),
             ("prefill", "reload"), ("decode", "reload"), ("kv_transfer", "reload")]
# a series each model exports from the moment it loads (prefill exports none)
SERIES = {"decode": "tandem_requests_in_engine", "kv_transfer": "tandem_kv_pages"}
# glibc's heap checks and tritonserver's crash handler ("Signal (15)" is a plain stop)
ABORT = re.compile(r"Signal \((?!15\)|2\))\d+\) received|malloc|unaligned|corrupted|"
                   r"double free|free\(\): invalid|Segmentation fault|Aborted")
UNLOAD_TIMEOUT_S = 60
STREAM_TIMEOUT_S = 120

_corrupted: list[str] = []   # once the server's heap is known bad, later rolls fail at once


@pytest.fixture(scope="module")
def server(serve, reference):
    with serve("serve-roll", 300, exit_timeout_s=20, model_control_mode="explicit", mode="disaggregated",
               disagg_policy="remote", **SETTINGS) as srv:
        yield srv
        answers_every_endpoint(srv, reference)


@pytest.fixture(scope="module")
def reference(greedy_reference):
    """``LLM.generate``'s greedy completion, MAX_TOKENS unless asked."""
    return greedy_reference(MAX_TOKENS, **SETTINGS)


# ---- the server ------------------------------------------------------------------
def _log(server) -> str:
    return server.log_file.read_text(errors="replace")


def _aborts(server) -> list[str]:
    return [line for line in _log(server).splitlines() if ABORT.search(line)]


def _versions(server, model: str) -> list[int]:
    return sorted(int(p.name) for p in (server.run_dir / "model_repository" / model).iterdir()
                  if p.name.isdigit())


def _unloaded(server, model: str, version: int) -> int:
    return _log(server).count(f"successfully unloaded '{model}' version {version}")


def _exports(server, family: str, model: str, version: int) -> bool:
    """Whether the metrics endpoint has a ``family`` series of ``model`` ``version``
    (whatever its other labels)."""
    status, text = http_get(server.metrics_url)
    assert status == 200, f"the metrics endpoint did not answer: {status} {text}"
    for line in text.splitlines():
        m = re.match(rf"{family}\{{(.*)\}} \S+$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if labels.get("model") == model and labels.get("version") == str(version):
                return True
    return False


# ---- the load --------------------------------------------------------------------
class _Streams:
    """``NUM_STREAMS`` greedy streams on one gRPC stream, started at once."""

    def __init__(self, server):
        import tritonclient.grpc as grpcclient

        self.texts = [""] * NUM_STREAMS
        self.reasons = [""] * NUM_STREAMS
        self.errors: list[str] = []
        self._started: set[int] = set()
        self._done: set[int] = set()
        self._lock = threading.Lock()
        self._all_started, self._all_done = threading.Event(), threading.Event()
        self._client = grpcclient.InferenceServerClient(server.grpc_url)
        self._client.start_stream(callback=self._on_result)
        for i, prompt in enumerate(PROMPTS):
            self._client.async_stream_infer(
                "tandem", build_inputs(prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True),
                request_id=str(i), enable_empty_final_response=True)

    def _on_result(self, result, error) -> None:
        with self._lock:
            if self._all_done.is_set():   # e.g. the local cancel when the stream closes
                return
            if error is not None:   # an error ends its request (whose id it does not carry)
                self.errors.append(error.message() if hasattr(error, "message") else str(error))
            else:
                r, rid = parse_response(result), int(result.get_response().id)
                self._started.add(rid)
                self.texts[rid] += r.text
                if r.final:
                    self.reasons[rid] = r.finish_reason
                    self._done.add(rid)
            if len(self._started) + len(self.errors) >= NUM_STREAMS:
                self._all_started.set()
            if len(self._done) + len(self.errors) >= NUM_STREAMS:
                self._all_done.set()

    def wait_started(self, timeout_s: float = 60) -> None:
        assert self._all_started.wait(timeout_s), "the streams did not start"

    def finish(self, timeout_s: float = STREAM_TIMEOUT_S) -> None:
        finished = self._all_done.wait(timeout_s)
        with self._lock:
            self._all_done.set()          # what came so far is the result
            self.errors = list(self.errors)
        # cancel only requests still running (tritonserver 2.51 may fail to unload a
        # model after a completed request's stream was cancelled)
        self._client.stop_stream(cancel_requests=not finished)
        self._client.close()
        assert finished, (f"{NUM_STREAMS - len(self._done) - len(self.errors)} of {NUM_STREAMS} "
                          f"streams still open after {timeout_s:.0f} s")


# ---- a roll ----------------------------------------------------------------------
def _prepare(server, model: str, how: str) -> tuple[int, int]:
    """Put the roll in place in the repository: ``(old version, new version)``."""
    root = server.run_dir / "model_repository" / model
    old = _versions(server, model)[-1]
    if how == "version":
        shutil.copytree(root / str(old), root / str(old + 1),
                        ignore=shutil.ignore_patterns("__pycache__"))
        return old, old + 1
    model_py = root / str(old) / "model.py"
    mtime = max(time.time(), model_py.stat().st_mtime + 1)
    os.utime(model_py, (mtime, mtime))
    return old, old


def _roll_under_load(server, reference, model: str, how: str) -> None:
    if _corrupted:
        pytest.fail(f"not rolled: the server's memory went bad in an earlier roll ({_corrupted[0]})")
    old, new = _prepare(server, model, how)
    unloads_before = _unloaded(server, model, old)
    streams = _Streams(server)
    streams.wait_started()          # every stream is in decode when the roll begins
    status = load_model(server, model)
    streams.finish()
    # the old instance drains, then goes: wait for it, watching for an abort meanwhile
    deadline = time.monotonic() + UNLOAD_TIMEOUT_S
    while (_unloaded(server, model, old) == unloads_before and not _aborts(server)
           and time.monotonic() < deadline):
        time.sleep(0.2)
    aborts = _aborts(server)
    if aborts:
        _corrupted.append(f"{model} {how} {old}->{new}: {aborts[0]}")
    assert not aborts, f"the server log shows an abort after the {how} roll of {model}: {aborts}"
    assert status == 200, f"POST load of {model} ({how} {old}->{new}): {status}"
    assert _unloaded(server, model, old) > unloads_before, (
        f"the old instance of {model} (version {old}) did not unload within {UNLOAD_TIMEOUT_S} s")

    assert streams.errors == [], f"{len(streams.errors)} streams failed: {streams.errors}"
    wrong = [i for i, (p, t) in enumerate(zip(PROMPTS, streams.texts)) if t != reference(p).text]
    assert not wrong, f"streams {wrong} differ from the engine's greedy text"
    assert all(r in ("stop", "length") for r in streams.reasons), streams.reasons

    assert version_ready(server, model, new), f"{model} version {new} is not ready"
    if new != old:
        assert not version_ready(server, model, old), f"{model} version {old} still ready"
    if model in SERIES and not _exports(server, SERIES[model], model, new):
        # the old instance deleted a metric the new one still writes to (the same series)
        _corrupted.append(f"{model} {how} {old}->{new}: lost {SERIES[model]}")
        pytest.fail(f"the metrics endpoint lost {SERIES[model]} of {model} version {new}, "
                    f"which is loaded")


@pytest.mark.parametrize(("model", "how"), SCENARIOS, ids=[f"{m}-{h}" for m, h in SCENARIOS])
def test_roll_with_8_streams_in_flight(server, reference, model, how):
    for _ in range(ROLLS):
        _roll_under_load(server, reference, model, how)


def answers_every_endpoint(server, reference):
    """The teardown check of ``server``, after the rolls of the module that ran."""
    assert not _aborts(server), _aborts(server)
    base = f"http://{server.http_url}"
    assert http_get(f"{base}/v2/health/live")[0] == 200
    assert http_get(f"{base}/v2/health/ready")[0] == 200
    for model in server.options.models:
        assert http_get(f"{base}/v2/models/{model}/ready")[0] == 200, model

    prompt = "def fibonacci(n):\n    "
    rs = list(stream_generate(server.grpc_url, prompt, model="tandem", timeout_s=60,
                              max_tokens=16, temperature=0.0, stream=True))
    assert rs[-1].final and "".join(r.text for r in rs) == reference(prompt, 16).text

    status, text = http_post(server, "tandem", "generate_stream",
                             {"text_input": prompt, "max_tokens": 16, "temperature": 0, "stream": True})
    assert status == 200, text
    assert "".join(e["text_output"] for e in sse_events(text)) == reference(prompt, 16).text

    for model, family in SERIES.items():
        assert _exports(server, family, model, _versions(server, model)[-1]), (model, family)
    assert not _aborts(server), _aborts(server)
