"""Does ``torch.compile`` pay on this CPU, and which paged attention is fastest?

Three tables, in CPU ms (the process's CPU time, which the other tenants of a shared
host do not inflate as they do wall time). **step**: one decode step of the target (the KV of a 150-token context,
one thread, each dtype), the engine's eager step (``ModelRunner.forward`` and the
logits) against the compiled one (``engine/compiled_decode.py``: inductor's graph of the
layers, attention through the opaque op), interleaved repeats. **start**: an engine's
start-up (``LLM``, ``compile="auto"``: compile, warm-up timing, decision) in a fresh
process with an empty compile cache, then again on the filled one (a restart).
**attention**: one layer's paged attention at the demo model's decode and prefill
shapes: the CPU twin of FlashInfer's wrapper (``attention/torch_ref.py``: gathered
pages, GQA heads folded into query rows, SDPA), gathered pages with SDPA's own GQA,
gathered pages with explicit matmuls and softmax, and inductor's kernel of the twin's
gather and SDPA (static shapes); each checked against the twin within the attention
tests' tolerance.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.client.bench.args import model_path, names, positive_int, positive_ints
from tandem.client.bench.repeats import fmt, spread
from tandem.client.bench.report import header, write
from tandem.client.paths import DEMO_CHECKPOINTS

# the attention tests' tolerance (tests/unit/attention/test_attention.py)
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=model_path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--dtypes", type=names("float32", "bfloat16"), default="float32,bfloat16")
    p.add_argument("--batch-sizes", type=positive_ints, default="1,8")
    p.add_argument("--context", type=positive_int, default=150, help="tokens already in each sequence's KV")
    p.add_argument("--steps", type=positive_int, default=100)
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs of every variant")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--skip-start", action="store_true", help="no first-start / restart timing")
    p.add_argument("--out", type=Path, default=Path("docs/bench/compile.json"))


def ms_per_call(fn, steps: int) -> float:
    """CPU ms per call (the process's CPU time: on a shared host wall time mostly
    measures the other tenants; with one torch thread it is the step's own time)."""
    for _ in range(3):
        fn()
    start = time.process_time()
    for _ in range(steps):
        fn()
    return 1000 * (time.process_time() - start) / steps


def interleaved(variants: dict, steps: int, repeats: int) -> dict[str, list[float]]:
    runs = {name: [] for name in variants}
    for _ in range(repeats):      # every variant once per repeat
        for name, fn in variants.items():
            runs[name].append(ms_per_call(fn, steps))
    return runs


def step_rows(args, dtype: str, cache_dir: str) -> list[dict]:
    import torch

    from tandem.backends.engine.compiled_decode import CompiledDecode
    from tandem.backends.engine.model_runner import ForwardBatch, ModelRunner
    from tandem.backends.kv_cache import KVPagePool
    from tandem.backends.models import load_model

    page_size, rows = 16, []
    pages_per_seq = -(-(args.context + 1) // page_size)
    model = load_model(args.target, dtype)
    batch_max = max(args.batch_sizes)
    pool = KVPagePool.for_model(model.config, batch_max * pages_per_seq, page_size,
                                getattr(torch, dtype), "HND", "cpu")
    runner = ModelRunner(model, pool)
    compiled = CompiledDecode(runner, args.batch_sizes, cache_dir)
    for batch in args.batch_sizes:
        lists = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(batch)]
        fb = ForwardBatch([[5]] * batch, [args.context] * batch, lists)
        with torch.inference_mode():
            t0 = time.perf_counter()
            compiled.run(fb)
            compile_s = time.perf_counter() - t0
            runs = interleaved({"eager": lambda: runner.logits(runner.forward(fb)[1]),
                                "compiled": lambda: runner.logits(compiled.run(fb))},
                               args.steps, args.repeats)
        row = dict(dtype=dtype, batch=batch, first_call_s=round(compile_s, 1),
                   eager_ms=spread(runs["eager"]), compiled_ms=spread(runs["compiled"]),
                   compiled_over_eager=spread([c / e for c, e in zip(runs["compiled"], runs["eager"])]))
        rows.append(row)
        print(f"step {dtype} decode batch {batch}: eager {fmt(row['eager_ms'], 3)} ms  compiled "
              f"{fmt(row['compiled_ms'], 3)} ms  compiled/eager {fmt(row['compiled_over_eager'], 2)}  "
              f"first call {compile_s:.1f} s", flush=True)
    # prefill chunks go through the same dynamic graph: does it pay there too?
    for chunk in (128, 512):
        fb = ForwardBatch([[5] * chunk], [0], [list(range(-(-chunk // page_size)))])
        with torch.inference_mode():
            runs = interleaved({"eager": lambda: runner.forward(fb),
                                "compiled": lambda: compiled.run(fb)},
                               max(3, args.steps // 10), args.repeats)
        row = dict(dtype=dtype, prefill_tokens=chunk, eager_ms=spread(runs["eager"]),
                   compiled_ms=spread(runs["compiled"]),
                   compiled_over_eager=spread([c / e for c, e in zip(runs["compiled"], runs["eager"])]))
        rows.append(row)
        print(f"step {dtype} prefill {chunk} tokens: eager {fmt(row['eager_ms'], 3)} ms  compiled "
              f"{fmt(row['compiled_ms'], 3)} ms  compiled/eager {fmt(row['compiled_over_eager'], 2)}", flush=True)
    return rows


START = """
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[4]))
t0 = time.perf_counter()
from tandem.backends import LLM
llm = LLM(sys.argv[1], dtype=sys.argv[2], compile="auto", compile_cache_dir=sys.argv[3], max_num_seqs=8)
steps = llm.engine.decode_graphs
print(json.dumps(dict(seconds=time.perf_counter() - t0, compiled=steps.compiled,
                      warm_up_s=steps.warmed.seconds, timings=steps.warmed.timings)))
"""


def start_rows(args, dtype: str) -> list[dict]:
    """An engine's start with an empty compile cache, then a restart on the filled one."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for start in ("first start", "restart"):
            out = subprocess.run([sys.executable, "-c", START, str(args.target), dtype, cache,
                                  str(args.threads)], capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(dict(dtype=dtype, start=start, seconds=round(got["seconds"], 1),
                             warm_up_s=round(got["warm_up_s"], 1), compiled_buckets=got["compiled"],
                             timings=got["timings"]))
            print(f"start {dtype} {start}: {got['seconds']:.1f} s (warm-up {got['warm_up_s']:.1f} s), "
                  f"compiled buckets {got['compiled']}", flush=True)
    return rows


def attention_variants(q, cache, table, qo: int, kv_len: int, g: int):
    """Paged attention of ``n`` requests of ``qo`` queries each (the last ``qo`` of
    ``kv_len`` positions, causal) over an HND layer ``cache`` [pages, 2, H, ps, D] with
    page ``table`` [n, P], four ways: name -> fn() -> [n * qo, Hq, D]."""
    import torch
    import torch.nn.functional as F
    n, hkv, ps, d = table.shape[0], cache.shape[2], cache.shape[3], cache.shape[4]
    hq = hkv * g
    width = table.shape[1] * ps
    pos = torch.arange(width)
    rows = torch.arange(kv_len - qo, kv_len)
    allowed = pos[None, :] <= rows[:, None]                               # [qo, width]
    mask = torch.zeros(qo, width, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    qm = mask.repeat_interleave(g, 0) if qo > 1 else mask     # folded rows: query t's g heads
    flat = cache.reshape(-1, ps * d)
    index = ((table[None, :, None, :] * 2 + torch.arange(2)[:, None, None, None]) * hkv
             + torch.arange(hkv)[None, None, :, None]).reshape(-1)       # [2, n, H, P]

    def gather():
        kv = flat.index_select(0, index).view(2, n, hkv, width, d)
        return kv[0], kv[1]

    def folded_q():   # [n, H, qo * g, D]: a KV head's g query heads as rows
        return q.view(n, qo, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(n, hkv, qo * g, d)

    def unfold(o):
        return o.view(n, hkv, qo, g, d).permute(0, 2, 1, 3, 4).reshape(n * qo, hq, d)

    def sdpa_folded():
        k, v = gather()
        return unfold(F.scaled_dot_product_attention(folded_q(), k, v, attn_mask=qm))

    def sdpa_gqa():
        k, v = gather()
        o = F.scaled_dot_product_attention(q.view(n, qo, hq, d).transpose(1, 2), k, v,
                                           attn_mask=mask, enable_gqa=True)
        return o.transpose(1, 2).reshape(n * qo, hq, d)

    def matmul():
        k, v = gather()
        scores = folded_q() @ k.transpose(-1, -2) * d ** -0.5 + qm
        return unfold(torch.softmax(scores.float(), -1).to(q.dtype) @ v)

    return {"gather_sdpa_gqa": sdpa_gqa, "gather_matmul_softmax": matmul,
            "compiled_gather_sdpa": torch.compile(sdpa_folded, dynamic=False)}


def attention_rows(args, dtype: str) -> list[dict]:
    import torch

    from tandem.backends.attention import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
    from tandem.backends.models.config import ModelConfig

    cfg = ModelConfig.from_dir(str(args.target))
    hq, hkv, d, ps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 16
    dt = getattr(torch, dtype)
    # (kind, requests, queries each, kv length): decode at the step's batches, a prefill
    # chunk of 128 tokens after 256 cached, and a whole 512-token prefill
    shapes = [("decode", b, 1, args.context + 1) for b in args.batch_sizes] + \
             [("prefill", 1, 128, 384), ("prefill", 1, 512, 512)]
    rows = []
    for kind, n, qo, kv_len in shapes:
        pages = -(-kv_len // ps)
        g = torch.Generator().manual_seed(0)
        cache = torch.randn(n * pages + 1, 2, hkv, ps, d, generator=g).to(dt)
        table = torch.randperm(n * pages, generator=g).view(n, pages)
        q = torch.randn(n * qo, hq, d, generator=g).to(dt)
        i32 = dict(dtype=torch.int32)
        indptr = torch.arange(0, n * pages + 1, pages, **i32)
        last = torch.full((n,), (kv_len - 1) % ps + 1, **i32)
        ws = torch.empty(8, dtype=torch.uint8)
        if kind == "decode":
            w = BatchDecodeWithPagedKVCacheWrapper(ws, "HND")
            w.plan(indptr, table.reshape(-1).to(torch.int32), last, hq, hkv, d, ps, q_data_type=dt)
        else:
            w = BatchPrefillWithPagedKVCacheWrapper(ws, "HND")
            w.plan(torch.arange(0, n * qo + 1, qo, **i32), indptr, table.reshape(-1).to(torch.int32), last,
                   hq, hkv, d, ps, causal=True, q_data_type=dt)
        variants = {"torch_ref": lambda: w.run(q, cache),
                    **attention_variants(q, cache, table, qo, kv_len, hq // hkv)}
        with torch.inference_mode():
            want = variants["torch_ref"]().float()
            errors = {name: float((fn().float() - want).abs().max()) for name, fn in variants.items()}
            runs = interleaved(variants, max(10, args.steps // 4), args.repeats)
        row = dict(dtype=dtype, kind=kind, requests=n, qo_len=qo, kv_len=kv_len,
                   us_per_layer={name: spread([1000 * x for x in v]) for name, v in runs.items()},
                   max_abs_error=errors,
                   exact={name: e <= TOLERANCE[dtype] * max(1.0, float(want.abs().max())) for name, e in errors.items()})
        rows.append(row)
        best = min(runs, key=lambda k: min(runs[k]))
        print(f"attention {dtype} {kind} n={n} qo={qo} kv={kv_len}: " + "  ".join(
            f"{name} {fmt(row['us_per_layer'][name], 1)} us{'' if row['exact'][name] else ' (INEXACT)'}"
            for name in variants) + f"  fastest: {best}", flush=True)
    return rows


def run(args) -> int:
    import torch
    torch.set_num_threads(args.threads)
    from tandem.backends.engine.compiled_decode import default_cache_dir
    report = dict(**header("compile", args), step=[], start=[], attention=[])
    for dtype in args.dtypes:
        report["step"] += step_rows(args, dtype, default_cache_dir())
        report["attention"] += attention_rows(args, dtype)
        if not args.skip_start:
            report["start"] += start_rows(args, dtype)
    write(report, args.out)
    print(f"wrote {args.out}")
    return 0
