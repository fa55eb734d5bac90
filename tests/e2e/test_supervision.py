"""Supervision on a real tritonserver (`--mode both`, explicit model control): the stubs
of ``decode``, ``kv_transfer`` and ``llm`` are SIGKILLed in turn, each with
streams open, on one server. Each time every open stream ends (an error is fine) by the
reservation lease + 5 s, readiness drops and comes back, the next request gets the
engine's greedy text, the KV pages return to idle, and the dead stub's shared-memory
region is gone; after stop() nothing of the server is left in /dev/shm. The ``prefill``
stub, no step of any ensemble, is killed under load too: no request fails or differs
from its greedy reference, and readiness never drops.

``pytest -s`` prints the recovery times (stub killed -> correct text served again).
"""
from __future__ import annotations

import os
import threading
import time

import pytest

from tandem.client.generate import build_inputs, parse_response, stream_generate
from tandem.client.serve.options import ServerError
from tandem.client.serve.triton_server import stub_processes

from .triton_calls import eventually, metric

pytestmark = pytest.mark.e2e
SETTINGS = dict(max_num_seqs=8, page_size=4, max_num_batched_tokens=8)
PROMPT, MAX_TOKENS = "def fibonacci(n):\n    ", 10
STREAM_PROMPTS = ["import os\nimport sys\n", "class Stack:\n    def push(self, x):", "x = [i * i for i in",
                  "def merge(a, b):\n    out = []"]
ENSEMBLE = {"decode": "tandem", "kv_transfer": "tandem", "llm": "tandem_colocated"}
# decoupled models killed by a signal leave streams Triton never ends: the server restarts
ACTION = {"kv_transfer": "reload", "decode": "restart", "llm": "restart"}
# who reports the KV pool's pages: decode maps the pool kv_transfer reserves in (a killed
# kv_transfer's own series keep their last values: a dead stub cannot delete them)
POOLS = {"tandem": ("decode",), "tandem_colocated": ("llm",)}
RECOVERED: dict[str, dict] = {}


def _lease_s() -> float:
    from tandem.rdma.receiver import ReceiverConfig
    return ReceiverConfig().claim_lease_s


@pytest.fixture(scope="module")
def server(serve):
    with serve("serve-supervised", 300, exit_timeout_s=15, model_control_mode="explicit", mode="both",
               disagg_policy="remote", **SETTINGS) as srv:
        yield srv
        stop_leaves_no_process_and_no_segment(srv)


def stop_leaves_no_process_and_no_segment(server):
    """The teardown check of ``server``, after every test of the module that used it; it
    prints how each recovery of the module went."""
    run_dir = server.run_dir
    status = server.supervisor.status()
    server.stop()
    assert stub_processes(run_dir) == []
    assert server.owned_segments() == []
    print(f"\nrecovery after SIGKILL of a stub (reloads {status.reloads}, restarts {status.restarts}):")
    print(f"{'model':<12}{'action':<9}{'supervisor':>11}{'ready':>8}{'correct':>9}  streams ended ok / error")
    for model, r in RECOVERED.items():
        print(f"{model:<12}{r['action']:<9}{r['supervisor_s']:>10.2f}s{r['ready_s']:>7.2f}s{r['correct_s']:>8.2f}s"
              f"  {r['ended_ok']} / {8 - r['ended_ok']}: {r['ended_error']}")


@pytest.fixture(scope="module")
def reference(greedy_reference):
    return greedy_reference(MAX_TOKENS, **SETTINGS)(PROMPT).text


class Readiness:
    """Samples /v2/health/ready every 50 ms from a thread."""

    def __init__(self, server):
        self.samples: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self._thread.start()

    def _run(self, server):
        while not self._stop.wait(0.05):
            self.samples.append((time.monotonic(), server.http.server_ready()))

    def dropped_between(self, t0: float, t1: float) -> bool:
        return any(not ok for t, ok in list(self.samples) if t0 <= t <= t1)

    def close(self):
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def readiness(server):
    r = Readiness(server)
    yield r
    r.close()


