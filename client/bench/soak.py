"""``tandem bench soak``: N requests at concurrency C through the disaggregated
ensemble while things go wrong — cancellations at random points, injected KV
transfer faults, extreme sampling values, stub processes killed at given times —
and the verdicts a server must earn: none hung, every failure with a clear reason,
every completed greedy text exact, pages and reservations back to idle, correct
text served again soon after each kill.

Bounded in count (``--requests``) and time (``--max-seconds``, ``--deadline-s`` per
request). Prints a table, writes JSON and a plot over time.
"""
from __future__ import annotations

import argparse
import itertools
import queue
import re
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.rdma.faults import POINTS as FAULT_POINTS

from tandem.client.bench.args import (ArgumentTypeError, fraction, non_negative_float, positive_float,
                         positive_int)
from tandem.client.bench.harness import start_server, work_dir
from tandem.client.bench.report import header, save_figure, write
from tandem.client.paths import DEMO_CHECKPOINTS
from tandem.client.serve.stubs import proc_state
from tandem.client.bench.soak_workload import Outcome, PlannedRequest, make_plan, summarize, timeline

if TYPE_CHECKING:
    from tandem.client.bench.chaos_workload import ChaosRequest

MODEL = "tandem"
PROMPTS = [
    "def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def push(self, x):",
    "for i in range(10):\n    ", "def read_lines(path):\n    with open(path) as f:",
    "# parse the arguments\nparser = argparse.ArgumentParser(", "try:\n    import json\nexcept",
    "def __repr__(self):\n    return", "while True:\n    line = input()", "x = [i * i for i in",
    "def merge(a, b):\n    out = []", "if __name__ == '__main__':\n    ", "class Node:\n    def __init__(",
    "def test_add():\n    assert", "with open('data.csv') as f:\n    reader", "return sorted(items, key=",
]
PROBE = (PROMPTS[0], 8)
# shared preambles (a module's header, as chat turns share a system prompt): requests that
# start with one hit the prefix cache, whose pages outlive the requests that computed them
PREAMBLES = [
    '"""Utilities for reading, validating and writing the configuration files of a small web\n'
    'service: paths, environment overrides, defaults, and the errors a user can cause."""\n'
    'from __future__ import annotations\n\nimport json\nimport os\nfrom pathlib import Path\n\n',
    '# Copyright the authors. Licensed under the Apache License, Version 2.0 (the "License");\n'
    '# you may not use this file except in compliance with the License. Unless required by\n'
    '# applicable law or agreed to in writing, software is distributed "AS IS".\n\nimport sys\n\n',
    'class Matrix:\n    """A dense matrix of floats, stored row by row, with the operations a\n'
    '    linear-algebra exercise needs: addition, multiplication, transpose."""\n\n'
    '    def __init__(self, rows):\n        self.rows = [list(r) for r in rows]\n\n',
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=positive_int, default=2000)
    p.add_argument("--concurrency", type=positive_int, default=16)
    p.add_argument("--cancel-frac", type=fraction, default=0.2, help="requests cancelled at a random point")
    p.add_argument("--fault-frac", type=fraction, default=0.05,
                   help="KV transfers failed by injection (the server's --faults)")
    p.add_argument("--fault-point", default="mid_layers", choices=FAULT_POINTS,
                   help="where injected transfer faults strike")
    p.add_argument("--extreme-frac", type=fraction, default=0.02,
                   help="requests with extreme sampling values")
    p.add_argument("--kill", type=kill_schedule, default="prefill:15,decode:35",
                   help="stub kills, MODEL:SECONDS after the start, comma-separated ('' for none)")
    p.add_argument("--deadline-s", type=positive_float, default=120.0,
                   help="a request with no final response by then counts as hung")
    p.add_argument("--max-seconds", type=positive_float, default=1800.0,
                   help="stop sending new requests after this")
    p.add_argument("--backoff-s", type=non_negative_float, default=0.5,
                   help="a worker whose request failed waits this long before its next (as a client "
                        "honouring 'retry later' does)")
    p.add_argument("--shared-prefix-frac", type=fraction, default=0.5,
                   help="requests whose prompt starts with one of 3 shared preambles (prefix-cache hits)")
    p.add_argument("--kv-audit", type=fraction, default=1.0,
                   help="the server's --kv-audit: the share of prefix-cache hits whose pages are checked "
                        "against their checksums (default: every one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=str(DEMO_CHECKPOINTS / "target"))
    p.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"),
                   help="the server's and the reference's (default: float32, where greedy text is exact "
                        "across batch shapes; in bfloat16 near-ties flip with the batch)")
    p.add_argument("--keep-work", action="store_true",
                   help="keep the temp dir of the server's repository and log (removed otherwise)")
    p.add_argument("--out", type=Path, default=Path("docs/bench/soak.json"))


