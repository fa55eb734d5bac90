"""``perf_analyzer --streaming`` at increasing concurrency against the disaggregated
ensemble and the colocated one, each on its own server started here with the same
settings and cores: requests/s, output tokens/s and time to the first response,
side by side in one run (JSON, a table and a plot)."""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from .bench_report import header, save_figure, write
from .paths import DEMO_CHECKPOINTS

DEFAULT_OUT = Path("docs/bench/load.json")
MODES = {"disaggregated": "tandem", "colocated": "tandem_colocated"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--request-count", type=int, default=48, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--spec", default="none", choices=["none", "mtp", "draft_target"])
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per engine (0: all cores colocated, half each disaggregated)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--modes", default="colocated,disaggregated")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def run_mode(mode: str, args, work: Path) -> list[dict]:
    from .perf_analyzer import PerfOptions, profile
    from .serve_options import ServeOptions
    from .triton_server import TritonServer
    options = ServeOptions(model_dir=str(args.model), dtype=args.dtype, mode=mode,
                           torch_threads=args.threads, spec_method=args.spec)
    with TritonServer(options, run_dir=work / mode, log_file=work / f"{mode}.log",
                      ready_timeout_s=600) as server:
        perf = PerfOptions(url=server.grpc_url, model=MODES[mode],
                           concurrency=tuple(int(c) for c in args.concurrency.split(",")),
                           max_tokens=args.max_tokens, request_count=args.request_count)
        points = profile(perf, work / f"perf-{mode}")
    out = []
    for p in points:
        d = dataclasses.asdict(p)
        d["output_tokens_per_s"] = round(p.throughput_per_s * p.output_tokens_per_request, 1)
        out.append(d)
        print(f"  {mode:14s} c={p.concurrency:<3d} req/s={p.throughput_per_s:6.2f}  "
              f"tok/s={d['output_tokens_per_s']:7.1f}  first p50={p.first_response.p50_ms:7.1f} ms  "
              f"p99={p.first_response.p99_ms:7.1f} ms  latency p50={p.latency.p50_ms:7.1f} ms",
              flush=True)
    return out


def plot(results: dict, out: Path, report: dict) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for mode, points in results.items():
        cs = [p["concurrency"] for p in points]
        a1.plot(cs, [p["output_tokens_per_s"] for p in points], "o-", label=mode)
        a2.plot(cs, [p["first_response"]["p50_ms"] for p in points], "o-", label=f"{mode} p50")
        a2.plot(cs, [p["first_response"]["p99_ms"] for p in points], "s--", label=f"{mode} p99")
    a1.set_xscale("log", base=2); a2.set_xscale("log", base=2); a2.set_yscale("log")
    a1.set_xlabel("concurrency"); a1.set_ylabel("output tokens / s")
    a2.set_xlabel("concurrency"); a2.set_ylabel("time to first response (ms)")
    a1.legend(); a2.legend(fontsize=8)
    return save_figure(fig, out.with_suffix(".png"), report)


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="tandem-bench-load-"))
    results = {}
    for mode in args.modes.split(","):
        print(f"{mode}: starting tritonserver", flush=True)
        results[mode] = run_mode(mode, args, work)
    report = {**header("load", args), "perf_analyzer_files": str(work), "results": results}
    write(report, args.out)
    print(f"wrote {args.out}, {plot(results, args.out, report)} (perf_analyzer's own files in {work})")
    return 0
