"""Speculative decoding through the server: per-request decode tokens/s of the
disaggregated ``tandem`` ensemble with no speculation, draft-target, MTP and ngram at
k = 1..5 (pinned: ``--spec-adaptive off``) and ``--spec auto`` (adaptive k up to k, as
``make serve`` runs it), at concurrency 1 and 8 (closed loop), with the acceptance the
decode model reports on Triton's metrics port. One server per setting, the same cores
for all."""
from __future__ import annotations

import argparse
import json
import re
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from tandem.backends.speculative.config import AUTO, METHODS as SPEC_METHODS, NO_SPECULATION

from tandem.client.bench.args import (add_dtype, ArgumentTypeError, model_path, names, non_negative_int,
                                      positive_float, positive_int, positive_ints)
from tandem.client.bench.harness import start_server, work_dir
from tandem.client.bench.repeats import error_bars, spread
from tandem.client.bench.report import header, save_figure, write
from tandem.client.paths import DEMO_CHECKPOINTS
from tandem.client.bench.grpc_load import closed_loop
from tandem.client.bench.request_client import TritonStream

DEFAULT_OUT = Path("docs/bench/spec_serving.json")
PROMPTS = ["def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n        ",
           "import os\n\n\ndef walk(path):\n    ", "    def __repr__(self):\n        return ",
           "def parse_args(argv=None):\n    parser = argparse.", "with open(path) as f:\n    for line in f:\n"]
METHODS = (NO_SPECULATION, *SPEC_METHODS, AUTO)   # tandem serve --spec's


