"""``tandem bench genai-perf``: NVIDIA's genai-perf against one server, three ways — the
ensemble over gRPC as the TensorRT-LLM backend (``--service-kind triton --backend
tensorrtllm``), and the OpenAI API (``--service-kind openai``) with ``--endpoint-type
completions`` and ``chat`` — at a few concurrencies, streaming, with synthetic prompts
tokenized by the checkpoint's own tokenizer.

genai-perf 0.0.8 (the ``genai`` extra: ``pip install -e '.[genai]'``) drives the
perf_analyzer of the tritonclient 2.51 wheel (it must be on PATH, with the libraries
``scripts/install_perf_analyzer_deps.sh`` links: :func:`~tandem.client.bench.perf_analyzer.analyzer_env`).
Writes a JSON report, a Markdown table and a plot (``docs/bench/genai_perf.*``); genai-perf's
own files go in a temp dir, removed at the end unless ``--keep-work`` (the report then
names it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from tandem.client.bench.args import add_dtype, model_path, names, positive_int, positive_ints
from tandem.client.bench.harness import start_server, work_dir
from tandem.client.bench.report import header, save_figure, write
from tandem.client.paths import DEMO_CHECKPOINTS

DEFAULT_OUT = Path("docs/bench/genai_perf.json")
TARGETS = ("triton", "completions", "chat")
# what goes into the table, from genai-perf's profile_export_genai_perf.json
COLUMNS = (("request_throughput", "avg", "req/s"), ("output_token_throughput", "avg", "tok/s"),
           ("time_to_first_token", "avg", "TTFT avg"), ("time_to_first_token", "p99", "TTFT p99"),
           ("inter_token_latency", "avg", "ITL avg"), ("inter_token_latency", "p99", "ITL p99"),
           ("request_latency", "avg", "lat avg"), ("request_latency", "p99", "lat p99"),
           ("output_sequence_length", "avg", "out tok"), ("input_sequence_length", "avg", "in tok"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--targets", type=names(*TARGETS), default=",".join(TARGETS),
                   help="comma-separated: triton (the ensemble over gRPC), completions, chat (the OpenAI API)")
    p.add_argument("--concurrency", type=positive_ints, default="1,4")
    p.add_argument("--input-tokens", type=positive_int, default=64, help="synthetic prompt length (tokens)")
    p.add_argument("--output-tokens", type=positive_int, default=48, help="max_tokens of each request")
    p.add_argument("--measurement-interval", type=positive_int, default=8000,
                   help="ms per perf_analyzer window")
    p.add_argument("--spec", default="none", choices=["none", "mtp", "draft_target"])
    add_dtype(p)
    p.add_argument("--keep-work", action="store_true",
                   help="keep the temp dir of genai-perf's files and the server's log (removed otherwise)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def genai_perf_binary() -> Path:
    found = Path(sys.executable).parent / "genai-perf"
    if not found.exists():
        found = Path(shutil.which("genai-perf") or "")
    if not found.name:
        raise SystemExit("no genai-perf: install it with `pip install -e '.[genai]'` (genai-perf==0.0.8)")
    return found


def command(target: str, concurrency: int, args, grpc_url: str, openai_url: str, model: str,
            artifacts: Path) -> list[str]:
    """The genai-perf command line of one run."""
    cmd = [str(genai_perf_binary()), "profile", "-m", model, "--streaming", "--tokenizer", str(args.model),
           "--synthetic-input-tokens-mean", str(args.input_tokens), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(args.output_tokens), "--concurrency", str(concurrency),
           "--measurement-interval", str(args.measurement_interval), "--artifact-dir", str(artifacts)]
    if target == "triton":
        return cmd + ["--service-kind", "triton", "--backend", "tensorrtllm", "-u", grpc_url]
    return cmd + ["--service-kind", "openai", "--endpoint-type", target, "-u", openai_url]


def shown(cmd: list[str], work: Path) -> str:
    """The command as the report shows it: ``genai-perf``, paths in the checkout relative
    to it, genai-perf's files under ``$WORK``."""
    from tandem.client.paths import REPO_ROOT
    out = ["genai-perf"]
    for a in cmd[1:]:
        a = a.replace(str(work), "$WORK")
        if a.startswith(str(REPO_ROOT) + os.sep):
            a = os.path.relpath(a, REPO_ROOT)
        out.append(a)
    return " ".join(out)


