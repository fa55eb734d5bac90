"""Engine decode speed against HF transformers ``generate``, side by side in one run.

Same weights, dtype, thread count and prompts. Decode tokens/s excludes the prefill:
``batch * (N - 1) / (t(N new tokens) - t(1 new token))``.
"""
from __future__ import annotations

import argparse
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from tandem.client.bench.args import add_dtype, at_least, positive_int, positive_ints
from tandem.client.bench.harness import timed
from tandem.client.bench.report import command, save_figure, write

DEFAULT_OUT = Path("docs/bench/engine.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint dir (default: checkpoints/demo/target, else a generated "
                        "fixed-size random Llama in .cache/bench-llama)")
    add_dtype(p)
    p.add_argument("--batch-sizes", type=positive_ints, default="1,8,16,32")
    p.add_argument("--prompt-len", type=positive_int, default=64)
    # decode tokens/s is timed as t(N) - t(1): one new token is no decode
    p.add_argument("--new-tokens", type=at_least(2), default=64)
    p.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=positive_int, default=2, help="best of N timings")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def bench_model_dir() -> Path:
    demo = Path("checkpoints/demo/target")
    if (demo / "config.json").exists():
        return demo
    out = Path(".cache/bench-llama")
    if not (out / "config.json").exists():
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                          max_position_embeddings=1024, tie_word_embeddings=True)
        LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def tandem_decode_tps(model_dir, dtype, prompts, new_tokens, repeats) -> float:
    from tandem.backends import LLM, SamplingParams
    llm = LLM(model_dir, dtype=dtype, max_num_seqs=len(prompts),
              max_num_batched_tokens=max(512, sum(map(len, prompts))))
    run = lambda n: llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    run(2)  # warm-up
    t_n, t_1 = timed(lambda: run(new_tokens), repeats), timed(lambda: run(1), repeats)
    return len(prompts) * (new_tokens - 1) / (t_n - t_1)


def hf_decode_tps(model_dir, dtype, prompts, new_tokens, repeats) -> float:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(n):
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=0)
    run(2)
    t_n, t_1 = timed(lambda: run(new_tokens), repeats), timed(lambda: run(1), repeats)
    return len(prompts) * (new_tokens - 1) / (t_n - t_1)


def run(args) -> int:
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else bench_model_dir()
    from tandem.backends.models import ModelConfig
    cfg = ModelConfig.from_dir(model_dir)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"model {model_dir} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}), "
          f"{args.dtype}, {args.threads} threads, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens")
    print(f"{'batch':>5} {'tandem tok/s':>13} {'HF tok/s':>10} {'ratio':>6}")
    for b in args.batch_sizes:
        prompts = torch.randint(3, cfg.vocab_size, (b, args.prompt_len), generator=g).tolist()
        ours = tandem_decode_tps(model_dir, args.dtype, prompts, args.new_tokens, args.repeats)
        hf = hf_decode_tps(model_dir, args.dtype, prompts, args.new_tokens, args.repeats)
        rows.append(dict(batch=b, tandem_tokens_per_s=round(ours, 1), hf_tokens_per_s=round(hf, 1),
                         ratio=round(ours / hf, 2)))
        print(f"{b:>5} {ours:>13.1f} {hf:>10.1f} {ours / hf:>6.2f}", flush=True)
    result = dict(benchmark="engine", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  machine=f"{platform.machine()} {torch.get_num_threads()} threads, "
                          f"{platform.processor() or platform.platform()}",
                  model=str(model_dir), dtype=args.dtype, prompt_len=args.prompt_len,
                  new_tokens=args.new_tokens, rows=rows)
    result["command"] = command("engine", args)
    write(result, args.out)
    print(f"wrote {args.out}, {plot(rows, args.out, result)}")
    return 0


def plot(rows: list[dict], out: Path, report: dict) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["tandem_tokens_per_s"] for r in rows], 0.4, label="Tandem")
    ax.bar([x + 0.2 for x in xs], [r["hf_tokens_per_s"] for r in rows], 0.4, label="HF generate")
    ax.set_xticks(list(xs), [str(r["batch"]) for r in rows])
    ax.set_xlabel("batch"); ax.set_ylabel("decode tokens/s (all sequences)"); ax.legend()
    return save_figure(fig, out.with_suffix(".png"), report)
