"""``tandem bench profile``: where one decode step and one verify step spend their time.

Runs the engine on the demo target (and draft, for the verify step) under
``torch.profiler`` and attributes every operator's own CPU time to the part of the
engine that called it — weights (linear layers), attention, planning and page tables,
sampling and verification — by the innermost Tandem frame on its Python stack;
what the operators do not account for of the wall time is Python and dispatch
overhead. Prints a table, writes JSON (one row per step kind and batch size).
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from tandem.client.bench.args import add_dtype, positive_int, positive_ints
from tandem.client.bench.report import header, write
from tandem.client.paths import DEMO_CHECKPOINTS

# innermost Tandem frame (path fragment) -> category; first match wins
CATEGORIES = (
    ("attention/batch_plan", "planning"), ("kv_cache/page_table", "planning"),
    ("engine/model_runner", "planning"), ("attention/", "attention"),
    ("engine/sampler", "sampling"), ("speculative/", "sampling"),
    ("models/", "weights"), ("engine/proposers", "proposer"),
)
WEIGHT_OPS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm",
              "mkldnn::_linear_pointwise")   # the packed bf16 linear (models/packed_linear.py)
OPERATOR_NAMESPACES = ("aten::", "mkldnn::")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--draft", type=Path, default=DEMO_CHECKPOINTS / "draft")
    add_dtype(p)
    p.add_argument("--batch-sizes", type=positive_ints, default="1,8")
    p.add_argument("--k", type=positive_int, default=3, help="draft tokens per verify step")
    p.add_argument("--steps", type=positive_int, default=40)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=Path, default=Path("docs/bench/profile.json"))


def categorize(stack: list[str], op: str) -> str:
    """The category of an operator from its Python stack (innermost frame first).

    >>> categorize(["backends/attention/torch_ref.py(12): run"], "aten::bmm")
    'attention'
    >>> categorize(["backends/models/layers.py(40): forward"], "aten::linear")
    'weights'
    >>> categorize([], "aten::add")
    'other'
    >>> categorize(["backends/models/layers.py(40): forward", "backends/engine/proposers.py(70): propose"],
    ...            "aten::linear")
    'draft weights'
    """
    draft = "draft " if any("engine/proposers" in f for f in stack) else ""
    for frame in stack:
        for fragment, category in CATEGORIES:
            if fragment in frame:
                if category == "weights" and not op.startswith(WEIGHT_OPS):
                    category = "model (non-matmul)"
                return draft + category if category != "proposer" else "draft (other)"
    return "other"


def python_frames(event) -> list[str]:
    """The Tandem frames above an operator, innermost first."""
    frames, p = [], event.cpu_parent
    while p is not None:
        if "backends/" in p.name or "rdma/" in p.name:
            frames.append(p.name)
        p = p.cpu_parent
    return frames


def profile_steps(llm, prompts, steps: int, new_tokens: int) -> dict:
    """Admit ``prompts``, prefill them, then profile ``steps`` engine steps."""
    from torch.profiler import ProfilerActivity, profile

    from tandem.backends import SamplingParams
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(4):   # prefill, and the proposer's catch-up, before measuring
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain_wall = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    by = defaultdict(float)
    for e in prof.events():
        # top-level operators only (their children are inside their time); with_stack
        # makes the Python frames the operators' parents
        if not e.name.startswith(OPERATOR_NAMESPACES) or (
                e.cpu_parent is not None and e.cpu_parent.name.startswith(OPERATOR_NAMESPACES)):
            continue
        by[categorize(python_frames(e), e.name)] += e.cpu_time_total / 1e6
    ops = sum(by.values())
    by["python and dispatch (wall - operators)"] = max(wall - ops, 0.0)
    # the profiler's Python tracing inflates the Python share: the breakdown is of the
    # profiled wall time; the step time without the profiler comes first
    return {"wall_ms_per_step": round(1000 * plain_wall / steps, 3),
            "profiled_ms_per_step": round(1000 * wall / steps, 3),
            "ms_per_step": {k: round(1000 * v / steps, 3) for k, v in sorted(by.items())}}


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem.backends import LLM, SpeculativeConfig
    torch.set_num_threads(args.threads)
    report = header("profile", args)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(48)] for i in range(8)]
    rows = []
    for batch in args.batch_sizes:
        for kind, spec in (("decode", None),
                           ("verify", SpeculativeConfig("draft_target", args.k, draft_model=str(args.draft)))):
            llm = LLM(args.target, dtype=args.dtype, speculative=spec, max_num_seqs=max(8, batch))
            row = {"kind": kind, "batch": batch, **profile_steps(llm, prompts[:batch], args.steps,
                                                                  new_tokens=2 * args.steps * (args.k + 1) + 8)}
            rows.append(row)
            print(f"{kind:<7} batch {batch}: {row['wall_ms_per_step']:.2f} ms/step "
                  f"({row['profiled_ms_per_step']:.2f} profiled)  " +
                  "  ".join(f"{k} {v}" for k, v in row["ms_per_step"].items()), flush=True)
    report["rows"] = rows
    write(report, args.out)
    return 0