def parse_kills(text: str) -> list[tuple[str, float]]:
    """``"prefill:60,decode:150"`` -> ``[("prefill", 60.0), ("decode", 150.0)]``.

    >>> parse_kills("prefill:60, decode:150.5")
    [('prefill', 60.0), ('decode', 150.5)]
    """
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        model, sep, at = item.partition(":")
        if not (sep and model.strip()):
            raise ArgumentTypeError(f"{item!r}: must be MODEL:SECONDS, e.g. prefill:15")
        try:
            seconds = non_negative_float(at.strip())
        except ArgumentTypeError as exc:
            raise ArgumentTypeError(f"{item!r}: the seconds {exc}") from None
        out.append((model.strip(), seconds))
    return sorted(out, key=lambda x: x[1])


def kill_schedule(text: str) -> str:
    """``--kill``'s type: ``text`` as written (the report keeps it so) once it parses."""
    parse_kills(text)
    return text


# -- one request --------------------------------------------------------------------------

def run_request(url: str, req: PlannedRequest | ChaosRequest, deadline_s: float) -> Outcome:
    """Send ``req`` on its own gRPC stream; cancel it where the plan says. ``req.sampling``
    are the ensemble's optional inputs (temperature, seed, a guide, ...)."""
    import tritonclient.grpc as grpcclient

    from tandem.client.generate import build_inputs, parse_response

    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    started = time.monotonic()
    out = Outcome(req.index, req.kind, "hung", started, started)
    responses, text = 0, []
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(MODEL, build_inputs(req.prompt, max_tokens=req.max_tokens, stream=True,
                                                      **req.sampling),
                                  enable_empty_final_response=True)
    except InferenceServerException as exc:   # e.g. the server restarts: connection refused
        answers.put((None, exc))
    try:
        while True:
            if req.cancel_after is not None and responses >= req.cancel_after:
                out.status = "cancelled"
                break
            left = started + deadline_s - time.monotonic()
            try:
                result, error = answers.get(timeout=max(left, 0.001))
            except queue.Empty:
                break                                          # hung
            if error is not None:
                out.status, out.error = "failed", str(error)
                break
            r = parse_response(result)
            responses += 1
            text.append(r.text)
            out.cached_tokens = max(out.cached_tokens, r.num_cached_tokens)
            if r.final:
                out.status, out.finish_reason = "ok", r.finish_reason
                break
    finally:
        try:
            client.stop_stream(cancel_requests=True)
            client.close()
        except InferenceServerException:
            pass
    out.ended_at, out.text = time.monotonic(), "".join(text)
    return out


# -- the server's own view ----------------------------------------------------------------

def kv_pages(metrics_url: str) -> dict[str, float]:
    """``tandem_kv_pages`` by model and state, from the stubs that are alive (a killed
    stub's series stay on ``/metrics`` with their last values; ``incarnation`` is its pid,
    which stays in /proc as a zombie until Triton reaps it)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    pages: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'tandem_kv_pages\{(.*)\} (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            state = proc_state(int(labels.get("incarnation", 0) or 0))
            if state is None or state.state == "Z":   # a dead stub's series (a zombie: not yet reaped)
                continue
            key = f"{labels.get('model')}/{labels.get('state')}"
            pages[key] = pages.get(key, 0.0) + float(m.group(2))
    return pages


def wait_idle(metrics_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """The page counts once nothing is reserved or in use (or after ``timeout_s``)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            pages = kv_pages(metrics_url)
        except OSError:              # the server is restarting
            if time.monotonic() > end:
                raise
            time.sleep(1.0)
            continue
        busy = sum(v for k, v in pages.items() if k.endswith(("/reserved", "/in_use")))
        if busy == 0 or time.monotonic() > end:
            return pages
        time.sleep(1.0)


# -- the run ------------------------------------------------------------------------------

