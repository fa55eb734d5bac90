"""``tandem bench lora``: a batch mixing LoRA adapters and the base model against the
base model alone, through the OpenAI API, on Tandem and on vLLM's CPU build; and an
adapter loaded at run time under load.

``--adapters`` random PEFT adapters of ``--model`` (rank ``--rank`` on ``--targets``,
made with PEFT in the run's temp dir), served from the start by both: ``tandem serve
--max-loras N --max-lora-rank R --lora-modules a0=DIR,...`` and vLLM with ``--enable-lora``
and the same options. Two phases at ``--concurrency`` (closed loop, greedy streams of
exactly ``--max-tokens`` tokens, unique prompts cut from the standard library's source):
``base`` (every request to the base model) and ``mix`` (each request's ``model`` cycles
through the adapters and the base, :func:`.lora_workload.model_cycle`). Each repeat
measures both phases on each server in turn (the order alternating), so the mix/base
ratio is taken per repeat from measurements side by side, then its median.

Then ``--load-trials`` pairs on each server, under streams of all adapters but one and the
base at ``--concurrency``: ``--late-requests`` requests to an adapter already in a slot (the
control), then a new adapter loaded with ``POST /v1/load_lora_adapter`` and the same
requests sent to it. Every request's failure is counted, and the running streams' worst
inter-token gap from the load (or the control's send) until those requests have their
first token is set against their median gap (one step) and the control's worst gap: the
requests' own prefill stalls the streams whatever their adapter (:func:`.lora_workload.stall`,
:func:`added_steps`).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from tandem.client.bench.args import model_path, names, non_negative_float, non_negative_int, positive_int
from tandem.client.bench.harness import work_dir
from tandem.client.bench.lora_workload import (PHASES, adapter_names, counters, grown, mix_over_base, phase_models,
                                               phase_order, ratios, stall)
from tandem.client.bench.openai_load import closed_loop, summarize
from tandem.client.bench.peer_servers import SETTLE_S
from tandem.client.bench.peers_workload import Prompts, dtype, exact_request
from tandem.client.bench.repeats import error_bars, fmt, spread
from tandem.client.bench.report import cpu_info, git_state, header, render as render_report, save_figure, write
from tandem.client.bench.request_client import openai_completion
from tandem.client.bench.stats import ms, percentile

DEFAULT_OUT = Path("docs/bench/lora.json")
DEFAULT_MODEL = "smollm2-135m-instruct"
# tandem-eager: the same server with --enforce-eager. Tandem's compiled decode step holds the base
# model only (a step with an adapter's row runs eager), so base against mix on it is eager against eager
SERVERS = ("tandem", "vllm", "tandem-eager")
DEFAULT_SERVERS = "tandem,vllm"
ATTENTION, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
TARGETS = {"all": ATTENTION + MLP, "attention": ATTENTION, "mlp": MLP}
KEYS = ("output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "ttft_base_ms_p50",
        "ttft_lora_ms_p50")
LATE = "late"          # the adapter loaded at run time (its trials serve it as late0, late1, ...)
MIX_BOUND = 0.8        # the goal: mix throughput >= 0.8x the base alone
# "slows for no more than one step": the running streams' worst gap while requests to a newly
# loaded adapter start at most one median step longer than while the same requests go to an
# adapter already in a slot (their prefill stalls the streams anyway)
STALL_BOUND = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="an HF directory, a .gguf file, smollm2-135m-instruct (default) or demo")
    p.add_argument("--dtype", type=dtype, default="auto",
                   help="auto (default): bfloat16 where the CPU has avx512_bf16 or amx_bf16, else float32")
    p.add_argument("--servers", type=names(*SERVERS), default=DEFAULT_SERVERS,
                   help="of tandem, vllm (default both) and tandem-eager (tandem serve --enforce-eager)")
    p.add_argument("--adapters", type=positive_int, default=4, help="adapters in the mix (and --max-loras)")
    p.add_argument("--rank", type=positive_int, default=16, help="the adapters' rank (and --max-lora-rank)")
    p.add_argument("--targets", default="all", choices=list(TARGETS),
                   help="the adapters' target modules: all seven (default), attention (q/k/v/o), mlp")
    p.add_argument("--concurrency", type=positive_int, default=16)
    p.add_argument("--requests", type=positive_int, default=32, help="requests per phase")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per stream (min_tokens too)")
    p.add_argument("--prompt-tokens", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--load-trials", type=non_negative_int, default=3,
                   help="run-time loads under load per server (0: none)")
    p.add_argument("--late-requests", type=positive_int, default=2, help="requests to each loaded adapter")
    p.add_argument("--load-after", type=non_negative_float, default=3.0,
                   help="seconds the streams run before the adapter is loaded")
    p.add_argument("--tandem-mode", default="disaggregated", choices=["disaggregated", "colocated"])
    p.add_argument("--tandem-code", default="head", choices=["head", "worktree"],
                   help="head (default): Tandem runs the last commit (a git archive), unmoved by edits during "
                        "the run; worktree: the checkout as it is")
    p.add_argument("--vllm-kv-gib", type=positive_int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--keep-work", action="store_true", help="keep the servers' logs and adapters (a temp dir)")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: print the table and redraw the plot of the report at --out")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def make_adapters(model_dir: Path, out: Path, names_: list[str], rank: int, targets: tuple[str, ...],
                  std: float = 0.02) -> dict[str, Path]:
    """One PEFT adapter per name under ``out``, A and B random (PEFT starts B at zero,
    which would make every adapter the base model), each seeded by its index."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    dirs = {}
    for i, name in enumerate(names_):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(i)
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                lora_dropout=0.0))
        with torch.no_grad():
            for pname, param in peft.named_parameters():
                if "lora_" in pname:
                    param.normal_(0, std)
        peft.save_pretrained(out / name)
        dirs[name] = out / name
    return dirs


