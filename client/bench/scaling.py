"""One prefill server feeding 1, 2, 3 ... decode servers, through the real servers.

A prefill server (`tandem serve --mode prefill`, pinned to ``--prefill-cpus``) and N
decode servers (`--prefill-endpoints` pointing at it, pinned to ``--decode-cpus``) run
a closed loop: every decode server keeps ``--streams`` requests of ``--prompt-tokens``
prompt tokens and ``--max-tokens`` new tokens in flight. As N grows the decode side
gains capacity while the one prefill server does not: where throughput stops growing
and TTFT climbs, prefill is the bottleneck. From the measured per-token costs the
report also derives how many decode servers one prefill server can feed for a given
prompt/output length (the cluster-scale model in docs/BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from pathlib import Path

from tandem.client.bench.args import (add_dtype, CommaList, cpu_list, model_path, positive_float, positive_int,
                                      positive_ints)
from tandem.client.bench.harness import long_context_copy, prompt_texts, start_server, work_dir
from tandem.client.bench.report import header, save_figure, write
from tandem.client.paths import DEMO_CHECKPOINTS
from tandem.client.bench.grpc_load import closed_loop
from tandem.client.bench.request_client import TritonStream

DEFAULT_OUT = Path("docs/bench/scaling.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--decoders", type=positive_ints, default="1,2,3", help="decode servers per run")
    p.add_argument("--streams", type=positive_int, default=4, help="requests in flight per decode server")
    p.add_argument("--prompt-tokens", type=positive_int, default=1024)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--duration", type=positive_float, default=40.0, help="seconds measured per run")
    # defaults as lists: argparse would run a string default through cpu_list, which
    # refuses a CPU this process may not use (a container's cpuset) before any is asked for
    p.add_argument("--prefill-cpus", type=cpu_list, default=CommaList([0]),
                   help="CPUs the prefill server runs on, comma-separated ('' for any)")
    p.add_argument("--decode-cpus", type=cpu_list, default=CommaList([1]),
                   help="CPUs each decode server runs on, comma-separated ('' for any)")
    add_dtype(p)
    p.add_argument("--keep-work", action="store_true",
                   help="keep the temp dir of the servers' logs (removed otherwise)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def run_one(n: int, args, model_dir: Path, work: Path, prompts: list[str]) -> dict:
    from tandem.client.serve.options import ServeOptions
    common = dict(model_dir=str(model_dir), dtype=args.dtype, torch_threads=1, max_num_seqs=32,
                  max_num_batched_tokens=512)
    with ExitStack() as stack:   # stops the servers (last started first), also on Ctrl-C
        prefill = start_server(stack, ServeOptions.of(mode="prefill", **common), work / f"p{n}",
                               log_file=work / f"p{n}.log", cpus=tuple(args.prefill_cpus))
        decoders = [start_server(stack, ServeOptions.of(prefill_endpoints=prefill.grpc_url, disagg_policy="remote",
                                                     **common), work / f"d{n}-{i}", log_file=work / f"d{n}-{i}.log",
                                 cpus=tuple(args.decode_cpus)) for i in range(n)]
        clients = [TritonStream(s.grpc_url, "tandem") for s in decoders]
        try:
            closed_loop(clients, prompts, args.prompt_tokens, 1, 4, 3.0)   # warm-up
            stats = closed_loop(clients, prompts, args.prompt_tokens, args.streams,
                                args.max_tokens, args.duration)
        finally:
            for c in clients:
                c.close()
    stats["decoders"] = n
    print(f"  {n} decode server(s): " + "  ".join(f"{k}={v}" for k, v in stats.items()), flush=True)
    return stats


def cluster_model(runs: list[dict], prompt_tokens: int, max_tokens: int) -> dict:
    """Decode servers one prefill server can feed, from the measured capacities: the
    prefill side's tokens/s at its most loaded run, the decode side's output tokens/s
    per server at its least loaded run (one server, prefill not yet the limit)."""
    prefill_cap = max(r["prefill_tokens_per_s"] for r in runs)
    decode_cap = runs[0]["output_tokens_per_s"] / runs[0]["decoders"]
    req_prefill = prefill_cap / prompt_tokens
    req_decode = decode_cap / max_tokens if max_tokens else float("inf")
    return {"prefill_tokens_per_s_capacity": prefill_cap,
            "decode_output_tokens_per_s_per_server": round(decode_cap, 1),
            "requests_per_s_one_prefill_server": round(req_prefill, 3),
            "requests_per_s_one_decode_server": round(req_decode, 3),
            "decode_servers_per_prefill_server": round(req_prefill / req_decode, 2) if req_decode else None}


def plot(runs: list[dict], out: Path, report: dict) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = [r["decoders"] for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    a1.plot(ns, [r["requests_per_s"] for r in runs], "o-", label="requests/s")
    a1.set_xlabel("decode servers fed by one prefill server"); a1.set_ylabel("requests / s")
    a1b = a1.twinx()
    a1b.plot(ns, [r["output_tokens_per_s"] for r in runs], "s--", color="tab:orange")
    a1b.set_ylabel("output tokens / s (all servers)")
    a2.plot(ns, [r["ttft_ms_p50"] for r in runs], "o-", label="TTFT p50")
    a2.plot(ns, [r["ttft_ms_p90"] for r in runs], "o-", label="TTFT p90")
    a2.set_xlabel("decode servers"); a2.set_ylabel("ms"); a2.legend()
    for a in (a1, a2):
        a.set_xticks(ns)
    return save_figure(fig, out.with_suffix(".png"), report)


def run(args: argparse.Namespace) -> int:
    # run_one stops its servers (also when interrupted) before the work dir goes
    with work_dir("tandem-bench-scaling-", keep=args.keep_work) as work:
        model_dir = long_context_copy(args.model, work / "model",
                                      args.prompt_tokens + args.max_tokens + 64)
        prompts = prompt_texts(model_dir, [args.prompt_tokens] * 8)
        runs = [run_one(n, args, model_dir, work, prompts) for n in args.decoders]
    report = {**header("scaling", args), "runs": runs,
              "cluster_model": cluster_model(runs, args.prompt_tokens, args.max_tokens)}
    write(report, args.out)
    png = plot(runs, args.out, report)
    print(json.dumps(report["cluster_model"], indent=1))
    print(f"wrote {args.out}, {png}")
    return 0
