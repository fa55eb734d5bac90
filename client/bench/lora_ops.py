"""Gathered against segmented LoRA deltas (ops.py) at a decode step of 1 and 16 rows and a
256-token prefill: ``python -m tandem.client.bench.lora_ops`` prints µs per call (median of
repeats, one thread). ``--engine MODEL_DIR``: the offline engine's tokens/s with a batch
mixing 4 random adapters and the base against the base alone, at the same concurrency
(interleaved repeats, median). A measurement, not a test.

Measured here (2-core AMD EPYC with AVX512-BF16, shared; bf16, eager steps for both, 16
requests, rank 16 on all seven modules, median of 3):

- ``--engine smollm2-135m-instruct --max-tokens 32``: base 121 tok/s, 4 adapters + base
  103 tok/s (0.85x)
- ``--engine checkpoints/demo/target``: 0.68x (a 12M-parameter model: rank-16 adapters
  are relatively large next to its 384-wide layers, and each delta's small matmuls cost
  their dispatch)
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tandem.backends import cpu_kernels
from tandem.backends.lora.adapter import ATTENTION_MODULES, TARGET_MODULES, module_shapes
from tandem.backends.lora.ops import lora_delta_gathered, lora_delta_segmented, lora_segments

# (name, slot of each row): 4 adapters and the base, as a mixed serving batch has them
CASES = {"decode, 1 row": [1],
         "decode, 16 rows": [i % 5 for i in range(16)],
         "prefill, 256 rows": [1] * 256}


def time_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def write_random_adapter(out: Path, model_dir: str, rank: int, seed: int) -> Path:
    """A random PEFT-format adapter on all seven modules of ``model_dir``'s model."""
    from safetensors.torch import save_file
    from tandem.backends.models.config import ModelConfig
    cfg = ModelConfig.from_dir(model_dir)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for m, (fan_in, fan_out) in module_shapes(cfg).items():
            parent = "self_attn" if m in ATTENTION_MODULES else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
         "bias": "none", "fan_in_fan_out": False}))
    return out


def engine_throughput(model_dir: str, rank: int, concurrency: int, max_tokens: int,
                      repeats: int, prompt_len: int = 32) -> dict[str, list[float]]:
    """tokens/s of ``concurrency`` greedy requests, the base alone and 4 adapters + the
    base mixed (round robin), repeats interleaved; eager steps for both (compiled and
    graphed decode hold the base only)."""
    from tandem.backends.engine import LLM, SamplingParams
    from tandem.backends.lora.request import LoRARequest
    llm = LLM(model_dir, max_loras=4, max_lora_rank=rank, enforce_eager=True,
              enable_prefix_caching=False, max_num_seqs=max(concurrency, 1))
    model_dir = llm.engine.config.model_dir     # a packaged or GGUF model: its HF directory
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, llm.engine.model.config.vocab_size, (prompt_len,), generator=g).tolist()
               for _ in range(concurrency)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(Path(tmp) / f"a{i}", model_dir,
                                                                           rank, i)))
                    for i in range(4)]
        mixed = [([None] + adapters)[i % 5] for i in range(concurrency)]
        llm.generate(prompts[:2], params, lora=adapters[:2])     # warm-up, adapters loaded
        rates: dict[str, list[float]] = {"base": [], "mixed": []}
        for _ in range(repeats):
            for name, loras in (("base", None), ("mixed", mixed)):
                start = time.perf_counter()
                outs = llm.generate(prompts, params, lora=loras)
                rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    return rates


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", metavar="MODEL_DIR", help="measure the engine on this model instead")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--in-features", type=int, default=576)    # SmolLM2-135M's hidden size
    p.add_argument("--out-features", type=int, default=1536)  # ... and its MLP width
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.engine:
        rates = engine_throughput(args.engine, args.rank, args.concurrency, args.max_tokens,
                                  max(args.repeats // 10, 3))
        base, mixed = statistics.median(rates["base"]), statistics.median(rates["mixed"])
        print(f"{args.engine}: concurrency {args.concurrency}, {args.max_tokens} tokens each, rank "
              f"{args.rank}, eager: base alone {base:.0f} tok/s, 4 adapters + base {mixed:.0f} tok/s "
              f"({mixed / base:.2f}x); repeats {rates}")
        return 0
    dtype = getattr(torch, args.dtype)
    A = torch.randn(5, args.in_features, args.rank, dtype=dtype)
    B = torch.randn(5, args.rank, args.out_features, dtype=dtype)
    A[0] = B[0] = 0
    A32, B32 = A.float(), B.float()
    kernel = cpu_kernels.load("lora")
    widths = torch.tensor([0] + [args.rank] * 4, dtype=torch.int32)
    print(f"{'batch':<20}{'gathered µs':>14}{'segmented µs':>14}{'fused kernel µs':>17}   ({args.dtype} "
          f"activations, fp32 adapters in the kernel, in {args.in_features}, out {args.out_features}, "
          f"rank {args.rank})")
    for name, slots in CASES.items():
        x = torch.randn(len(slots), args.in_features, dtype=dtype)
        y = torch.zeros(len(slots), args.out_features, dtype=dtype)
        idx = torch.tensor(slots)
        segments = lora_segments(slots)
        g = time_us(lambda: lora_delta_gathered(x, A, B, idx), args.repeats)
        s = time_us(lambda: lora_delta_segmented(x, A, B, segments, out=y), args.repeats)
        k = time_us(lambda: torch.ops.tandem_cpu.lora_sgmv_(y, x, A32, B32, idx.int(), widths,
                                                            [0, args.out_features]),
                    args.repeats) if kernel else float("nan")
        print(f"{name:<20}{g:>14.0f}{s:>14.0f}{k:>17.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