def base_name(server: str, args) -> str:
    """The base model's name in a request: vLLM serves it as "tandem"; Tandem serves its
    mode's text ensemble."""
    from tandem.client.serve.options import TEXT_ENSEMBLE
    return "tandem" if server == "vllm" else TEXT_ENSEMBLE[args.tandem_mode]


def launches(servers: list[str], args, work: Path, dirs: dict[str, Path], vllm_python, tandem_path) -> dict:
    from tandem.client.bench import peer_servers as ps
    from tandem.client.serve.triton_server import free_port
    modules = [f"{n}={d}" for n, d in dirs.items()]
    out = {}
    for server in servers:
        port = free_port()
        if server == "vllm":
            cmd = ps.vllm_command(vllm_python, args._model_dir, port, args.dtype, "none", 1, None) + [
                "--enable-lora", "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank),
                "--lora-modules", *modules]
            env = {**ps.vllm_env(args.vllm_kv_gib), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        else:
            run_dir = work / server
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = ps.tandem_command(args._model_dir, port, args.dtype, "none", 1, args.tandem_mode, run_dir) + [
                "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank),
                "--lora-modules", ",".join(modules)] + (["--enforce-eager"] if server == "tandem-eager" else [])
            env = ps.tandem_env(tandem_path)
        out[server] = (server, cmd, env, port)
    return out


def start(stack: ExitStack, launches_: dict, work: Path) -> tuple[dict, dict]:
    """Every server started at once, each awaited on its own: those up, and for those
    that did not start, why (vLLM's refusal of LoRA is a result, not the end of the run)."""
    from tandem.client.bench import peer_servers as ps
    up, failed = {}, {}
    for key, (name, cmd, env, port) in launches_.items():
        srv = ps.OpenAIServer(name, cmd, env, port, work / f"{name}.log")
        stack.callback(srv.stop)
        up[key] = srv.start()
    pending, deadline = dict(up), time.monotonic() + ps.READY_TIMEOUT_S
    while pending:
        for key, srv in list(pending.items()):
            try:
                if not srv.poll_ready():
                    if time.monotonic() < deadline:
                        continue
                    raise ps.PeerError(f"{srv.name} not ready after {ps.READY_TIMEOUT_S} s:\n{srv.log_tail()}")
                print(f"  {srv.name} ready in {srv.ready_s:.0f} s (port {srv.port})", flush=True)
            except ps.PeerError as exc:
                print(f"  {srv.name} did not start: {str(exc)[-1500:]}", flush=True)
                failed[key] = str(exc)[-3000:]
                srv.stop()
                del up[key]
            del pending[key]
        time.sleep(1.0)
    return up, failed


def request(server: str, model: str, base: str, prompt: str, max_tokens: int):
    return exact_request(model, prompt, max_tokens, server == "vllm", "base" if model == base else "lora")


def warm_up(srv, server: str, args, adapters: list[str], text: str) -> list[str]:
    """A short stream to the base and to each adapter (first-call costs, the adapters into
    their slots); the errors."""
    base = base_name(server, args)
    reqs = [request(server, m, base, text, 4) for m in [base, *adapters]]
    results, _ = asyncio.run(closed_loop("127.0.0.1", srv.port, reqs, len(reqs)))
    return [f"{m}: {r.error}" for m, r in zip([base, *adapters], results) if r.error]


def phase_stats(results, wall: float) -> dict:
    ok = [r.ttft_s for r in results if r.error is None and r.ttft_s is not None]
    return {**summarize(results, wall), "ttft_ms_p50": ms(percentile(ok, 50)), "ttft_ms_p99": ms(percentile(ok, 99))}


def measure(srv, server: str, phase: str, texts: list[str], args, adapters: list[str]) -> dict:
    time.sleep(SETTLE_S)
    base = base_name(server, args)
    reqs = [request(server, m, base, t, args.max_tokens)
            for m, t in zip(phase_models(phase, adapters, base, len(texts)), texts)]
    load = os.getloadavg()[0]
    results, wall = asyncio.run(closed_loop("127.0.0.1", srv.port, reqs, args.concurrency))
    out = {**phase_stats(results, wall), "wall_s": round(wall, 2), "load_avg": round(load, 2)}
    print(f"  {server:7s} {phase:5s} {out['output_tok_s']:7.1f} tok/s  TTFT p50 {out['ttft_ms_p50']} ms  "
          f"ITL p50 {out['itl_ms_p50']} p99 {out['itl_ms_p99']} ms  errors {out['errors']}  load {load:.2f}"
          + (f"  first error: {out['first_error']}" if out.get("first_error") else ""), flush=True)
    return out


def post_json(port: int, path: str, body: dict, timeout_s: float = 120.0) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode(errors="replace")[:300]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300]
    except OSError as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def scrape_lora(srv) -> dict | None:
    """Tandem's adapter loads and evictions per engine model (None: vLLM, or no answer)."""
    if "--metrics-port" not in srv.cmd:
        return None
    port = srv.cmd[srv.cmd.index("--metrics-port") + 1]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {k: counters(text, f"tandem_lora_{k}_total") for k in ("loads", "evictions")}


