"""Does ``torch.compile`` pay for the decode step on this CPU?

Three ways to run one decode step of the target (batch 1 and 8, the KV of a 150-token
context, bf16, one thread): the engine's eager step (``ModelRunner.forward`` and the
logits: packed bf16 linears, paged attention of the CPU twin); the compiled decode's
static-shape step (``engine/compiled_decode.py``: gather, SDPA and the new token's K/V in
one function, the KV written after it), eager; and that step under ``torch.compile``
(inductor, weights frozen and packed by inductor), as ``EngineConfig.compile`` runs it:
the CPU counterpart of capturing a CUDA graph. Prints ms per step and the compile time.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from tandem.client.bench.args import positive_int, positive_ints
from tandem.client.bench.repeats import fmt, spread
from tandem.client.bench.report import header, write
from tandem.client.paths import DEMO_CHECKPOINTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--batch-sizes", type=positive_ints, default="1,8")
    p.add_argument("--context", type=positive_int, default=150, help="tokens already in each sequence's KV")
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs of every variant")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=Path, default=Path("docs/bench/compile.json"))


def ms_per_call(fn, steps: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return 1000 * (time.perf_counter() - start) / steps


def run(args) -> int:
    import torch
    import torch._inductor.config as inductor_config
    torch.set_num_threads(args.threads)
    from tandem.backends.engine.compiled_decode import decode_step, step_inputs
    from tandem.backends.engine.model_runner import ForwardBatch, ModelRunner
    from tandem.backends.kv_cache import KVPagePool
    from tandem.backends.models import load_model

    page_size, results = 16, []
    pages_per_seq = -(-(args.context + 1) // page_size)
    for batch in args.batch_sizes:
        model = load_model(args.target, "bfloat16")
        cfg, num_pages = model.config, batch * pages_per_seq + 1
        pool = KVPagePool.for_model(cfg, num_pages, page_size, torch.bfloat16, "HND", "cpu")
        runner = ModelRunner(model, pool)          # packs the linears
        lists = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(batch)]
        fb = ForwardBatch([[5]] * batch, [args.context] * batch, lists)
        with torch.inference_mode():
            # the engine's compiled step (engine/compiled_decode.py), eager and compiled
            kv = pool.kv.view(cfg.num_hidden_layers, num_pages, 2, cfg.num_key_value_heads,
                              page_size, cfg.head_dim)
            ids, positions, rows, mask, page, slot = step_inputs(
                fb, page_size, cfg.num_key_value_heads, torch.bfloat16, num_pages - 1)

            def static(step, logits_of):
                def call():
                    hidden, new_kv = step(kv, ids, positions, rows, mask)
                    kv[:, page, :, :, slot] = new_kv
                    return logits_of(hidden)
                return call
            plain = load_model(args.target, "bfloat16")   # unpacked: inductor packs itself
            step = decode_step(plain, page_size)
            inductor_config.freezing = True
            compiled = torch.compile(step, dynamic=False)
            t0 = time.perf_counter()
            compiled(kv, ids, positions, rows, mask)
            compile_s = time.perf_counter() - t0
            variants = {"engine_eager": lambda: runner.logits(runner.forward(fb)[1]),
                        "static_eager": static(step, plain.compute_logits),
                        "compiled": static(compiled, plain.compute_logits)}
            runs = {name: [] for name in variants}
            for _ in range(args.repeats):      # interleaved: every variant once per repeat
                for name, fn in variants.items():
                    runs[name].append(ms_per_call(fn, args.steps))
            torch._dynamo.reset()
        row = dict(batch=batch, compile_s=round(compile_s, 1),
                   **{f"{name}_ms": spread(v) for name, v in runs.items()},
                   compiled_over_engine=spread([c / e for c, e in zip(runs["compiled"],
                                                                     runs["engine_eager"])]))
        results.append(row)
        print(f"batch {batch}: " + "  ".join(f"{name} {fmt(row[name + '_ms'], 3)} ms"
                                             for name in variants)
              + f"  compiled/engine {fmt(row['compiled_over_engine'], 2)}  compile {compile_s:.1f} s",
              flush=True)
    report = dict(**header("compile", args), rows=results)
    write(report, args.out)
    print(f"wrote {args.out}")
    return 0