def run_one(cmd: list[str], artifacts: Path) -> dict:
    from tandem.client.bench.perf_analyzer import analyzer_env
    env = analyzer_env()
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env["HF_HUB_OFFLINE"] = "1"        # the tokenizer is a local directory
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    (artifacts / "genai-perf.log").parent.mkdir(parents=True, exist_ok=True)
    (artifacts / "genai-perf.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"genai-perf failed ({proc.returncode}); its output: {artifacts / 'genai-perf.log'}\n"
                         + (proc.stdout + proc.stderr)[-3000:])
    return json.loads((artifacts / "profile_export_genai_perf.json").read_text())


def row(target: str, concurrency: int, metrics: dict) -> dict:
    out = {"target": target, "concurrency": concurrency}
    for metric, stat, _ in COLUMNS:
        out[f"{metric}_{stat}"] = round(metrics[metric][stat], 2)
    return out


def table(rows: list[dict]) -> str:
    """genai-perf's figures as one Markdown table (ms for times)."""
    names = ["target", "conc"] + [label for _, _, label in COLUMNS]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for r in rows:
        cells = [r["target"], str(r["concurrency"])] + [f"{r[f'{m}_{s}']:.1f}" for m, s, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, report: dict) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 3.8))
    for i, target in enumerate(dict.fromkeys(r["target"] for r in rows)):
        pts, color = [r for r in rows if r["target"] == target], f"C{i}"
        cs = [r["concurrency"] for r in pts]
        a1.plot(cs, [r["output_token_throughput_avg"] for r in pts], "o-", color=color, label=target)
        a2.plot(cs, [r["time_to_first_token_avg"] for r in pts], "o-", color=color, label=f"{target} avg")
        a2.plot(cs, [r["time_to_first_token_p99"] for r in pts], "s--", color=color, label=f"{target} p99")
        a3.plot(cs, [r["inter_token_latency_avg"] for r in pts], "o-", color=color, label=target)
    for ax, ylabel in ((a1, "output tokens / s"), (a2, "time to first token (ms)"),
                       (a3, "inter-token latency (ms)")):
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.legend(fontsize=7)
    a1.set_title("genai-perf: ensemble (triton) vs OpenAI API", fontsize=9)
    return save_figure(fig, out.with_suffix(".png"), report)


def versions() -> dict:
    from importlib.metadata import version

    from tandem.client.bench.perf_analyzer import check
    try:
        pa = check()
    except Exception as exc:   # reported, not fatal: genai-perf says the same when it runs
        pa = f"unavailable: {exc}"
    return {"genai_perf": version("genai-perf"), "perf_analyzer": pa, "tritonclient": version("tritonclient")}


def run(args: argparse.Namespace) -> int:
    from tandem.client.openai.frontend import OpenAIFrontend
    from tandem.client.serve.options import ServeOptions
    from tandem.client.serve.triton_server import free_port

    genai_perf_binary()
    options = ServeOptions.of(model_dir=str(args.model), dtype=args.dtype, spec_method=args.spec)
    rows, commands = [], []
    print("starting tritonserver and the OpenAI API", flush=True)
    with work_dir("tandem-bench-genai-perf-", keep=args.keep_work) as work, ExitStack() as stack:
        server = start_server(stack, options, work / "server", log_file=work / "server.log")
        api = stack.enter_context(OpenAIFrontend(server.grpc_url, ["tandem"], args.model, port=free_port()))
        openai_url = api.base_url.removeprefix("http://").removesuffix("/v1")
        for target in args.targets:
            for c in args.concurrency:
                artifacts = work / f"{target}-c{c}"
                cmd = command(target, c, args, server.grpc_url, openai_url, "tandem", artifacts)
                commands.append(shown(cmd, work))
                r = row(target, c, run_one(cmd, artifacts))
                rows.append(r)
                print(f"  {target:12s} c={c:<3d} req/s={r['request_throughput_avg']:6.2f}  "
                      f"tok/s={r['output_token_throughput_avg']:7.1f}  "
                      f"TTFT avg={r['time_to_first_token_avg']:7.1f} ms  "
                      f"ITL avg={r['inter_token_latency_avg']:6.1f} ms", flush=True)
    report = {**header("genai-perf", args), "versions": versions(), "genai_perf_commands": commands,
              "genai_perf_files (WORK)": str(work) if args.keep_work else None,
              "units": "ms for latencies", "results": rows}
    write(report, args.out)
    md = args.out.with_suffix(".md")
    md.write_text(f"# genai-perf ({report['date']})\n\n{report['machine']}\n\n`{report['command']}`\n\n"
                  f"{table(rows)}\n\ngenai-perf {report['versions']['genai_perf']}, "
                  f"{report['versions']['perf_analyzer']}; its commands:\n\n"
                  + "\n".join(f"    {c}" for c in commands) + "\n")
    print(table(rows))
    print(f"wrote {args.out}, {md}, {plot(rows, args.out, report)}")
    return 0
