"""``tandem bench profile``: where one decode step and one verify step spend their time.

Runs the engine on the demo target (and draft, for the verify step), eager
(``enforce_eager``) and with the compiled decode step (``compile="all"``), under
``torch.profiler`` and attributes every operator's own CPU time to the part of the
engine that called it — weights (linear layers), attention, planning and page tables,
sampling and verification — by the innermost Tandem frame on its Python stack; inside
a compiled region by the operator (the opaque attention and linear ops), the rest of
the region being inductor's fused kernels. What the operators do not account for of
the wall time is Python and dispatch overhead. Decode rows also carry the step's
roofline (``roofline.py``): weight and KV bytes over the measured read bandwidth,
FLOPs over the measured matmul peak. Prints a table, writes JSON (one row per step
kind, mode and batch size).
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from tandem.client.bench.args import add_dtype, model_path, names, positive_int, positive_ints
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
              "mkldnn::_linear_pointwise",   # the packed bf16 linear (models/packed_linear.py)
              "tandem::packed_linear",       # ... inside a compiled step
              "tandem_cpu::small_m_linear")  # the C++ linear for 1 to 8 rows (backends/cpu_kernels)
OPERATOR_NAMESPACES = ("aten::", "mkldnn::", "tandem::", "tandem_cpu::")   # tandem_cpu: C++ kernels
COMPILED_REGION = "Torch-Compiled Region"   # the profiler's event around a compiled graph's call


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=model_path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--draft", type=Path, default=DEMO_CHECKPOINTS / "draft")
    add_dtype(p)
    p.add_argument("--batch-sizes", type=positive_ints, default="1,8")
    p.add_argument("--modes", type=names("eager", "compiled"), default="eager,compiled",
                   help="eager (enforce_eager) and/or compiled (the compiled decode step at every batch)")
    p.add_argument("--k", type=positive_int, default=3, help="draft tokens per verify step")
    p.add_argument("--kinds", type=names("decode", "verify"), default="decode,verify",
                   help="decode (a plain step) and/or verify (a draft_target step: needs a --draft that fits)")
    p.add_argument("--prompt-len", type=positive_int, default=48,
                   help="each sequence's prompt (the attention's context grows with it)")
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


def in_compiled_region(event) -> bool:
    p = event.cpu_parent
    while p is not None:
        if p.name.startswith(COMPILED_REGION):
            return True
        p = p.cpu_parent
    return False


def compiled_category(op: str) -> str:
    """The category of an operator a compiled step calls (no Python frames there).

    >>> compiled_category("tandem::paged_attention"), compiled_category("aten::mm")
    ('attention', 'weights')
    """
    if op.startswith(("tandem::paged_attention", "tandem_cpu::paged_attention")):
        return "attention"
    return "weights" if op.startswith(WEIGHT_OPS) else "model (non-matmul)"


def python_frames(event) -> list[str]:
    """The Tandem frames above an operator, innermost first."""
    frames, p = [], event.cpu_parent
    while p is not None:
        if "backends/" in p.name or "rdma/" in p.name:
            frames.append(p.name)
        p = p.cpu_parent
    return frames


def warm_up_steps(prompts: list[list[int]], max_num_batched_tokens: int) -> int:
    """Steps that prefill every prompt (one chunk of the token budget each) and 4 more.

    >>> warm_up_steps([[1] * 384] * 16, 512)
    16
    """
    return -(-sum(len(p) for p in prompts) // max_num_batched_tokens) + 4


def profile_steps(llm, prompts, steps: int, new_tokens: int) -> dict:
    """Admit ``prompts``, prefill them, then profile ``steps`` engine steps."""
    from torch.profiler import ProfilerActivity, profile

    from tandem.backends import SamplingParams
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    # prefill (in chunks of max_num_batched_tokens: 16 prompts of 384 tokens take 12
    # steps), and the proposer's catch-up, before measuring
    for _ in range(warm_up_steps(prompts, engine.config.max_num_batched_tokens)):
        engine.step()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.step()
    plain_wall, plain_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    by = defaultdict(float)
    region = region_ops = 0.0
    for e in prof.events():
        if e.name.startswith(COMPILED_REGION):
            region += e.cpu_time_total / 1e6
            continue
        # top-level operators only (their children are inside their time); with_stack
        # makes the Python frames the operators' parents
        if not e.name.startswith(OPERATOR_NAMESPACES) or (
                e.cpu_parent is not None and e.cpu_parent.name.startswith(OPERATOR_NAMESPACES)):
            continue
        if in_compiled_region(e):
            by[compiled_category(e.name)] += e.cpu_time_total / 1e6
            region_ops += e.cpu_time_total / 1e6
            continue
        by[categorize(python_frames(e), e.name)] += e.cpu_time_total / 1e6
    if region:   # the compiled regions less their operators: inductor's kernels and guards
        by["fused kernels (compiled)"] = max(region - region_ops, 0.0)
    ops = sum(by.values())
    by["python and dispatch (wall - operators)"] = max(wall - ops, 0.0)
    # the profiler's Python tracing inflates the Python share: the breakdown is of the
    # profiled wall time; the step time without the profiler comes first
    # CPU ms (process time) as well: on a shared host the wall time includes waiting
    # for the core, the CPU time does not
    return {"wall_ms_per_step": round(1000 * plain_wall / steps, 3),
            "cpu_ms_per_step": round(1000 * plain_cpu / steps, 3),
            "profiled_ms_per_step": round(1000 * wall / steps, 3),
            "python_share": round(by["python and dispatch (wall - operators)"] / wall, 3),
            "ms_per_step": {k: round(1000 * v / steps, 3) for k, v in sorted(by.items())}}


def add_roofline(row: dict, cfg, context: int, dtype: str, read_gb_s: float, peak_gflops: float) -> None:
    """The decode step's roofline share: the best possible ms over the measured CPU ms
    (the bandwidth and peak are measured on the same, shared, host)."""
    from tandem.backends.models.config import DTYPE_BYTES
    from tandem.client.bench.roofline import decode_work, roofline_ms
    work = decode_work(cfg, row["batch"], context, DTYPE_BYTES[dtype])
    bound = roofline_ms(work, read_gb_s, peak_gflops)
    row["roofline"] = dict(context=context, mbytes=round(work.bytes / 1e6, 2),
                           mflops=round(work.flops / 1e6, 1), bound_ms=round(bound, 3),
                           bound="memory" if work.bytes / read_gb_s >= work.flops / peak_gflops else "compute",
                           share=round(bound / row["cpu_ms_per_step"], 3))


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem.backends import LLM, SpeculativeConfig
    from tandem.client.bench.roofline import matmul_peak_gflops, read_bandwidth_gb_s
    torch.set_num_threads(args.threads)
    report = header("profile", args)
    report["read_gb_s"] = read_gb_s = round(read_bandwidth_gb_s(), 2)
    report["matmul_peak_gflops"] = peak = round(matmul_peak_gflops(args.dtype), 1)
    print(f"read bandwidth {read_gb_s} GB/s, {args.dtype} matmul peak {peak} GFLOPS "
          f"({args.threads} thread(s))", flush=True)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(args.prompt_len)] for i in range(max(8, *args.batch_sizes))]
    # the profiled window's mean context: prompt, the decode steps of the warm-up (about
    # 4), the unprofiled steps
    context = args.prompt_len + 4 + args.steps + args.steps // 2
    modes = {"eager": dict(enforce_eager=True), "compiled": dict(compile="all")}
    rows = []
    for batch in args.batch_sizes:
        kinds = (("decode", None), ("verify", SpeculativeConfig("draft_target", args.k, draft_model=str(args.draft))))
        for kind, spec in (k for k in kinds if k[0] in args.kinds):
            for mode in args.modes:
                llm = LLM(args.target, dtype=args.dtype, speculative=spec, max_num_seqs=max(8, batch),
                          **modes[mode])
                row = {"kind": kind, "mode": mode, "batch": batch,
                       **profile_steps(llm, prompts[:batch], args.steps,
                                       new_tokens=2 * args.steps * (args.k + 1) + 8)}
                if kind == "decode":
                    add_roofline(row, llm.engine.model.config, context, args.dtype, read_gb_s, peak)
                rows.append(row)
                roof = f"  roofline {row['roofline']['share']:.0%}" if "roofline" in row else ""
                print(f"{kind:<7} {mode:<8} batch {batch}: {row['wall_ms_per_step']:.2f} ms/step "
                      f"(CPU {row['cpu_ms_per_step']:.2f})"
                      f"({row['profiled_ms_per_step']:.2f} profiled, python {row['python_share']:.0%}){roof}  " +
                      "  ".join(f"{k} {v}" for k, v in row["ms_per_step"].items()), flush=True)
    report["rows"] = rows
    write(report, args.out)
    return 0