async def late_under_load(port: int, server: str, base: str, running: list[str], late: str, late_dir: Path | None,
                          texts: list[str], late_texts: list[str], args) -> dict:
    """Streams of ``running`` (the models in turn) at ``--concurrency``, kept up until
    ``late_texts`` sent to the adapter ``late`` have ended: loaded first with ``POST
    /v1/load_lora_adapter`` from ``late_dir``, or (None) one already in a slot, the control."""
    stop, results, ids = asyncio.Event(), [], itertools.count()

    async def stream():
        while not stop.is_set():
            i = next(ids)
            m = running[i % len(running)]
            results.append(await openai_completion("127.0.0.1", port,
                                                   request(server, m, base, texts[i % len(texts)], args.max_tokens)))

    workers = [asyncio.create_task(stream()) for _ in range(args.concurrency)]
    await asyncio.sleep(args.load_after)
    t_load = time.perf_counter()
    status, said = 0, ""
    if late_dir is not None:
        status, said = await asyncio.to_thread(post_json, port, "/v1/load_lora_adapter",
                                               {"lora_name": late, "lora_path": str(late_dir)})
    load_s = time.perf_counter() - t_load
    late_out = await asyncio.gather(*(openai_completion("127.0.0.1", port,
                                                        request(server, late, base, t, args.max_tokens))
                                      for t in late_texts))
    firsts = [r.start + r.ttft_s for r in late_out if r.ttft_s is not None]
    t_first = max(firsts) if firsts else time.perf_counter()
    stop.set()
    await asyncio.gather(*workers)
    # the streams that ran across the load: each chunk's absolute time
    timelines = [[r.start + s for s in r.chunk_s] for r in results if r.chunk_s]
    errors = [r.error for r in results + list(late_out) if r.error]
    out = {"running_requests": len(results), "late_requests": len(late_out),
           "failed": len(errors), "first_error": errors[0][:300] if errors else None,
           "late_ttft_ms": [ms(r.ttft_s) for r in late_out], **stall(timelines, t_load, t_first)}
    if late_dir is not None:
        out |= {"load_status": status, "load_said": said.strip(), "load_http_ms": ms(load_s)}
    return out


