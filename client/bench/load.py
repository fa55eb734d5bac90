"""``perf_analyzer --streaming`` at increasing concurrency against the colocated
ensemble, the disaggregated one (every prompt to the prefill process) and the
conditional one (``tandem serve``'s default: short prompts prefilled in decode's own
batch), each on its own server started here with the same settings and cores.

All servers start first; then every concurrency level is measured ``--repeats`` times,
the modes taking turns (A, B, C, A, B, C, ...), so that a noisy host's swings fall on
all modes alike. Reported per mode and level: the median over the repeats (and the
min–max spread) of requests/s, output tokens/s, per-request decode tokens/s, time to
the first response and inter-token latency (from perf_analyzer's profile export); and
per repeat, conditional over the better of the other two, whose median is the ratio
(JSON ``results`` and ``ratios``, a table, a plot with error bars)."""
from __future__ import annotations

import argparse
import json
import statistics
from contextlib import ExitStack
from pathlib import Path

from tandem.client.bench.args import add_dtype, model_path, names, non_negative_int, positive_int, positive_ints
from tandem.client.bench.harness import start_server, work_dir
from tandem.client.bench.repeats import (error_bars, fmt, interleaved, ratios_table, ratios_to_best,
                            summarize_runs)
from tandem.client.bench.report import header, save_figure, write
from tandem.client.bench.stats import percentile
from tandem.client.paths import DEMO_CHECKPOINTS

DEFAULT_OUT = Path("docs/bench/load.json")
# mode -> (tandem serve --mode, --disagg-policy, the ensemble called)
MODES = {"colocated": ("colocated", "conditional", "tandem_colocated"),
         "disaggregated": ("disaggregated", "remote", "tandem"),
         "conditional": ("disaggregated", "conditional", "tandem")}
