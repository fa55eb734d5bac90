"""Disaggregated against colocated serving on the same cores, through the real server.

For each mode a tritonserver is started (`tandem serve` as a library): colocated gives
the one engine every core; disaggregated gives prefill and decode a core each. A
streaming gRPC client keeps ``--background`` streams decoding and sends long prompts
(``--long-tokens``) on a Poisson schedule, one arrival rate after another; every
response is timestamped. Reported per mode and rate: per-request decode tokens/s,
TTFT of the long prompts, inter-token latency p50/p90/p99 (all streams), and the TTFT
penalty of disaggregation; plots: ITL over time for both modes at one rate, and the
sweep. The target's weights serve with a longer context (``max_position_embeddings``
raised: timing, not text quality, is measured here).
"""
from __future__ import annotations

import argparse
import json
import queue
import shutil
import time
from pathlib import Path

import numpy as np

from .bench_common import long_context_copy, prompt_texts
from .bench_report import header, save_figure, write
from .paths import DEMO_CHECKPOINTS
from .serving_workload import StreamLog, poisson_arrivals, summarize
from .streaming_client import StreamingClient

DEFAULT_OUT = Path("docs/bench/serving.json")
MODES = {"colocated": "tandem_colocated", "disaggregated": "tandem"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--rates", default="0,0.1,0.2,0.4", help="long-prompt arrivals per second")
    p.add_argument("--duration", type=float, default=40.0, help="seconds per rate")
    p.add_argument("--background", type=int, default=4, help="streams decoding all the time")
    p.add_argument("--background-tokens", type=int, default=96)
    p.add_argument("--long-tokens", default="1024,2048", help="long prompt length range (tokens)")
    p.add_argument("--long-max-tokens", type=int, default=32)
    p.add_argument("--cores", type=int, default=2, help="cores of the machine to use")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--modes", default="colocated,disaggregated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


# -- the workload ----------------------------------------------------------------------
def run_rate(client: StreamingClient, rate: float, duration: float, background: list[str],
             background_tokens: int, longs: list[tuple[str, int]], long_max_tokens: int,
             seed: int) -> tuple[list[StreamLog], tuple[float, float]]:
    """Keep the background streams going and send long prompts at ``rate`` for
    ``duration`` seconds; returns the logs of this rate and its measurement window."""
    first = set(client.logs)
    start = time.monotonic()
    live = {client.send("background", p, 0, background_tokens) for p in background}
    arrivals = poisson_arrivals(rate, duration, seed)
    i = 0
    while time.monotonic() - start < duration:
        due = start + arrivals[i] if i < len(arrivals) else start + duration
        timeout = max(0.0, min(due, start + duration) - time.monotonic())
        try:
            log = client.finished.get(timeout=timeout)
            if log.kind == "background" and log.request_id in live:
                live.discard(log.request_id)
                live.add(client.send("background", background[len(live) % len(background)], 0,
                                     background_tokens))
        except queue.Empty:
            pass
        while i < len(arrivals) and time.monotonic() >= start + arrivals[i]:
            text, n = longs[i % len(longs)]
            client.send("long", text, n, long_max_tokens)
            i += 1
    end = time.monotonic()
    deadline = end + 60
    while any(log.done_at is None for rid, log in client.logs.items() if rid not in first) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    logs = [log for rid, log in client.logs.items() if rid not in first]
    return logs, (start + min(5.0, duration / 4), end)


# -- one mode -----------------------------------------------------------------------------
def run_mode(mode: str, args, model_dir: Path, run_dir: Path) -> dict:
    from .serve_options import ServeOptions
    from .triton_server import TritonServer
    cores = args.cores
    options = ServeOptions(model_dir=str(model_dir), dtype=args.dtype, mode=mode,
                           torch_threads=cores if mode == "colocated" else max(1, cores // 2),
                           max_num_seqs=32, max_num_batched_tokens=512)
    lo, hi = (int(x) for x in args.long_tokens.split(","))
    rng = np.random.default_rng(args.seed)
    lengths = [int(x) for x in rng.integers(lo, hi + 1, size=16)]
    longs = list(zip(prompt_texts(model_dir, lengths), lengths))
    background = prompt_texts(model_dir, [48, 64, 80, 96])
    rates = [float(x) for x in args.rates.split(",")]
    result = {"mode": mode, "model": MODES[mode], "torch_threads": options.torch_threads,
              "rates": {}, "timeline": {}}
    with TritonServer(options, run_dir=run_dir / mode, log_file=run_dir / f"{mode}.log",
                      ready_timeout_s=600) as server:
        client = StreamingClient(server.grpc_url, MODES[mode])
        try:
            # warm-up: one long prompt and the background streams, not measured
            run_rate(client, 0.0, 5.0, background, 16, longs, 4, args.seed)
            for j, rate in enumerate(rates):
                errors_before = len(client.errors)
                logs, window = run_rate(client, rate, args.duration, background,
                                        args.background_tokens, longs, args.long_max_tokens,
                                        args.seed + j)
                stats = summarize(logs, window)
                stats["errors"] += len(client.errors) - errors_before
                result["rates"][str(rate)] = stats
                t0 = window[0]
                result["timeline"][str(rate)] = [
                    (round(t - t0, 4), round(g * 1000, 3)) for log in logs
                    for t, g in log.gaps() if window[0] <= t <= window[1]]
                print(f"  {mode:14s} rate {rate:4.2f}/s  " + "  ".join(
                    f"{k}={v}" for k, v in stats.items()), flush=True)
        finally:
            client.close()
    return result


# -- report -------------------------------------------------------------------------------
def compare(results: dict) -> dict:
    """The issue's ratios: at the first rate where colocated ITL p99 exceeds 3x its idle
    value, disaggregated decode tok/s over colocated and disaggregated ITL p99 over its
    own idle value; the TTFT penalty at the lowest non-zero rate."""
    co, dis = results.get("colocated"), results.get("disaggregated")
    if not co or not dis:
        return {}
    rates = sorted(co["rates"], key=float)
    idle_co, idle_dis = co["rates"][rates[0]]["itl_ms_p99"], dis["rates"][rates[0]]["itl_ms_p99"]
    out = {"idle_itl_p99_ms": {"colocated": idle_co, "disaggregated": idle_dis}}
    stall = next((r for r in rates[1:] if co["rates"][r]["itl_ms_p99"] and idle_co
                  and co["rates"][r]["itl_ms_p99"] > 3 * idle_co), None)
    out["stall_rate"] = stall
    if stall is not None:
        c, d = co["rates"][stall], dis["rates"][stall]
        out["decode_speedup_at_stall_rate"] = _ratio(d["decode_tok_s_median"], c["decode_tok_s_median"])
        out["disagg_itl_p99_over_idle_at_stall_rate"] = _ratio(d["itl_ms_p99"], idle_dis)
    low = next((r for r in rates if float(r) > 0), None)
    if low is not None:
        c, d = co["rates"][low], dis["rates"][low]
        if c["ttft_ms_p50"] and d["ttft_ms_p50"]:
            out["ttft_penalty_ms"] = round(d["ttft_ms_p50"] - c["ttft_ms_p50"], 2)
            out["ttft_penalty_over_colocated_ttft"] = _ratio(out["ttft_penalty_ms"], c["ttft_ms_p50"])
    return out


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


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
        ax.set_title(f"{mode}: inter-token latency over time, {show} long prompts/s")
    axes[-1, 0].set_xlabel("seconds")
    paths.append(save_figure(fig, out.with_name(out.stem + "_itl_timeline.png"), report))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for mode, r in results.items():
        xs = [float(x) for x in rates]
        a1.plot(xs, [r["rates"][x]["decode_tok_s_median"] for x in rates], "o-", label=mode)
        a2.plot(xs, [r["rates"][x]["itl_ms_p99"] for x in rates], "o-", label=mode)
    a1.set_xlabel("long prompts / s"); a1.set_ylabel("decode tok/s per request (median)")
    a2.set_xlabel("long prompts / s"); a2.set_ylabel("ITL p99 (ms)"); a2.set_yscale("log")
    a1.legend(); a2.legend()
    paths.append(save_figure(fig, out.with_name(out.stem + "_sweep.png"), report))
    return paths


def run(args: argparse.Namespace) -> int:
    import tempfile
    lo, hi = (int(x) for x in args.long_tokens.split(","))
    work = Path(tempfile.mkdtemp(prefix="tandem-bench-serving-"))
    try:
        model_dir = long_context_copy(args.model, work / "model", hi + 2 * args.long_max_tokens + 64)
        results = {}
        for mode in args.modes.split(","):
            print(f"{mode}: starting tritonserver", flush=True)
            results[mode] = run_mode(mode, args, model_dir, work)
        report = {
            **header("serving", args),
            "workload": {"background_streams": args.background, "long_tokens": [lo, hi],
                         "long_max_tokens": args.long_max_tokens, "duration_s": args.duration},
            "results": results, "comparison": compare(results),
        }
        write(report, args.out)
        paths = plot(results, args.out, report)
        print(json.dumps(report["comparison"], indent=1))
        print(f"wrote {args.out}, " + ", ".join(str(p) for p in paths))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0