def load_trial(srv, server: str, trial: int, dirs: dict, adapters: list[str], texts, late_texts, args) -> dict:
    """A pair under the same streams: requests to an adapter already in a slot (the
    control: their prefill stalls the streams too), then a new adapter loaded and the same
    requests sent to it. Every adapter but one keeps a slot busy; the new one evicts the
    idle one, which was the control's, and is the next pair's control."""
    base, late = base_name(server, args), f"{LATE}{trial}"
    running = [*adapters[:max(0, len(adapters) - 1)], base]
    resident = adapters[-1] if trial == 0 else f"{LATE}{trial - 1}"
    time.sleep(SETTLE_S)
    control = asyncio.run(late_under_load(srv.port, server, base, running, resident, None, texts, late_texts, args))
    time.sleep(SETTLE_S)
    before, load = scrape_lora(srv), os.getloadavg()[0]
    out = asyncio.run(late_under_load(srv.port, server, base, running, late, dirs[LATE], texts, late_texts, args))
    after = scrape_lora(srv)
    if before is not None and after is not None:
        out["engine_loads"] = grown(before["loads"], after["loads"])
        out["engine_evictions"] = grown(before["evictions"], after["evictions"])
    out |= {"adapter": late, "running_models": running, "load_avg": round(load, 2), "resident": resident,
            "resident_trial": control, "added_steps": added_steps(out, control)}
    print(f"  {server:7s} {resident} (in a slot): failed {control['failed']}, worst gap {control['worst_gap_ms']} ms "
          f"= {control['worst_gap_steps']} steps of {control['median_itl_ms']} ms", flush=True)
    print(f"  {server:7s} load {late}: HTTP {out['load_status']} in {out['load_http_ms']} ms, failed "
          f"{out['failed']}/{out['running_requests'] + out['late_requests']}, worst gap {out['worst_gap_ms']} ms "
          f"= {out['worst_gap_steps']} steps of {out['median_itl_ms']} ms; {out['added_steps']} steps over the "
          f"control{'  engine loads ' + str(out.get('engine_loads')) if 'engine_loads' in out else ''}"
          + (f"  first error: {out['first_error']}" if out["first_error"] else ""), flush=True)
    return out


def added_steps(load: dict, control: dict) -> float | None:
    """How many median steps (the load trial's) longer the running streams' worst gap
    was when the requests' adapter had to be loaded than when it was in a slot.

    >>> added_steps({"worst_gap_ms": 300.0, "median_itl_ms": 100.0}, {"worst_gap_ms": 150.0})
    1.5
    """
    if None in (load.get("worst_gap_ms"), control.get("worst_gap_ms")) or not load.get("median_itl_ms"):
        return None
    return round((load["worst_gap_ms"] - control["worst_gap_ms"]) / load["median_itl_ms"], 2)