def greedy_reference(model_dir: str, outcomes: list[Outcome], plan: list[PlannedRequest],
                     dtype: str = "float32") -> None:
    """Mark each completed greedy request exact or not against the offline engine."""
    import torch

    from tandem.backends import LLM, SamplingParams
    torch.set_num_threads(1)
    checked = [o for o in outcomes if o.status == "ok" and plan[o.index].greedy]
    keys = sorted({(plan[o.index].prompt, plan[o.index].max_tokens) for o in checked})
    if not keys:
        return
    llm = LLM(model_dir, dtype=dtype)
    texts = llm.generate([p for p, _ in keys],
                         [SamplingParams(max_tokens=m, temperature=0.0) for _, m in keys])
    want = {k: t.text for k, t in zip(keys, texts)}
    for o in checked:
        o.exact = o.text == want[(plan[o.index].prompt, plan[o.index].max_tokens)]


def probe_until_correct(url: str, want: str, since: float, timeout_s: float) -> float | None:
    """Seconds from ``since`` until a greedy probe returns ``want`` (None: not by ``timeout_s``)."""
    req = PlannedRequest(-1, PROBE[0], PROBE[1], {"temperature": 0.0}, "greedy", None)
    while time.monotonic() - since < timeout_s:
        o = run_request(url, req, deadline_s=10.0)
        if o.status == "ok" and o.text == want:
            return o.ended_at - since
        time.sleep(0.5)
    return None


def run(args: argparse.Namespace) -> int:
    report = header("soak", args)
    plan = make_plan(args.requests, PROMPTS, args.cancel_frac, args.extreme_frac, args.seed,
                     prefixes=PREAMBLES, prefix_frac=args.shared_prefix_frac)
    from tandem.backends import LLM, SamplingParams
    probe_want = LLM(args.model_dir, dtype=args.dtype).generate(
        PROBE[0], SamplingParams(max_tokens=PROBE[1], temperature=0.0))[0].text
    # the server's repository and log
    with work_dir("tandem-soak-", keep=args.keep_work) as run_dir, ExitStack() as stack:
        outcomes, recoveries, start, elapsed, before, after, cache = _soak(args, plan, probe_want,
                                                                           run_dir, stack)
    greedy_reference(args.model_dir, outcomes, plan, args.dtype)
    summary = summarize(outcomes)
    report.update({
        "settings": {k: getattr(args, k) for k in ("requests", "concurrency", "cancel_frac", "fault_frac",
                                                   "fault_point", "extreme_frac", "kill", "deadline_s",
                                                   "backoff_s", "shared_prefix_frac", "kv_audit", "seed")},
        "prefix_cache": cache,
        "elapsed_s": round(elapsed, 1), "summary": summary.as_dict(), "goals_met": summary.goals_met,
        "pages_before": before, "pages_after": after,
        "leaked": {k: v for k, v in after.items() if k.endswith(("/reserved", "/in_use")) and v},
        "recoveries": recoveries,
        "server_log": str(run_dir / "tritonserver.log") if args.keep_work else None,
        "timeline_5s": timeline(outcomes, start, 5.0),
    })
    _print(report)
    write(report, args.out)
    _plot(report, args.out.with_suffix(".png"))
    return 0 if summary.goals_met and not report["leaked"] and not cache["corrupt_pages"] else 1


