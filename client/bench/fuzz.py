"""``tandem bench fuzz``: random and adversarial requests (fuzz_inputs.py) to every
interface of one server (the OpenAI API, Triton's HTTP generate endpoints, gRPC streams
to the ensembles), and what each one got back.

Every answer must be clean: a success, or a 4xx (an OpenAI error JSON; Triton's
``{"error": ...}``; a gRPC error that is not UNAVAILABLE or INTERNAL) that says what was
wrong. A 5xx, a request with no answer within ``--request-timeout``, a process of the
server that died (the supervisor's record) or a KV page left in use afterwards is a
failure, listed with its input. The same check on fewer examples: tests/e2e/test_fuzz.py.
"""
from __future__ import annotations

import argparse
import json
import queue
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandem.client.bench.fuzz_inputs import encode, grpc_request, openai_body, raw_body, triton_generate_body

DEFAULT_OUT = Path("docs/bench/fuzz.json")
CLEAN, FAILED = "clean", "failed"
# Triton 2.51's generate endpoint converts the JSON body to typed tensors itself, before any
# model sees it, and answers a value of the wrong JSON type with HTTP 500 and its parser's
# message ("Unable to parse 'data': attempt to access JSON non-boolean as boolean"). No
# model of ours is involved and none can change it: counted apart, not as a failure.
TRITON_PARSE = "triton_parse_500"
_TRITON_PARSE_MESSAGES = (b"Unable to parse 'data'", b"Unable to parse JSON bytes array")


@dataclass
class Tally:
    """Outcomes per interface, and the failures with what caused them."""
    counts: dict[str, Counter] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)

    def add(self, target: str, outcome: str, detail: str, sent) -> None:
        self.counts.setdefault(target, Counter())[outcome] += 1
        if outcome == FAILED:
            self.failures.append({"target": target, "why": detail[:300], "sent": repr(sent)[:500]})

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())


def classify_http(status: int | None, body: bytes, error: str = "") -> tuple[str, str]:
    """A clean answer (2xx, or a 4xx whose body names the error) or a failure, and why.

    >>> classify_http(400, b'{"error": {"message": "max_tokens: ..."}}')
    ('clean', '400')
    >>> classify_http(500, b'{"error": "boom"}')[0], classify_http(None, b"", "timed out")[0]
    ('failed', 'failed')
    >>> classify_http(500, b'{"error":"Unable to parse JSON bytes array: attempt to access..."}')[0]
    'triton_parse_500'
    """
    if status is None:
        return FAILED, f"no answer: {error}"
    if 200 <= status < 300:
        return CLEAN, str(status)
    if 400 <= status < 500:
        try:
            err = json.loads(body).get("error")
        except (ValueError, AttributeError):
            err = None
        return (CLEAN, str(status)) if err else (FAILED, f"{status} without an error message: {body[:200]!r}")
    if status == 500 and any(body.startswith(b'{"error":"' + m) for m in _TRITON_PARSE_MESSAGES):
        return TRITON_PARSE, body[:120].decode(errors="replace")
    return FAILED, f"{status}: {body[:200]!r}"


def post(url: str, data: bytes, timeout_s: float) -> tuple[int | None, bytes, str]:
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read(), ""
    except urllib.error.HTTPError as e:
        return e.code, e.read(), ""
    except (urllib.error.URLError, OSError) as e:
        return None, b"", repr(e)


# gRPC errors that mean the server, not the request, failed
BAD_GRPC = ("StatusCode.UNAVAILABLE", "StatusCode.INTERNAL", "not healthy", "Socket closed",
            "StatusCode.DEADLINE_EXCEEDED")


def grpc_tensors(spec) -> list:
    """tritonclient inputs for ``spec`` [(name, dtype, shape, seed)]; values of each dtype
    drawn from its seed (BYTES: random bytes, often no valid UTF-8)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import triton_to_np_dtype
    out = []
    for name, dtype, shape, seed in spec:
        rng = np.random.default_rng(seed)
        n = int(np.prod(shape)) if shape else 1
        if dtype == "BYTES":
            values = np.array([bytes(rng.integers(0, 256, rng.integers(0, 12)).tolist()) for _ in range(n)],
                              dtype=np.object_)
        elif dtype == "BOOL":
            values = rng.integers(0, 2, n).astype(np.bool_)
        else:
            np_dtype = triton_to_np_dtype(dtype)
            info = np.iinfo(np_dtype) if np.issubdtype(np_dtype, np.integer) else None
            with np.errstate(over="ignore"):   # FP16 overflows to inf: one more adversarial value
                values = (rng.integers(info.min, info.max, n, dtype=np_dtype, endpoint=True) if info is not None
                          else (rng.standard_normal(n) * 10.0 ** rng.integers(0, 6)).astype(np_dtype))
        t = grpcclient.InferInput(name, list(shape), dtype)
        t.set_data_from_numpy(values.reshape(shape))
        out.append(t)
    return out


def grpc_stream(url: str, model: str, spec, timeout_s: float) -> tuple[str, str]:
    """One streamed request of ``spec``'s tensors to ``model``, until its final response or error."""
    import tritonclient.grpc as grpcclient
    try:
        inputs = grpc_tensors(spec)
    except Exception as exc:   # the client itself refuses the tensor (e.g. a shape it cannot send)
        return CLEAN, f"client refused: {type(exc).__name__}"
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                return FAILED, f"no final response within {timeout_s:.0f} s"
            if error is not None:
                text = str(error)
                return (FAILED, text[:300]) if any(b in text for b in BAD_GRPC) else (CLEAN, "error")
            params = result.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                return CLEAN, "ok"
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def targets(server, openai_url: str | None) -> list[str]:
    """The interfaces this server has."""
    out = [f"http:{m}" for m in server.options.ensembles]
    out += [f"http-typed:{m}" for m in server.options.ensembles]
    out += [f"grpc:{m}" for m in server.options.ensembles]
    if openai_url:
        out += ["openai:completions", "openai:chat", "openai:raw"]
    return out