def vllm_lora_status(report: dict) -> tuple[bool, str]:
    """Whether vLLM's LoRA ran on this CPU, and a line saying so (if not, what it said)."""
    if "vllm" not in report["servers"]:
        return False, "vLLM-CPU: not measured"
    if "vllm" in report["failed_to_start"]:
        said = report["failed_to_start"]["vllm"][-400:]
        return False, f"vLLM-CPU: LoRA does not run on CPU (it did not start: {said})"
    mix = report["runs"].get("vllm", {}).get("mix", [])
    if report["warm_up_errors"].get("vllm") or not mix or all(r["errors"] == r["requests"] for r in mix):
        said = (report["warm_up_errors"].get("vllm") or [r.get("first_error") for r in mix] or ["?"])[0]
        return False, f"vLLM-CPU: LoRA does not run on CPU ({said})"
    return True, (f"vLLM-CPU {report['versions']['vllm']}: LoRA runs on CPU (its punica CPU wrapper; vLLM turns "
                  "compilation off with LoRA on a CPU)")


def goals(report: dict) -> dict:
    runs, out = report["runs"], {}
    for server, label in (("tandem", "Tandem"), ("tandem-eager", "Tandem --enforce-eager")):
        if server in runs:
            r = mix_over_base(runs[server])
            out[f"{label} mix / base output tok/s"] = {"bound": f"≥ {MIX_BOUND}", "ratio": r,
                                                       "met": None if r["median"] is None else r["median"] >= MIX_BOUND}
    if "tandem" in runs and "vllm" in runs and report["vllm_lora_runs"]:
        r = ratios(runs["tandem"]["mix"], runs["vllm"]["mix"], "output_tok_s")
        out["Tandem mix / vLLM-CPU mix output tok/s"] = {"bound": "≥ 1.0", "ratio": r,
                                                         "met": None if r["median"] is None else r["median"] >= 1.0}
    trials = report["load_trials"].get("tandem") or report["load_trials"].get("tandem-eager", [])
    if trials:
        extra = [t.get("added_steps", t.get("extra_steps")) for t in trials]
        out["run-time load: failed requests"] = {"bound": "0", "ratio": spread([t["failed"] for t in trials]),
                                                 "met": all(t["failed"] == 0 and t["load_status"] == 200
                                                            for t in trials)}
        against = "adapter in a slot" if all("added_steps" in t for t in trials) else "the window just before"
        out[f"run-time load: streams' worst gap, new adapter − {against}, in median steps"] = {
            "bound": f"≤ {STALL_BOUND}", "ratio": spread(extra),
            "met": all(x is not None and x <= STALL_BOUND for x in extra)}
    return out


def summary(runs: dict) -> dict:
    return {s: {p: {k: spread([r.get(k) for r in rs]) for k in KEYS} | {"errors": sum(r["errors"] for r in rs)}
                for p, rs in per_p.items()} for s, per_p in runs.items()}


