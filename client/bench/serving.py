"""Colocated, disaggregated and conditional serving on the same cores, through the real
server.

For each mode a tritonserver is started (`tandem serve` as a library), all before the
first measurement: colocated gives the one engine every core; disaggregated gives
prefill and decode a core each and sends every prompt to prefill; conditional
(``tandem serve``'s default) has the same split but prefills short prompts in decode's
batch. A streaming gRPC client per server keeps ``--background`` streams decoding and
sends long prompts (``--long-tokens``) on a Poisson schedule; every response is
timestamped. Each rate is measured ``--repeats`` times, the modes taking turns (A, B,
C, A, B, C, ...). Reported per mode and rate, as the median over the repeats with its
min–max spread: output tokens/s, per-request decode tokens/s, TTFT of the long prompts,
inter-token latency p50/p90/p99 (all streams); per repeat, conditional over the better
of the other two, and its median (``ratios``); plots: ITL over time at one rate, and
the sweep with error bars. The target's weights serve with a longer context (``max_position_embeddings``
raised: timing, not text quality, is measured here).
"""
from __future__ import annotations

import argparse
import json
import queue
import time
from pathlib import Path

import numpy as np

from tandem.client.bench.args import (add_dtype, core_count, model_path, names, non_negative_floats,
                                      positive_float, positive_int, token_range)
from tandem.client.bench.harness import start_server, long_context_copy, prompt_texts, work_dir
from tandem.client.bench.repeats import (error_bars, fmt, interleaved, ratios_table, ratios_to_best,
                            summarize_runs)
from tandem.client.bench.report import header, save_figure, write
from tandem.client.paths import DEMO_CHECKPOINTS
from tandem.client.bench.request_client import RequestInput, RequestOutput, TritonStream
from tandem.client.bench.serving_workload import poisson_arrivals, summarize, timed_gaps

DEFAULT_OUT = Path("docs/bench/serving.json")
# mode -> (the ensemble called, tandem serve --mode, --disagg-policy)
MODES = {"colocated": ("tandem_colocated", "colocated", "conditional"),
         "disaggregated": ("tandem", "disaggregated", "remote"),
         "conditional": ("tandem", "disaggregated", "conditional")}
