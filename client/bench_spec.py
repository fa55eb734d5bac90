"""Speculative decoding against plain decoding and HF transformers, side by side.

On the demo checkpoints: Tandem plain, draft-target, MTP and ngram (prompt lookup) at k = 1..5 (batch 1 and 8),
HF ``generate`` plain, assisted generation (``assistant_model`` = the same draft) and
prompt-lookup decoding, all greedy on the same weights, dtype, threads and prompts.
Tokens/s per request stream: ``batch * new tokens / wall time`` of the whole generation
(speculation changes the decode steps, so the prefill is included for every row alike).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .bench_common import timed
from .bench_report import header, save_figure, write

DEMO = Path("checkpoints/demo")
DEFAULT_OUT = Path("docs/bench/spec.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=DEMO / "target")
    p.add_argument("--draft", type=Path, default=DEMO / "draft")
    p.add_argument("--mtp", type=Path, default=DEMO / "mtp")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--ks", default="1,2,3,4,5")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--num-prompts", type=int, default=8, help="held-out prompts, cycled per batch")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers rows")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def bench_prompt_ids(target: Path, n: int, tokenizer) -> list[list[int]]:
    """The first ``n`` of the target's held-out prompts (a few stock ones if it has none),
    each cut to 96 tokens so that decode, not prefill, dominates."""
    from tandem.backends.training.corpus import held_out_prompt_ids
    if (target / "prompts.json").exists():
        return held_out_prompt_ids(target / "prompts.json", tokenizer, n, 96, by_kind=False)
    texts = ["def fib(n):", "class Stack:", "import os\n", "    def __init__(self):"]
    return [tokenizer.encode(t).ids[-96:] for t in texts[:n]]


def tandem_row(target, dtype, prompts, new_tokens, speculative=None) -> dict:
    from tandem.backends import LLM, SamplingParams
    llm = LLM(target, dtype=dtype, speculative=speculative, max_num_seqs=max(8, len(prompts)))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    llm.engine.spec_metrics.reset()
    seconds = timed(lambda: llm.generate(prompts, params))
    m = llm.engine.spec_metrics
    return dict(tokens_per_s=len(prompts) * new_tokens / seconds / len(prompts),
                acceptance_rate=m.acceptance_rate if speculative else None,
                mean_acceptance_length=m.mean_acceptance_length if speculative else None)


def hf_row(target, dtype, prompts, new_tokens, **gen_kwargs) -> dict | None:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
    if "assistant_model" in gen_kwargs:
        gen_kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(
            gen_kwargs["assistant_model"], dtype=getattr(torch, dtype)).eval()
    if len(prompts) > 1 and gen_kwargs:
        return None  # HF assisted and prompt-lookup generation take batch 1 only

    def run():
        with torch.inference_mode():
            if len(prompts) == 1:
                ids = torch.tensor(prompts)
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               pad_token_id=0, **gen_kwargs)
            else:  # left-padded batch
                width = max(map(len, prompts))
                ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
                model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, pad_token_id=0)
    seconds = timed(run)
    return dict(tokens_per_s=new_tokens / seconds, acceptance_rate=None, mean_acceptance_length=None)


def run(args) -> int:
    import torch
    torch.set_num_threads(args.threads)
    from tandem.backends import SpeculativeConfig
    from tandem.backends.models.tokenizer import load_tokenizer
    if not (args.target / "config.json").exists():
        raise SystemExit(f"--target {args.target}: no checkpoint (train it: see checkpoints/demo/README.md)")
    tok = load_tokenizer(args.target)
    base_prompts = bench_prompt_ids(args.target, args.num_prompts, tok)
    methods = []
    if (args.draft / "config.json").exists():
        methods.append(("draft_target", dict(draft_model=str(args.draft))))
    if (args.mtp / "config.json").exists():
        methods.append(("mtp", dict(mtp_head=str(args.mtp))))
    methods.append(("ngram", {}))   # prompt lookup: no model
    rows = []

    def add(batch, system, method, k, r):
        if r is None:
            return
        rows.append(dict(batch=batch, system=system, method=method, k=k, **r))
        acc = "" if r["acceptance_rate"] is None else \
            f"{r['acceptance_rate']:.2f}  {r['mean_acceptance_length']:.2f}"
        print(f"{batch:>5} {system:>7} {method:>13} {k if k else '-':>3} "
              f"{r['tokens_per_s']:>9.1f}  {acc}", flush=True)

    print(f"target {args.target}, {args.dtype}, {args.threads} threads, {args.new_tokens} new tokens, "
          "greedy; tok/s per request stream")
    print(f"{'batch':>5} {'system':>7} {'method':>13} {'k':>3} {'tok/s':>9}  acceptance  length")
    for batch in map(int, args.batch_sizes.split(",")):
        prompts = [base_prompts[i % len(base_prompts)] for i in range(batch)]
        add(batch, "tandem", "none", 0, tandem_row(args.target, args.dtype, prompts, args.new_tokens))
        if (args.draft / "config.json").exists():   # the draft decoding alone: its cost per token
            add(batch, "tandem", "draft_alone", 0,
                tandem_row(args.draft, args.dtype, prompts, args.new_tokens))
        for method, paths in methods:
            for k in map(int, args.ks.split(",")):
                spec = SpeculativeConfig(method, k, **paths)
                add(batch, "tandem", method, k,
                    tandem_row(args.target, args.dtype, prompts, args.new_tokens, spec))
        if not args.no_hf:
            add(batch, "hf", "none", 0, hf_row(args.target, args.dtype, prompts, args.new_tokens))
            if (args.draft / "config.json").exists():
                add(batch, "hf", "assisted", 0, hf_row(args.target, args.dtype, prompts,
                                                       args.new_tokens, assistant_model=args.draft))
            add(batch, "hf", "prompt_lookup", 0, hf_row(args.target, args.dtype, prompts,
                                                        args.new_tokens, prompt_lookup_num_tokens=3))
    result = dict(**header("spec", args), target=str(args.target), dtype=args.dtype,
                  new_tokens=args.new_tokens, rows=rows, summary=summarize(rows))
    write(result, args.out)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {args.out}, {plot(rows, args.out, result)}")
    return 0


def summarize(rows: list[dict]) -> dict:
    """Per batch size: the best speculative row against plain decoding and against HF's
    assisted generation, and the draft's cost per token relative to the target's."""
    out = {}
    for batch in sorted({r["batch"] for r in rows}):
        rs = {(r["system"], r["method"], r["k"]): r["tokens_per_s"] for r in rows if r["batch"] == batch}
        plain = rs.get(("tandem", "none", 0))
        spec = {k: v for k, v in rs.items() if k[0] == "tandem" and k[1] in ("draft_target", "mtp")}
        best = max(spec, key=spec.get) if spec else None
        row = {"plain_tok_s": plain}
        if best is not None and plain:
            row.update(best=f"{best[1]} k={best[2]}", best_tok_s=round(spec[best], 1),
                       speedup_over_plain=round(spec[best] / plain, 2))
            hf = rs.get(("hf", "assisted", 0))
            if hf:
                row["speedup_over_hf_assisted"] = round(spec[best] / hf, 2)
        draft = rs.get(("tandem", "draft_alone", 0))
        if draft and plain:
            row["draft_cost_over_target_cost"] = round(plain / draft, 3)
        out[f"batch {batch}"] = row
    return out


def plot(rows: list[dict], out: Path, report: dict) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 3.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rs = [r for r in rows if r["batch"] == batch]
        for method in ("draft_target", "mtp", "ngram"):
            m = sorted((r for r in rs if r["method"] == method), key=lambda r: r["k"])
            if m:
                ax.plot([r["k"] for r in m], [r["tokens_per_s"] for r in m], "o-", label=method)
        for system, method, style in (("tandem", "none", "k--"), ("hf", "none", "c:"),
                                      ("hf", "assisted", "m:"), ("hf", "prompt_lookup", "y:")):
            r = next((r for r in rs if r["system"] == system and r["method"] == method), None)
            if r:
                ax.axhline(r["tokens_per_s"], ls=style[1:], color=style[0],
                           label=f"{system} {method if method != 'none' else 'plain'}")
        ax.set_xlabel("k (draft tokens per step)"); ax.set_ylabel("tokens/s per request")
        ax.set_title(f"batch {batch}"); ax.legend(fontsize=7)
    return save_figure(fig, out.with_suffix(".png"), report)