def markdown(report: dict) -> str:
    s = report["summary"]
    loads = [r["load_avg"] for per_p in report["runs"].values() for rs in per_p.values() for r in rs]
    parts = [f"`{report['command']}`", "",
             f"{report['date']}; {report['machine']}; code {report['git']}", "",
             f"CPU: {report['cpu']['model']}, flags {', '.join(report['cpu']['flags']) or 'none of note'}; dtype "
             f"{report['dtype']}; model {report['model']}. A shared machine: load average {report['load_avg_start']} "
             f"at the start, {report['load_avg_end']} at the end, {min(loads, default=0):.1f}–"
             f"{max(loads, default=0):.1f} before the phases ({report['cpu']['cores']} cores).", "",
             f"{report['adapters']} random adapters, rank {report['rank']} on {report['targets']}; "
             f"concurrency {report['concurrency']}, {report['requests']} requests per phase, "
             f"{report['prompt_tokens']}-token prompts, {report['max_tokens']} tokens each; Tandem "
             f"`--mode {report['tandem_mode']}`; medians of {report['repeats']} interleaved repeats (min–max).", "",
             report["vllm_lora"], "",
             "| server, phase | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | errors |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for server, per_p in s.items():
        for phase, x in per_p.items():
            parts.append(f"| {server}, {phase} | {fmt(x['output_tok_s'])} | {fmt(x['ttft_ms_p50'])} | "
                         f"{fmt(x['ttft_ms_p99'])} | {fmt(x['itl_ms_p50'])} | {fmt(x['itl_ms_p99'])} | "
                         f"{x['errors']} |")
    parts += ["", "| server | mix / base output tok/s (per repeat) |", "|---|---:|"]
    for server in report["runs"]:
        parts.append(f"| {server} | {fmt(mix_over_base(report['runs'][server]), 3)} |")
    if report["goals"]:
        parts += ["", "| goal | bound | median (min–max) | met |", "|---|---:|---:|---|"]
        for name, g in report["goals"].items():
            parts.append(f"| {name} | {g['bound']} | {fmt(g['ratio'], 2)} | {'met' if g['met'] else 'not met'} |")
    for server, trials in report["load_trials"].items():
        if not trials:
            continue
        parts += ["", f"Run-time loads on {server} (streams of {', '.join(trials[0]['running_models'])} at "
                      f"c={report['concurrency']}; {report['late_requests']} requests to the new adapter"
                      + (", and before each load the same requests to an adapter already in a slot):"
                         if "resident_trial" in trials[0] else "):"), "",
                  "| adapter loaded | HTTP | ms | failed / requests | median ITL (ms) | streams' worst gap: new "
                  "adapter (ms, steps) | the same requests to an adapter in a slot (ms, steps) | added (steps) | "
                  "worst gap just before the load (ms) | engine loads | load avg |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for t in trials:
            c = t.get("resident_trial", {})
            failed = t["failed"] + c.get("failed", 0)
            sent = sum(x.get(k, 0) for x in (t, c) for k in ("running_requests", "late_requests"))
            parts.append(f"| {t['adapter']} | {t['load_status']} | {t['load_http_ms']} | {failed} / {sent} | "
                         f"{t['median_itl_ms']} | {t['worst_gap_ms']}, {t['worst_gap_steps']} | "
                         f"{c.get('worst_gap_ms', '–')}, {c.get('worst_gap_steps', '–')} ({t.get('resident', '–')}) | "
                         f"{t.get('added_steps', '–')} | {t['control_worst_gap_ms']} | "
                         f"{t.get('engine_loads', '–')} | {t['load_avg']} |")
    return "\n".join(parts)


def plot(report: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    servers = list(report["summary"])
    for i, phase in enumerate(PHASES):
        med, yerr = error_bars([report["summary"][s][phase]["output_tok_s"] for s in servers])
        ax.bar([j + 0.4 * i for j in range(len(servers))], med, 0.4, yerr=yerr, capsize=3, label=phase)
    ax.set_xticks([j + 0.2 for j in range(len(servers))], servers)
    ax.set_ylabel("output tok/s")
    ax.set_title(f"base alone vs {report['adapters']} adapters + base, c={report['concurrency']}")
    ax.legend()
    for server, trials in report["load_trials"].items():
        xs = range(len(trials))
        bx.plot(xs, [t["worst_gap_steps"] for t in trials], "o-", label=f"{server}: new adapter")
        if all("resident_trial" in t for t in trials):
            bx.plot(xs, [t["resident_trial"]["worst_gap_steps"] for t in trials], "x--",
                    label=f"{server}: adapter in a slot")
        else:     # a report from before the paired trials: the window just before the load
            bx.plot(xs, [t["control_worst_gap_steps"] for t in trials], "x--", label=f"{server}: just before")
    bx.set_yscale("log")
    bx.set_xticks(range(max((len(t) for t in report["load_trials"].values()), default=0)))
    bx.set_xlabel("trial")
    bx.set_ylabel("worst inter-token gap / median")
    bx.set_title("running streams while an adapter loads")
    bx.legend(fontsize=7)
    return save_figure(fig, out.with_suffix(".png"), report)


def render(report: dict, out: Path) -> None:
    render_report("lora", markdown(report), out, lambda: plot(report, out))


def run(args: argparse.Namespace) -> int:
    from tandem.client.bench.peer_servers import PEERS_VENV, ensure_vllm_venv, snapshot, vllm_version
    if args.report_only:
        report = json.loads(args.out.read_text())
        report["goals"] = goals(report)
        render(report, args.out)
        return 0
    args._model_dir = model_path(args.model)
    servers = list(args.servers)
    adapters = adapter_names(args.adapters)
    vllm_python = ensure_vllm_venv() if "vllm" in servers else None
    phase_n = args.requests
    pool_n = 4 * args.concurrency     # the load trials' running streams cycle through these
    total = 2 * args.repeats * phase_n + pool_n + args.late_requests * args.load_trials + 1
    prompts = Prompts.cut(args._model_dir / "tokenizer.json", total, args.prompt_tokens - 1, 1).cold
    cpu, load_start = cpu_info(), round(os.getloadavg()[0], 2)
    git = git_state() if args.tandem_code == "worktree" else git_state().split()[0]
    print(f"CPU {cpu['model']} ({', '.join(cpu['flags'])}), dtype {args.dtype}, load {load_start}; "
          f"{', '.join(servers)}", flush=True)
    runs: dict = {}
    trials: dict = {}
    warm_errors: dict = {}
    with work_dir("tandem-bench-lora-", keep=args.keep_work) as work, ExitStack() as stack:
        dirs = make_adapters(args._model_dir, work / "adapters", [*adapters, LATE], args.rank, TARGETS[args.targets])
        tandem_path = snapshot(work / "code") if "tandem" in servers and args.tandem_code == "head" else None
        up, failed = start(stack, launches(servers, args, work, {a: dirs[a] for a in adapters}, vllm_python,
                                           tandem_path), work)
        for server, srv in up.items():
            warm_errors[server] = warm_up(srv, server, args, adapters, prompts[-1])
            if warm_errors[server]:
                print(f"  {server} warm-up errors: {warm_errors[server]}", flush=True)
        for rep in range(args.repeats):
            for server in (list(up) if rep % 2 == 0 else list(reversed(up))):
                for phase in phase_order(rep):
                    start_i = (2 * rep + PHASES.index(phase)) * phase_n
                    runs.setdefault(server, {p: [] for p in PHASES})[phase].append(
                        measure(up[server], server, phase, prompts[start_i:start_i + phase_n], args, adapters))
        pool = prompts[2 * args.repeats * phase_n:][:pool_n]
        late_pool = prompts[2 * args.repeats * phase_n + pool_n:]
        for server, srv in up.items():
            trials[server] = [load_trial(srv, server, t, dirs, adapters, pool,
                                         late_pool[t * args.late_requests:(t + 1) * args.late_requests], args)
                              for t in range(args.load_trials)]
    report = {**header("lora", args), "cpu": cpu, "dtype": args.dtype, "git": git, "model": args.model,
              "versions": {"vllm": vllm_version(vllm_python) if vllm_python else None},
              "peers_venv": str(PEERS_VENV) if vllm_python else None,
              "load_avg_start": load_start, "load_avg_end": round(os.getloadavg()[0], 2),
              "servers": servers, "failed_to_start": failed, "warm_up_errors": warm_errors,
              "ready_s": {s: srv.ready_s for s, srv in up.items()},
              "adapters": args.adapters, "rank": args.rank, "targets": args.targets,
              "concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "tandem_mode": args.tandem_mode,
              "late_requests": args.late_requests}
    report["machine"] += (f"; CPU {cpu['model']} ({', '.join(cpu['flags']) or 'no avx2/avx512/amx'}); "
                          f"shared host, load {load_start}..{report['load_avg_end']}")
    report["runs"], report["load_trials"] = runs, trials
    report["summary"] = summary(runs)
    report["vllm_lora_runs"], report["vllm_lora"] = vllm_lora_status(report)
    report["goals"] = goals(report)
    write(report, args.out)
    render(report, args.out)
    return 0