KEYS = ["throughput_per_s", "output_tok_s", "decode_tok_s_median", "first_response_ms_p50",
        "first_response_ms_p99", "itl_ms_p50", "itl_ms_p99"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--concurrency", type=positive_ints, default="1,2,4,8,16")
    p.add_argument("--request-count", type=positive_int, default=48, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--spec", default="none", choices=["none", "mtp", "draft_target", "ngram"])
    p.add_argument("--threads", type=non_negative_int, default=0,
                   help="torch threads per engine (0: all cores colocated, half each disaggregated)")
    add_dtype(p)
    p.add_argument("--modes", type=names(*MODES), default=",".join(MODES),
                   help=f"comma-separated, of: {', '.join(MODES)}")
    p.add_argument("--repeats", type=positive_int, default=3, help="measurements per mode and level, interleaved")
    p.add_argument("--keep-work", action="store_true",
                   help="keep the temp dir of the servers' logs and perf_analyzer's files (removed otherwise)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def stream_stats(export_path: Path, concurrency: int) -> dict:
    """From perf_analyzer's profile export: output tokens/s over the measured span,
    per-request decode tokens/s (tokens after the first over the time they took) and
    the gaps between a stream's responses."""
    from tandem.client.bench.perf_analyzer import _measured_requests
    exps = json.loads(export_path.read_text())["experiments"]
    exp = next(e for e in exps if e["experiment"]["value"] == concurrency)
    reqs = _measured_requests(exp)
    tokens = [int((r.get("response_outputs") or [{}])[-1].get("num_output_tokens", 0)) for r in reqs]
    span_ns = max(r["response_timestamps"][-1] for r in reqs) - min(r["timestamp"] for r in reqs)
    speeds, gaps = [], []
    for r, n in zip(reqs, tokens):
        ts = r["response_timestamps"]
        gaps += [(b - a) / 1e6 for a, b in zip(ts, ts[1:])]
        if len(ts) > 1 and ts[-1] > ts[0]:
            speeds.append((n - 1) / ((ts[-1] - ts[0]) / 1e9))
    return {"output_tok_s": round(sum(tokens) / (span_ns / 1e9), 1),
            "decode_tok_s_median": round(statistics.median(speeds), 1) if speeds else None,
            "itl_ms_p50": _r(percentile(gaps, 50)), "itl_ms_p99": _r(percentile(gaps, 99))}


def _r(x):
    return None if x is None else round(x, 2)


def measure(server, mode: str, concurrency: int, rep: int, args, work: Path) -> dict:
    from tandem.client.bench.perf_analyzer import PerfOptions, profile
    perf = PerfOptions(url=server.grpc_url, model=MODES[mode][2], concurrency=(concurrency,),
                       max_tokens=args.max_tokens, request_count=args.request_count)
    attempts = 5
    for attempt in range(attempts):
        # on a loaded host perf_analyzer 2.51 now and then exits with its profile export
        # cut at a 64 KiB boundary: run again; after the last try the run counts as missing
        out_dir = work / f"perf-{mode}-c{concurrency}-r{rep}-{attempt}"
        try:
            p = profile(perf, out_dir)[0]
            d = {"throughput_per_s": p.throughput_per_s,
                 "first_response_ms_p50": round(p.first_response.p50_ms, 2),
                 "first_response_ms_p99": round(p.first_response.p99_ms, 2),
                 "latency_ms_p50": round(p.latency.p50_ms, 2),
                 **stream_stats(out_dir / f"c{concurrency}.profile.json", concurrency)}
            break
        except json.JSONDecodeError as e:
            print(f"  {mode} c={concurrency}: perf_analyzer's profile export is cut ({e})", flush=True)
            if attempt == attempts - 1:
                return {k: None for k in KEYS} | {"missing": str(e)}
    print(f"  {mode:14s} c={concurrency:<3d} run {rep + 1}  req/s={d['throughput_per_s']:6.2f}  "
          f"tok/s={d['output_tok_s']:7.1f}  decode tok/s={d['decode_tok_s_median']}  "
          f"first p50={d['first_response_ms_p50']:7.1f} ms  ITL p99={d['itl_ms_p99']} ms", flush=True)
    return d


def start_servers(stack: ExitStack, modes: list[str], args, work: Path) -> dict:
    from tandem.client.serve.options import ServeOptions
    servers = {}
    for mode in modes:
        serve_mode, policy, _ = MODES[mode]
        options = ServeOptions.of(model_dir=str(args.model), dtype=args.dtype, mode=serve_mode,
                               torch_threads=args.threads, spec_method=args.spec,
                               disagg_policy=policy)
        print(f"{mode}: starting tritonserver", flush=True)
        servers[mode] = start_server(stack, options, work / mode, attempts=2, log_file=work / f"{mode}.log")
    return servers


def table(report: dict) -> str:
    res, levels = report["results"], report["levels"]
    lines = ["| concurrency | mode | req/s | output tok/s | decode tok/s per request | "
             "first response p50 ms | ITL p99 ms |", "|---:|---|---:|---:|---:|---:|---:|"]
    for c in levels:
        for mode in res:
            s = res[mode][str(c)]
            lines.append(f"| {c} | {mode} | {fmt(s['throughput_per_s'], 2)} | {fmt(s['output_tok_s'])} | "
                         f"{fmt(s['decode_tok_s_median'])} | {fmt(s['first_response_ms_p50'])} | "
                         f"{fmt(s['itl_ms_p99'])} |")
    lines += ratios_table(report["ratios"], "concurrency")
    return "\n".join(lines)


def plot(report: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.9))
    levels = report["levels"]
    for mode, by_level in report["results"].items():
        for ax, key, label in zip(axes, ("output_tok_s", "decode_tok_s_median", "first_response_ms_p50"),
                                  ("output tokens / s", "decode tok/s per request (median)",
                                   "time to first response p50 (ms)")):
            med, yerr = error_bars([by_level[str(c)][key] for c in levels])
            ax.errorbar(levels, med, yerr=yerr, fmt="o-", capsize=3, label=mode)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(f"median of {report['repeats']} interleaved runs; bars: min–max", fontsize=9)
    return save_figure(fig, out.with_suffix(".png"), report)


def run(args: argparse.Namespace) -> int:
    modes, levels = list(args.modes), list(args.concurrency)
    with work_dir("tandem-bench-load-", keep=args.keep_work) as work:
        with ExitStack() as stack:   # the servers stop before the work dir goes
            servers = start_servers(stack, modes, args, work)
            runs = interleaved(levels, modes, args.repeats,
                               lambda mode, c, rep: measure(servers[mode], mode, c, rep, args, work))
    results = {m: {str(c): summarize_runs(runs[m][c], KEYS) for c in levels} for m in modes}
    report = {**header("load", args), "perf_analyzer_files": str(work) if args.keep_work else None,
              "levels": levels, "repeats": args.repeats, "results": results,
              "ratios": ratios_to_best(runs, levels)}
    write(report, args.out)
    print(table(report))
    print(f"wrote {args.out}, {plot(report, args.out)}")
    return 0