def methods(text: str):
    """``--methods``' type: names of :data:`METHODS`, ``none`` among them (the speedups
    are over it)."""
    chosen = names(*METHODS)(text)
    if "none" not in chosen:
        raise ArgumentTypeError(f"must include none (the baseline the speedups are over), got {text!r}")
    return chosen


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--methods", type=methods, default=",".join(METHODS),
                   help=f"comma-separated, of: {', '.join(METHODS)} (none included)")
    p.add_argument("--ks", type=positive_ints, default="1,2,3,4,5")
    p.add_argument("--concurrency", type=positive_ints, default="1,8")
    p.add_argument("--max-tokens", type=positive_int, default=96)
    p.add_argument("--duration", type=positive_float, default=15.0, help="seconds per concurrency level")
    p.add_argument("--threads", type=non_negative_int, default=0,
                   help="torch threads per engine (0: half the cores)")
    add_dtype(p)
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="runs of every setting, interleaved (one server per setting and run)")
    p.add_argument("--keep-work", action="store_true",
                   help="keep the temp dir of the servers' logs (removed otherwise)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def _scrape(url: str, name: str, model: str = "decode") -> float | None:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    m = re.search(rf'^{name}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def run_setting(method: str, k: int, args, work: Path, rep: int = 0) -> dict:
    from tandem.client.serve.options import ServeOptions
    # a fixed method at its k; auto as make serve runs it (adaptive k up to k)
    options = ServeOptions.of(model_dir=str(args.model), dtype=args.dtype, torch_threads=args.threads,
                              spec_method=method, num_speculative_tokens=k,
                              spec_adaptive="on" if method == AUTO else "off")
    row = {"method": method, "k": k if method != "none" else 0}
    name = f"{method}-{k}-{rep}"
    with ExitStack() as stack:   # stops the server, also when its start is interrupted
        server = start_server(stack, options, work / name, log_file=work / f"{name}.log")
        client = TritonStream(server.grpc_url, "tandem")
        try:
            closed_loop([client], PROMPTS, 8, 1, 8, 3.0)    # warm-up
            for c in args.concurrency:
                s = closed_loop([client], PROMPTS, 8, c, args.max_tokens, args.duration)
                row[f"c{c}"] = {"decode_tok_s_median": s["decode_tok_s_median"],
                                "output_tokens_per_s": s["output_tokens_per_s"],
                                "ttft_ms_p50": s["ttft_ms_p50"], "requests": s["requests"],
                                "errors": s["errors"]}
        finally:
            client.close()
        if method != "none":
            import time
            time.sleep(0.6)   # one poll of the metrics thread
            row["mean_acceptance_length"] = _scrape(server.metrics_url, "tandem_spec_mean_acceptance_length")
            row["acceptance_rate"] = _scrape(server.metrics_url, "tandem_spec_acceptance_rate")
    print("  " + "  ".join(f"{k_}={v}" for k_, v in row.items()), flush=True)
    return row


def aggregate(runs: list[dict], concurrency: list[int]) -> dict:
    """One setting's runs: the median and spread of each figure."""
    row = {"method": runs[0]["method"], "k": runs[0]["k"]}
    for c in concurrency:
        key = f"c{c}"
        row[key] = {name: spread([r[key][name] for r in runs])
                    for name in ("decode_tok_s_median", "output_tokens_per_s", "ttft_ms_p50")}
        row[key]["errors"] = sum(r[key]["errors"] for r in runs)
    if runs[0]["method"] != "none":
        for name in ("mean_acceptance_length", "acceptance_rate"):
            row[name] = spread([r.get(name) for r in runs])
    return row


def speedups(runs: dict[tuple, list[dict]], concurrency: list[int]) -> dict:
    """Per concurrency: the best setting (highest median) over no speculation, the ratio
    taken run by run (the settings of one repeat ran one after another)."""
    base = next(v for (m, _), v in runs.items() if m == "none")
    out = {}
    for c in concurrency:
        key = f"c{c}"
        med = {s: spread([r[key]["decode_tok_s_median"] for r in v])["median"] or 0
               for s, v in runs.items() if s[0] != "none"}
        if not med:
            continue
        best = max(med, key=med.get)
        ratios = [r[key]["decode_tok_s_median"] / b[key]["decode_tok_s_median"]
                  for r, b in zip(runs[best], base)
                  if r[key]["decode_tok_s_median"] and b[key]["decode_tok_s_median"]]
        out[key] = {"plain_tok_s": spread([b[key]["decode_tok_s_median"] for b in base])["median"],
                    "best": f"{best[0]} k={best[1]}", "best_tok_s": med[best],
                    "speedup": spread(ratios)}
    return out


def plot(rows: list[dict], concurrency: list[int], out: Path, report: dict) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(concurrency), figsize=(5.5 * len(concurrency), 3.8), squeeze=False)
    for ax, c in zip(axes[0], concurrency):
        key = f"c{c}"
        base = next(r for r in rows if r["method"] == "none")[key]["decode_tok_s_median"]["median"]
        for method in sorted({r["method"] for r in rows} - {"none"}):
            rs = [r for r in rows if r["method"] == method]
            med, err = error_bars([r[key]["decode_tok_s_median"] for r in rs])
            ax.errorbar([r["k"] for r in rs], med, yerr=err, fmt="o-", capsize=2, label=method)
        ax.axhline(base, color="gray", ls="--", label="no speculation")
        ax.set_xlabel("k (draft tokens per step)"); ax.set_ylabel("decode tok/s per request (median)")
        ax.set_title(f"concurrency {c}"); ax.legend()
    return save_figure(fig, out.with_suffix(".png"), report)


def run(args: argparse.Namespace) -> int:
    ks, concurrency = list(args.ks), list(args.concurrency)
    settings = [(method, k if method != "none" else 0) for method in args.methods
                for k in ([1] if method == "none" else ks)]
    runs: dict[tuple, list[dict]] = {s: [] for s in settings}
    with work_dir("tandem-bench-spec-serving-", keep=args.keep_work) as work:
        for rep in range(args.repeats):       # interleaved: every setting once per repeat
            for method, k in settings:
                runs[(method, k)].append(run_setting(method, max(k, 1), args, work, rep))
    rows = [aggregate(v, concurrency) for v in runs.values()]
    report = {**header("spec-serving", args), "rows": rows, "speedups": speedups(runs, concurrency)}
    write(report, args.out)
    print(json.dumps(report["speedups"], indent=1))
    print(f"wrote {args.out}, {plot(rows, concurrency, args.out, report)}")
    return 0