def send_one(target: str, data, server, openai_url: str | None, timeout_s: float) -> tuple[str, str, object]:
    """Send what ``data`` (hypothesis) draws for ``target``; (outcome, detail, what was sent)."""
    kind, name = target.split(":", 1)
    if kind == "openai":
        if name == "raw":
            sent = data.draw(raw_body)
            return (*classify_http(*post(f"{openai_url}/completions", sent, timeout_s)), sent)
        sent = data.draw(openai_body(name))
        path = "completions" if name == "completions" else "chat/completions"
        return (*classify_http(*post(f"{openai_url}/{path}", encode(sent), timeout_s)), sent)
    if kind in ("http", "http-typed"):
        sent = data.draw(triton_generate_body(text_model=name != "tandem_tokens", typed=kind == "http-typed"))
        url = f"http://{server.http_url}/v2/models/{name}/generate"
        return (*classify_http(*post(url, encode(sent), timeout_s)), sent)
    sent = data.draw(grpc_request)
    return (*grpc_stream(server.grpc_url, name, sent, timeout_s), sent)


def fuzz(server, openai_url: str | None, examples: int, seed_value: int, timeout_s: float,
         progress=None) -> Tally:
    """``examples`` requests, the interface of each drawn at random; a Tally of what came back."""
    from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st

    tally, names = Tally(), targets(server, openai_url)

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate])
    @seed(seed_value)
    @given(st.data())
    def one(data):
        target = data.draw(st.sampled_from(names))
        outcome, detail, sent = send_one(target, data, server, openai_url, timeout_s)
        tally.add(target, outcome, detail, sent)
        if progress is not None and tally.total % 500 == 0:
            progress(tally)

    one()
    return tally


def leftovers(server) -> list[str]:
    """What a fuzzed server must not show afterwards: dead processes, pages or requests
    still held, readiness lost."""
    from tandem.client.serve.triton_server import requests_in_engine
    problems = [f"a process died: {c}" for c in server.crashes()]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        held = requests_in_engine(server.metrics_url)
        pages = used_pages(server.metrics_url)
        if held == 0 and pages == 0 and server.is_ready():
            return problems
        time.sleep(0.5)
    return problems + [f"30 s after the last request: {held} requests in the engines, {pages} KV pages "
                       f"in use or reserved, ready: {server.is_ready()}"]


_HELD_PAGES = re.compile(r'^tandem_kv_pages\{[^}]*state="(?:in_use|reserved)"[^}]*\} (\S+)$', re.MULTILINE)


def used_pages(metrics_url: str) -> float | None:
    """KV pages in use or reserved, over every engine model."""
    from tandem.client.serve.triton_server import metric_sum
    return metric_sum(metrics_url, _HELD_PAGES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.client.bench.args import positive_float, positive_int
    p.add_argument("--examples", type=positive_int, default=10_000, help="requests to send (default: 10000)")
    p.add_argument("--mode", default="both", choices=["disaggregated", "colocated", "both"],
                   help="the server's mode: both (default) serves every ensemble")
    p.add_argument("--model", default="demo", help="the served checkpoint (default: the demo target)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=positive_float, default=120.0,
                   help="seconds a request may take before it counts as unanswered")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def run(args) -> int:
    from tandem.client.bench.harness import start_server, work_dir
    from tandem.client.bench.report import header, write
    from tandem.client.openai.frontend import start_for
    from tandem.client.serve.options import ServeOptions
    from tandem.client.serve.triton_server import free_port

    with work_dir("tandem-bench-fuzz-") as work, ExitStack() as stack:
        options = ServeOptions.of(mode=args.mode, model_dir="" if args.model == "demo" else args.model,
                                  max_num_seqs=8)
        server = start_server(stack, options, work / "server", log_file=work / "tritonserver.log")
        api = start_for(server, free_port())
        if api is not None:
            stack.callback(api.stop)
        openai_url = api.base_url if api is not None else None
        t0 = time.monotonic()
        tally = fuzz(server, openai_url, args.examples, args.seed, args.request_timeout,
                     progress=lambda t: print(f"  {t.total} requests, {len(t.failures)} failures", flush=True))
        seconds = time.monotonic() - t0
        problems = leftovers(server)
    rows = {t: dict(c) for t, c in sorted(tally.counts.items())}
    print(f"\n{tally.total} requests in {seconds:.0f} s; failures {len(tally.failures)}; after: "
          f"{'; '.join(problems) or 'no dead process, no page or request held, ready'}")
    print("| interface | requests | clean | Triton's parser: 500 | failed |\n|---|---:|---:|---:|---:|")
    for t, c in rows.items():
        print(f"| {t} | {sum(c.values())} | {c.get(CLEAN, 0)} | {c.get(TRITON_PARSE, 0)} | {c.get(FAILED, 0)} |")
    for f in tally.failures[:20]:
        print(f"  FAILED {f['target']}: {f['why']}\n    sent {f['sent']}")
    report = {**header("fuzz", args), "seconds": round(seconds, 1), "requests": tally.total,
              "by_interface": rows, "failures": tally.failures, "after": problems}
    write(report, args.out)
    return 0 if not tally.failures and not problems else 1