class Stream:
    """One greedy streamed request on its own gRPC stream: how many responses, how it ended."""

    def __init__(self, url: str, model: str, prompt: str, max_tokens: int):
        import tritonclient.grpc as grpcclient

        self.responses, self.final, self.error, self.text = 0, False, None, ""
        self.started = threading.Event()
        self.ended = threading.Event()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_response)
        try:
            self.client.async_stream_infer(model, build_inputs(prompt, max_tokens=max_tokens, temperature=0.0,
                                                               stream=True), enable_empty_final_response=True)
        except Exception as exc:   # the server went away under us
            self._end(str(exc))

    def _on_response(self, result, error) -> None:
        if error is not None:
            self._end(str(error))
            return
        self.responses += 1
        self.started.set()
        reply = parse_response(result)
        self.text += reply.text
        if reply.final:
            self.final = True
            self.ended.set()

    def _end(self, error: str) -> None:
        self.error = error
        self.started.set()
        self.ended.set()

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=not self.ended.is_set())
        self.client.close()


def _text(server, ensemble: str) -> str:
    rs = list(stream_generate(server.grpc_url, PROMPT, model=ensemble, timeout_s=60, max_tokens=MAX_TOKENS,
                              temperature=0.0, stream=True))
    return "".join(r.text for r in rs)


def _busy_pages(server, ensemble: str) -> dict[str, float]:
    """The KV pages each model of ``ensemble`` reports reserved or in use (none: {})."""
    pages = {f"{model}/{state}": metric(server, "tandem_kv_pages", model, state=state)
             for model in POOLS[ensemble] for state in ("in_use", "reserved")}
    return {k: v for k, v in pages.items() if v}


def _probe(server, ensemble: str, want: str, since: float, out: dict) -> None:
    """From the kill on: wait until the server says ready, then send greedy requests
    until the text is right; record the first answer after ready and when it was right."""
    try:
        server.wait_model_ready(ensemble, timeout_s=180)
        out["ready_s"] = time.monotonic() - since
        while time.monotonic() - since < 240:
            try:
                got = _text(server, ensemble)
            except Exception as exc:
                got = f"error: {exc}"
            out.setdefault("first_after_ready", got)
            if got == want:
                out["correct_s"] = time.monotonic() - since
                return
            time.sleep(0.2)
    except Exception as exc:
        out["error"] = str(exc)


@pytest.mark.parametrize("model", ["decode", "kv_transfer", "llm"])
def test_a_killed_stub_is_recovered(server, reference, readiness, model):
    ensemble = ENSEMBLE[model]
    server.wait_model_ready(ensemble, timeout_s=60)   # raises ServerError when not ready in time
    assert server.http.model_ready(ensemble)
    assert _text(server, ensemble) == reference
    victim = next(s for s in server.stubs() if s.model == model)
    regions_before = set(server.owned_segments())
    # four long streams generating, and four short requests in their first steps
    streams = [Stream(server.grpc_url, ensemble, p, 600) for p in STREAM_PROMPTS]
    for s in streams:
        assert s.started.wait(60), "a stream got no first response"
    streams += [Stream(server.grpc_url, ensemble, p, 16) for p in STREAM_PROMPTS]

    killed_at, killed_wall = time.monotonic(), time.time()
    pid = server.kill_stub(model)
    probe: dict = {}
    prober = threading.Thread(target=_probe, args=(server, ensemble, reference, killed_at, probe))
    prober.start()
    deadline = killed_at + _lease_s() + 5
    try:
        hung = [i for i, s in enumerate(streams) if not s.ended.wait(max(0.0, deadline - time.monotonic()))]
    finally:
        for s in streams:
            s.close()
    prober.join()

    assert pid == victim.pid
    assert not hung, f"streams {hung} got no final response within the lease + 5 s after {model} died"
    assert "error" not in probe, probe
    assert probe["first_after_ready"] == reference, probe
    assert readiness.dropped_between(killed_at, killed_at + probe["ready_s"]), "readiness never dropped"
    assert server.is_ready() and server.http.model_ready(ensemble)
    recoveries = [r for r in server.supervisor.status().recoveries if r.noticed_at >= killed_wall - 1]
    assert recoveries and all(r.ok for r in recoveries), recoveries
    last = recoveries[-1]
    if any(r.model == "" for r in recoveries):   # tritonserver itself died of the kill (see supervisor.py)
        assert last.action == "restart", recoveries
    else:
        assert (last.model, last.pid, last.action) == (model, pid, ACTION[model]), recoveries
    assert victim.shm_region in regions_before and victim.shm_region not in os.listdir("/dev/shm")

    def pages_back():
        assert not (busy := _busy_pages(server, ensemble)), \
            f"KV pages still reserved or in use after {model} died: {busy}"
    eventually(pages_back, timeout_s=max(0.0, deadline + 10 - time.monotonic()))
    RECOVERED[model] = dict(action=last.action, supervisor_s=last.seconds, ready_s=probe["ready_s"],
                            correct_s=probe["correct_s"], ended_ok=sum(s.final for s in streams),
                            ended_error=sorted({(s.error or "")[:90] for s in streams if s.error}))