def _soak(args, plan: list[PlannedRequest], probe_want: str, run_dir: Path, stack: ExitStack):
    """The requests and kills against a server started on ``stack``: (outcomes,
    recoveries, start, elapsed seconds, pages before, pages after)."""
    from tandem.client.serve.options import ServeOptions
    from tandem.client.serve.triton_server import TritonServer

    kills = parse_kills(args.kill)
    faults = f"transfer_fail={args.fault_frac}@{args.fault_point}" if args.fault_frac > 0 else ""
    options = ServeOptions.of(model_dir=args.model_dir, dtype=args.dtype, torch_threads=1, mode="disaggregated",
                              faults=faults, disagg_policy="remote",   # the transfer path under faults
                              kv_audit=args.kv_audit)
    server = start_server(stack, options, run_dir, log_file=run_dir / "tritonserver.log",
                          model_control_mode="explicit", ready_timeout_s=300, exit_timeout_s=60)
    before = wait_idle(server.metrics_url)
    todo = iter(plan)
    lock = threading.Lock()
    outcomes: list[Outcome] = []
    start = time.monotonic()

    def worker() -> None:
        while time.monotonic() - start < args.max_seconds:
            with lock:
                req = next(todo, None)
            if req is None:
                return
            o = run_request(server.grpc_url, req, args.deadline_s)
            with lock:
                outcomes.append(o)
            if o.status == "failed":
                time.sleep(args.backoff_s)

    recoveries = []

    def killer() -> None:
        for model, at in kills:
            time.sleep(max(0.0, start + at - time.monotonic()))
            if len(outcomes) >= len(plan):
                return
            killed_at = time.monotonic()
            pid = server.kill_stub(model)
            seconds = probe_until_correct(server.grpc_url, probe_want, killed_at, timeout_s=120.0)
            recoveries.append({"model": model, "pid": pid, "at_s": round(killed_at - start, 2),
                               "recovered_s": None if seconds is None else round(seconds, 2)})
            print(f"  killed {model} (pid {pid}) at {killed_at - start:.1f} s: correct text again "
                  f"after {seconds if seconds is None else round(seconds, 2)} s", flush=True)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
    threads.append(threading.Thread(target=killer, daemon=True))
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join()
    threads[-1].join(timeout=150)
    elapsed = time.monotonic() - start
    after = wait_idle(server.metrics_url)
    return outcomes, recoveries, start, elapsed, before, after, cache_counters(server.metrics_url)


CACHE_SERIES = {"hit_tokens": "tandem_prefix_cache_hits_total", "audited_pages": "tandem_prefix_cache_audited_pages_total",
                "corrupt_pages": "tandem_prefix_cache_corrupt_pages_total"}


def cache_counters(metrics_url: str, series: dict[str, str] = CACHE_SERIES) -> dict[str, float]:
    """decode's counters ``series`` (default: the prefix cache's), each summed over its
    labels and incarnations (a restarted decode's dead series keep their last values,
    which count)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {}
    for key, name in series.items():
        out[key] = sum(float(v) for labels, v in re.findall(rf'^{name}\{{(.*)\}} (\S+)$', text, flags=re.M)
                       if 'model="decode"' in labels)
    return out


def _print(report: dict) -> None:
    s = report["summary"]
    print(f"\nsoak: {s['requests']} requests in {report['elapsed_s']} s")
    print(f"{'status':<12}{'count':>8}")
    for k in ("ok", "cancelled", "failed", "hung"):
        print(f"{k:<12}{s['by_status'].get(k, 0):>8}")
    print(f"failed without a clear reason: {s['failed_unclear']}; greedy checked {s['greedy_checked']}, "
          f"inexact {s['greedy_inexact']}")
    print(f"pages before {report['pages_before']}\npages after  {report['pages_after']}")
    c = report["prefix_cache"]
    print(f"decode's prefix cache: {c['hit_tokens']:.0f} prompt tokens served from it, {c['audited_pages']:.0f} "
          f"pages of hits checked against their checksums, {c['corrupt_pages']:.0f} found changed")
    for r in report["recoveries"]:
        print(f"kill {r['model']} at {r['at_s']} s: correct text again after {r['recovered_s']} s")
    for msg, n in itertools.islice(s["errors"].items(), 10):
        print(f"  {n:>5}  {msg}")


def outcome_bars(ax, timeline_5s: dict[str, list[int]]) -> int:
    """Requests ended per 5 s, stacked by how they ended; returns the tallest stack."""
    xs = [5 * i for i in range(len(timeline_5s["ok"]))]
    bottom = [0] * len(xs)
    for status, color in (("ok", "tab:green"), ("cancelled", "tab:gray"), ("failed", "tab:red"),
                          ("hung", "black")):
        ax.bar(xs, timeline_5s[status], width=4.5, bottom=bottom, color=color, label=status, align="edge")
        bottom = [b + v for b, v in zip(bottom, timeline_5s[status])]
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("requests ended per 5 s")
    return max(bottom or [1])


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.6))
    top = outcome_bars(ax, report["timeline_5s"])
    for r in report["recoveries"]:
        ax.axvline(r["at_s"], color="tab:purple", ls="--")
        ax.text(r["at_s"], top, f" kill {r['model']}", color="tab:purple", fontsize=7, va="top")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("soak: how requests end while faults are injected and stubs killed", fontsize=9)
    save_figure(fig, path, report)
