"""Does ``torch.compile`` pay for the decode step on this CPU? (issue 14)

Three ways to run one decode step of the target (batch 1 and 8, the KV of a 150-token
context, bf16, one thread): the engine's eager step (``ModelRunner.forward`` and the
logits: packed bf16 linears, paged attention of the CPU twin); a static-shape step with
attention inside one function (gather, SDPA, KV append), eager; and that function
under ``torch.compile`` (inductor, weights frozen and packed by inductor), the CPU
counterpart of capturing a CUDA graph. Prints ms per step and the compile time.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from .bench_repeats import fmt, spread
from .bench_report import header, write
from .paths import DEMO_CHECKPOINTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--context", type=int, default=150, help="tokens already in each sequence's KV")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of every variant")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("docs/bench/compile.json"))


def ms_per_call(fn, steps: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return 1000 * (time.perf_counter() - start) / steps


def static_step(model, cache, page_size: int):
    """A decode step over a fixed page table: ``(ids, positions, page, slot, rows, mask)``
    -> logits; every layer's KV append, gather and attention inside (traceable)."""
    import torch
    import torch.nn.functional as F
    cfg = model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rot = model.rotary_table()

    def step(ids, positions, page, slot, rows, mask):
        b = ids.shape[0]
        cos, sin = rot.cos[positions].unsqueeze(1), rot.sin[positions].unsqueeze(1)
        x = model.embed_tokens(ids)
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            qkv = attn.qkv_proj(layer.input_layernorm(x)).view(b, hq + 2 * hkv, d)
            qk = qkv[:, :hq + hkv]
            q, k = (qk * cos + qk.roll(d // 2, -1) * sin).split([hq, hkv], 1)
            layer_cache = cache[i]                                   # HND [P, 2, H, S, D]
            layer_cache[page, :, :, slot] = torch.stack((k, qkv[:, hq + hkv:]), 1)
            kv = layer_cache.view(-1, page_size * d).index_select(0, rows)
            kv = kv.view(2, hkv, b, -1, d).transpose(1, 2)            # [2, B, H, L, D]
            o = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, d), kv[0], kv[1],
                                               attn_mask=mask)
            x = x + attn.o_proj(o.reshape(b, hq * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.compute_logits(x)
    return step


def run(args) -> int:
    import torch
    import torch._inductor.config as inductor_config
    torch.set_num_threads(args.threads)
    from tandem.backends.engine.model_runner import ForwardBatch, ModelRunner
    from tandem.backends.kv_cache import KVPagePool
    from tandem.backends.models import load_model

    page_size, results = 16, []
    pages_per_seq = -(-(args.context + 1) // page_size)
    for batch in map(int, args.batch_sizes.split(",")):
        model = load_model(args.target, "bfloat16")
        cfg, num_pages = model.config, batch * pages_per_seq + 1
        pool = KVPagePool.for_model(cfg, num_pages, page_size, torch.bfloat16, "HND", "cpu")
        runner = ModelRunner(model, pool)          # packs the linears
        lists = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(batch)]
        fb = ForwardBatch([[5]] * batch, [args.context] * batch, lists)
        with torch.inference_mode():
            # the same step with static shapes, attention included
            pages = torch.tensor(lists)
            rows = (pages[:, None, None, :] * 2 + torch.arange(2)[None, :, None, None]) \
                * cfg.num_key_value_heads + torch.arange(cfg.num_key_value_heads)[None, None, :, None]
            rows = rows.permute(1, 2, 0, 3).reshape(-1)
            kv_len = pages_per_seq * page_size
            mask = torch.zeros(batch, 1, 1, kv_len, dtype=torch.bfloat16)
            mask[..., args.context + 1:] = float("-inf")
            inputs = (torch.full((batch,), 5), torch.full((batch,), args.context),
                      pages[:, -1].clone(), torch.full((batch,), args.context % page_size), rows, mask)
            cache = pool.kv.view(cfg.num_hidden_layers, num_pages, 2, cfg.num_key_value_heads,
                                 page_size, cfg.head_dim)
            plain = load_model(args.target, "bfloat16")   # unpacked: inductor packs itself
            step = static_step(plain, cache, page_size)
            packed_step = static_step(model, cache, page_size)
            inductor_config.freezing = True
            compiled = torch.compile(step, dynamic=False)
            t0 = time.perf_counter()
            compiled(*inputs)
            compile_s = time.perf_counter() - t0
            variants = {"engine_eager": lambda: runner.logits(runner.forward(fb)[1]),
                        "static_eager": lambda: step(*inputs),
                        "static_eager_packed": lambda: packed_step(*inputs),
                        "compiled": lambda: compiled(*inputs)}
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