def test_a_killed_prefill_costs_no_request(server, greedy_reference, readiness):
    """``prefill`` is no step of the ensembles: with every prompt routed to it
    (``--disagg-policy remote``), its stub SIGKILLed while streams are in prefill and in
    decode costs no request — the ones it was prefilling are prefilled again by decode
    when their transfer fails, the ones sent while it restarts are prefilled by decode —
    and every text is the greedy reference; the server stays ready throughout and the
    supervisor reloads prefill in place."""
    greedy = greedy_reference(MAX_TOKENS, **SETTINGS)
    server.wait_model_ready("tandem", timeout_s=60)
    want = {(p, n): greedy(p, n).text for p in STREAM_PROMPTS for n in (48, 16)}
    want[(PROMPT, MAX_TOKENS)] = greedy(PROMPT).text
    streams = [(p, 48, Stream(server.grpc_url, "tandem", p, 48)) for p in STREAM_PROMPTS]
    for _, _, s in streams:
        assert s.started.wait(60), "a stream got no first response"
    streams += [(p, 16, Stream(server.grpc_url, "tandem", p, 16)) for p in STREAM_PROMPTS]
    killed_at, killed_wall = time.monotonic(), time.time()
    pid = server.kill_stub("prefill")
    # sent while prefill restarts (or is dead and not yet noticed)
    meanwhile = [_text(server, "tandem") for _ in range(3)]
    try:
        hung = [i for i, (_, _, s) in enumerate(streams) if not s.ended.wait(180)]
    finally:
        for _, _, s in streams:
            s.close()
    ended_at = time.monotonic()
    assert not hung, f"streams {hung} never ended after prefill died"
    failed = [(p, n, s.error) for p, n, s in streams if not s.final or s.error]
    assert not failed, failed
    wrong = [(p, n, s.text) for p, n, s in streams if s.text != want[(p, n)]]
    assert not wrong, wrong
    assert meanwhile == [want[(PROMPT, MAX_TOKENS)]] * 3
    assert not readiness.dropped_between(killed_at, ended_at), "readiness dropped while prefill restarted"

    def reloaded():
        recs = [r for r in server.supervisor.status().recoveries if r.noticed_at >= killed_wall - 1]
        assert [(r.model, r.pid, r.action, r.ok) for r in recs] == [("prefill", pid, "reload", True)], recs
    eventually(reloaded, timeout_s=120)
    print(f"\nprefill killed: {metric(server, 'tandem_kv_transfer_recomputed_total', 'decode'):.0f} transfers "
          f"failed and were recomputed by decode; "
          f"{metric(server, 'tandem_disagg_requests_total', 'kv_transfer', path='local'):.0f} prompts "
          "prefilled in decode meanwhile")
    # prefill takes jobs again: a new prompt's KV comes over the transfer
    received = metric(server, "tandem_kv_received_bytes_total", "kv_transfer")
    fresh = iter(f"# attempt {i}\n{PROMPT}" for i in range(1000))

    def transferred():
        prompt = next(fresh)
        assert "".join(r.text for r in stream_generate(
            server.grpc_url, prompt, model="tandem", timeout_s=60, max_tokens=MAX_TOKENS, temperature=0.0,
            stream=True)) == greedy(prompt).text
        assert metric(server, "tandem_kv_received_bytes_total", "kv_transfer") > received
    eventually(transferred, timeout_s=60)

    def pages_back():
        assert not (busy := _busy_pages(server, "tandem")), f"KV pages still reserved or in use: {busy}"
    eventually(pages_back, timeout_s=_lease_s() + 15)


def test_kill_stub_names_the_models_it_can_kill(server):
    with pytest.raises(ServerError, match="no live stub of model 'nope'; stubs run for: .*prefill"):
        server.kill_stub("nope")