KEYS = ["output_tok_s", "decode_tok_s_median", "decode_tok_s_p10", "ttft_ms_p50", "ttft_ms_p90",
        "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "itl_ms_max", "errors", "requests_long"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--rates", type=non_negative_floats, default="0,0.1,0.2,0.4",
                   help="long-prompt arrivals per second, comma-separated")
    p.add_argument("--duration", type=positive_float, default=40.0, help="seconds per rate")
    p.add_argument("--background", type=positive_int, default=4, help="streams decoding all the time")
    p.add_argument("--background-tokens", type=positive_int, default=96)
    p.add_argument("--long-tokens", type=token_range, default="1024,2048",
                   help="long prompt length range LO,HI (tokens)")
    p.add_argument("--long-max-tokens", type=positive_int, default=32)
    p.add_argument("--cores", type=core_count, default=2, help="cores of the machine to use")
    add_dtype(p)
    p.add_argument("--modes", type=names(*MODES), default=",".join(MODES),
                   help=f"comma-separated, of: {', '.join(MODES)}")
    p.add_argument("--repeats", type=positive_int, default=3, help="measurements per mode and rate, interleaved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-work", action="store_true",
                   help="keep the temp dir of the servers' logs and the model copy (removed otherwise)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


# -- the workload ----------------------------------------------------------------------
def run_rate(client: TritonStream, rate: float, duration: float, background: list[str],
             background_tokens: int, longs: list[tuple[str, int]], long_max_tokens: int,
             seed: int) -> tuple[list[RequestOutput], tuple[float, float]]:
    """Keep the background streams going and send long prompts at ``rate`` for
    ``duration`` seconds; returns the outputs of this rate and its measurement window."""
    def send_background(prompt: str) -> str:
        return client.send(RequestInput(prompt, background_tokens, kind="background", prompt_tokens=0))

    first = set(client.outputs)
    start = time.perf_counter()
    live = {send_background(p) for p in background}
    arrivals = poisson_arrivals(rate, duration, seed)
    i = 0
    while time.perf_counter() - start < duration:
        due = start + arrivals[i] if i < len(arrivals) else start + duration
        timeout = max(0.0, min(due, start + duration) - time.perf_counter())
        try:
            out = client.finished.get(timeout=timeout)
            if out.kind == "background" and out.request_id in live:
                live.discard(out.request_id)
                live.add(send_background(background[len(live) % len(background)]))
        except queue.Empty:
            pass
        while i < len(arrivals) and time.perf_counter() >= start + arrivals[i]:
            text, n = longs[i % len(longs)]
            client.send(RequestInput(text, long_max_tokens, kind="long", prompt_tokens=n))
            i += 1
    end = time.perf_counter()
    deadline = end + 60
    while any(out.end is None for rid, out in client.outputs.items() if rid not in first) \
            and time.perf_counter() < deadline:
        time.sleep(0.05)
    outputs = [out for rid, out in client.outputs.items() if rid not in first]
    return outputs, (start + min(5.0, duration / 4), end)


# -- the modes ---------------------------------------------------------------------------
def options_for(mode: str, args, model_dir: Path):
    """colocated: one engine on every core; disaggregated: prefill and decode a half each,
    every prompt to prefill; conditional (``tandem serve``'s default): the same split,
    short prompts prefilled by decode, which takes the prefill core while it idles."""
    import os

    from tandem.client.serve.options import ServeOptions
    serve_mode, policy = MODES[mode][1:]
    cores = args.cores
    if serve_mode == "colocated":
        threads = cores
    else:   # 0: tandem serve's own split (half each; conditional's decode borrows when idle)
        threads = 0 if cores == os.cpu_count() else max(1, cores // 2)
    return ServeOptions.of(model_dir=str(model_dir), dtype=args.dtype, mode=serve_mode,
                        torch_threads=threads, disagg_policy=policy, max_num_seqs=32,
                        max_num_batched_tokens=512)


def output_tok_s(outputs: list[RequestOutput], window: tuple[float, float]) -> float:
    """Tokens streamed inside the window, all streams, per second."""
    lo, hi = window
    n = sum(k for r in outputs for s, k in zip(r.chunk_s, r.chunk_tokens) if lo <= r.start + s <= hi)
    return round(n / (hi - lo), 1) if hi > lo else 0.0


def run(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    lo, hi = args.long_tokens
    modes, rates = list(args.modes), list(args.rates)
    with work_dir("tandem-bench-serving-", keep=args.keep_work) as work:
        model_dir = long_context_copy(args.model, work / "model", hi + 2 * args.long_max_tokens + 64)
        rng = np.random.default_rng(args.seed)
        lengths = [int(x) for x in rng.integers(lo, hi + 1, size=16)]
        longs = list(zip(prompt_texts(model_dir, lengths), lengths))
        background = prompt_texts(model_dir, [48 + 16 * (i % 4) for i in range(args.background)])
        with ExitStack() as stack:   # servers and clients stop before the work dir goes
            clients, threads = {}, {}
            for mode in modes:
                print(f"{mode}: starting tritonserver", flush=True)
                options = options_for(mode, args, model_dir)
                server = start_server(stack, options, work / mode, attempts=2, log_file=work / f"{mode}.log")
                clients[mode] = TritonStream(server.grpc_url, MODES[mode][0])
                stack.callback(clients[mode].close)
                threads[mode] = options.engine.torch_threads
            for mode in modes:   # warm-up: one long prompt and the background streams, not measured
                run_rate(clients[mode], 0.0, 5.0, background, 16, longs, 4, args.seed)
            timeline: dict[str, dict] = {m: {} for m in modes}

            def measure(mode, rate, rep):
                client = clients[mode]
                errors_before = len(client.errors)
                logs, window = run_rate(client, rate, args.duration, background,
                                        args.background_tokens, longs, args.long_max_tokens,
                                        args.seed + rates.index(rate))
                stats = summarize(logs, window)
                stats["errors"] += len(client.errors) - errors_before
                stats["output_tok_s"] = output_tok_s(logs, window)
                if rep == 0:
                    t0 = window[0]
                    timeline[mode][str(rate)] = [
                        (round(t - t0, 4), round(g * 1000, 3)) for log in logs
                        for t, g in timed_gaps(log) if window[0] <= t <= window[1]]
                print(f"  {mode:14s} rate {rate:4.2f}/s run {rep + 1}  " + "  ".join(
                    f"{k}={v}" for k, v in stats.items()), flush=True)
                return stats

            runs = interleaved(rates, modes, args.repeats, measure)
    results = {m: {"mode": m, "model": MODES[m][0], "torch_threads": threads[m],
                   "rates": {str(r): summarize_runs(runs[m][r], KEYS) for r in rates},
                   "timeline": timeline[m]} for m in modes}
    report = {
        **header("serving", args),
        "workload": {"background_streams": args.background, "long_tokens": [lo, hi],
                     "long_max_tokens": args.long_max_tokens, "duration_s": args.duration},
        "repeats": args.repeats, "results": results,
        "ratios": ratios_to_best(runs, rates), "comparison": compare(results),
    }
    write(report, args.out)
    paths = plot(results, args.out, report)
    print(table(report))
    print(json.dumps(report["comparison"], indent=1))
    print(f"wrote {args.out}, " + ", ".join(str(p) for p in paths))
    return 0


# -- report -------------------------------------------------------------------------------
def _median(results: dict, mode: str, rate: str, key: str):
    return results[mode]["rates"][rate][key]["median"]


def compare(results: dict) -> dict:
    """Disaggregation's headline ratios, on the medians: at the first rate where colocated ITL
    p99 exceeds 3x its idle value, disaggregated decode tok/s over colocated and
    disaggregated ITL p99 over its own idle value; the TTFT penalty at the lowest
    non-zero rate."""
    if "colocated" not in results or "disaggregated" not in results:
        return {}
    rates = sorted(results["colocated"]["rates"], key=float)

    def m(mode, rate, key):
        return _median(results, mode, rate, key)
    idle_co, idle_dis = m("colocated", rates[0], "itl_ms_p99"), m("disaggregated", rates[0], "itl_ms_p99")
    out = {"idle_itl_p99_ms": {"colocated": idle_co, "disaggregated": idle_dis}}
    stall = next((r for r in rates[1:] if m("colocated", r, "itl_ms_p99") and idle_co
                  and m("colocated", r, "itl_ms_p99") > 3 * idle_co), None)
    out["stall_rate"] = stall
    if stall is not None:
        out["decode_speedup_at_stall_rate"] = _ratio(m("disaggregated", stall, "decode_tok_s_median"),
                                                     m("colocated", stall, "decode_tok_s_median"))
        out["disagg_itl_p99_over_idle_at_stall_rate"] = _ratio(m("disaggregated", stall, "itl_ms_p99"),
                                                               idle_dis)
    low = next((r for r in rates if float(r) > 0), None)
    if low is not None:
        c, d = m("colocated", low, "ttft_ms_p50"), m("disaggregated", low, "ttft_ms_p50")
        if c and d:
            out["ttft_penalty_ms"] = round(d - c, 2)
            out["ttft_penalty_over_colocated_ttft"] = _ratio(out["ttft_penalty_ms"], c)
    return out


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def table(report: dict) -> str:
    results = report["results"]
    rates = sorted(next(iter(results.values()))["rates"], key=float)
    lines = ["| long prompts/s | mode | output tok/s | decode tok/s per request | TTFT p50 ms | "
             "ITL p50 ms | ITL p99 ms |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rates:
        for mode, res in results.items():
            s = res["rates"][r]
            lines.append(f"| {r} | {mode} | {fmt(s['output_tok_s'])} | {fmt(s['decode_tok_s_median'])} | "
                         f"{fmt(s['ttft_ms_p50'], 0)} | {fmt(s['itl_ms_p50'])} | {fmt(s['itl_ms_p99'])} |")
    lines += ratios_table(report["ratios"], "long prompts/s")
    return "\n".join(lines)


def plot(results: dict, out: Path, report: dict) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    rates = sorted(next(iter(results.values()))["rates"], key=float)
    show = rates[len(rates) // 2] if len(rates) > 1 else rates[0]
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 3.2 * len(results)), sharex=True,
                             squeeze=False)
    for ax, (mode, r) in zip(axes[:, 0], results.items()):
        pts = r["timeline"].get(show, [])
        if pts:
            t, g = zip(*pts)
            ax.scatter(t, g, s=3)
        ax.set_yscale("log")
        ax.set_ylabel("ITL (ms)")
        ax.set_title(f"{mode}: inter-token latency over time, {show} long prompts/s (run 1)")
    axes[-1, 0].set_xlabel("seconds")
    paths.append(save_figure(fig, out.with_name(out.stem + "_itl_timeline.png"), report))
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.9))
    xs = [float(x) for x in rates]
    for mode, r in results.items():
        for ax, key, label in zip(axes, ("decode_tok_s_median", "output_tok_s", "itl_ms_p99"),
                                  ("decode tok/s per request (median)", "output tok/s (all streams)",
                                   "ITL p99 (ms)")):
            med, yerr = error_bars([r["rates"][x][key] for x in rates])
            ax.errorbar(xs, med, yerr=yerr, fmt="o-", capsize=3, label=mode)
            ax.set_xlabel("long prompts / s")
            ax.set_ylabel(label)
    axes[2].set_yscale("log")
    axes[0].legend()
    fig.suptitle(f"median of {report['repeats']} interleaved runs; bars: min–max", fontsize=9)
    paths.append(save_figure(fig, out.with_name(out.stem + "_sweep.png"), report))
    return paths
