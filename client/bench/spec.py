"""Speculative decoding against plain decoding and HF transformers, side by side.

On the demo checkpoints: Tandem plain, draft-target, MTP and ngram (prompt lookup) at k = 1..5 (batch 1 and 8),
adaptive speculation (``auto``: ngram where it matches, the MTP head elsewhere, k per step
from measured costs and acceptance; ``<method>+adaptive``: one method, k adaptive),
HF ``generate`` plain, assisted generation (``assistant_model`` = the same draft) and
prompt-lookup decoding, all greedy on the same weights, dtype, threads and prompts.
Tokens/s per request stream: ``batch * new tokens / wall time`` of the whole generation
(speculation changes the decode steps, so the prefill is included for every row alike).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from typing import Callable

from tandem.client.bench.args import add_dtype, comma_list, model_path, names, positive_int, positive_ints
from tandem.client.bench.harness import timed
from tandem.client.bench.repeats import error_bars, fmt, spread
from tandem.client.bench.report import header, save_figure, write

DEMO = Path("checkpoints/demo")
DEFAULT_OUT = Path("docs/bench/spec.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=model_path, default=DEMO / "target")
    p.add_argument("--draft", type=Path, default=DEMO / "draft")
    p.add_argument("--mtp", type=Path, default=DEMO / "mtp")
    add_dtype(p)
    p.add_argument("--ks", type=positive_ints, default="1,2,3,4,5")
    p.add_argument("--batch-sizes", type=positive_ints, default="1,8")
    p.add_argument("--new-tokens", type=positive_int, default=96)
    p.add_argument("--num-prompts", type=positive_int, default=8, help="held-out prompts, cycled per batch")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers rows")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="runs of every row, interleaved (each row once per repeat); the tables "
                        "show the median and the spread")
    p.add_argument("--compile", action="store_true",
                   help="also plain and draft-target decoding with the CPU's compiled decode step "
                        "(EngineConfig.compile='all'; the other rows run eagerly): rows marked +compile")
    p.add_argument("--draft-vocab-sizes", type=comma_list(positive_int, allow_empty=True), default="",
                   help="also the draft and the MTP head over their N most frequent tokens "
                        "(FR-Spec; comma-separated sizes, e.g. 1024,2048; needs "
                        "token_frequencies.json in their checkpoints)")
    p.add_argument("--methods", type=names(*ROW_METHODS), default="draft_target,mtp,ngram,auto",
                   help=f"rows besides plain, of: {', '.join(ROW_METHODS)} (auto: --spec auto, adaptive k up "
                        "to the largest of --ks; +adaptive: that method with adaptive k)")
    p.add_argument("--engine", choices=("eager", "default"), default="eager",
                   help="eager: every Tandem row with enforce_eager; default: the engine's defaults, as "
                        "tandem serve runs it (compiled decode and verify steps where warm-up measured "
                        "them faster)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


ROW_METHODS = ("draft_target", "mtp", "ngram", "auto", "draft_target+adaptive", "mtp+adaptive",
               "ngram+adaptive")


def bench_prompt_ids(target: Path, n: int, tokenizer) -> list[list[int]]:
    """The first ``n`` of the target's held-out prompts (a few stock ones if it has none),
    each cut to 96 tokens so that decode, not prefill, dominates."""
    from tandem.backends.training.corpus import held_out_prompt_ids
    if (target / "prompts.json").exists():
        return held_out_prompt_ids(target / "prompts.json", tokenizer, n, 96, by_kind=False)
    texts = ["def fib(n):", "class Stack:", "import os\n", "    def __init__(self):"]
    return [tokenizer.encode(t).ids[-96:] for t in texts[:n]]


RunResult = dict   # tokens_per_s, acceptance_rate, mean_acceptance_length


def tandem_runner(target, dtype, prompts, new_tokens, speculative=None,
                  compile: bool | None = False) -> Callable[[], RunResult]:
    """An engine loaded and warmed up once; each call generates the batch again
    (``compile``: True compiles every bucket, None is the engine's default)."""
    from tandem.backends import LLM, SamplingParams
    mode = dict(compile="all") if compile else {} if compile is None else dict(enforce_eager=True)
    llm = LLM(target, dtype=dtype, speculative=speculative, max_num_seqs=max(8, len(prompts)), **mode)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))   # warm-up

    def run() -> RunResult:
        import time
        llm.engine.spec_metrics.reset()
        cpu = time.process_time()
        seconds = timed(lambda: llm.generate(prompts, params))
        cpu = time.process_time() - cpu
        m = llm.engine.spec_metrics
        return dict(tokens_per_s=new_tokens / seconds, tokens_per_cpu_s=new_tokens / cpu,
                    acceptance_rate=m.acceptance_rate if speculative else None,
                    mean_acceptance_length=m.mean_acceptance_length if speculative else None,
                    choices=m.as_dict()["steps_by_choice"] if speculative else None)
    return run


def hf_runner(target, dtype, prompts, new_tokens, **gen_kwargs) -> Callable[[], RunResult] | None:
    import torch
    from transformers import AutoModelForCausalLM
    if len(prompts) > 1 and gen_kwargs:
        return None  # HF assisted and prompt-lookup generation take batch 1 only
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
    if "assistant_model" in gen_kwargs:
        gen_kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(
            gen_kwargs["assistant_model"], dtype=getattr(torch, dtype)).eval()

    def generate():
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
    generate()   # warm-up, as the engines get

    def run() -> RunResult:
        return dict(tokens_per_s=new_tokens / timed(generate), tokens_per_cpu_s=None, acceptance_rate=None,
                    mean_acceptance_length=None)
    return run


def label(method: str, vocab: int | None) -> str:
    """A method's name in the table: ``mtp``, or ``mtp/v1024`` over a 1024-token vocabulary."""
    return method if vocab is None else f"{method}/v{vocab}"


def runners_for(args, prompts) -> list[tuple[tuple, Callable[[], RunResult]]]:
    """Every row of one batch size: ((system, method, k), run) in table order."""
    from tandem.backends import SpeculativeConfig
    methods = []
    vocabs = [None, *args.draft_vocab_sizes]
    has = {"draft_target": (args.draft / "config.json").exists(), "mtp": (args.mtp / "config.json").exists(),
           "ngram": True}
    paths = {"draft_target": dict(draft_model=str(args.draft)), "mtp": dict(mtp_head=str(args.mtp)),
             "ngram": {}}
    for vocab in vocabs:
        for method in ("draft_target", "mtp", "ngram"):
            if method in args.methods and has[method] and (vocab is None or method != "ngram"):
                methods.append((method, vocab, paths[method]))
    compile = None if args.engine == "default" else False
    run_of = lambda target, spec=None: tandem_runner(target, args.dtype, prompts, args.new_tokens, spec,
                                                     compile=compile)
    rows = [(("tandem", "none", 0), run_of(args.target))]
    if has["draft_target"] and "draft_target" in args.methods:   # the draft alone: its cost per token
        rows.append((("tandem", "draft_alone", 0), run_of(args.draft)))
    for method, vocab, kw in methods:
        for k in args.ks:
            spec = SpeculativeConfig(method, k, draft_vocab_size=vocab, **kw)
            rows.append((("tandem", label(method, vocab), k), run_of(args.target, spec)))
    k_max = max(args.ks)
    for name in args.methods:     # adaptive rows: k up to the largest of --ks
        if name == "auto":
            spec = SpeculativeConfig("auto", k_max, mtp_head=str(args.mtp) if has["mtp"] else None,
                                     draft_model=str(args.draft) if has["draft_target"] else None,
                                     adaptive=True)
        elif name.endswith("+adaptive") and has.get(name.split("+")[0]):
            spec = SpeculativeConfig(name.split("+")[0], k_max, adaptive=True, **paths[name.split("+")[0]])
        else:
            continue
        rows.append((("tandem", name, k_max), run_of(args.target, spec)))
    if args.compile:
        rows.append((("tandem", "none+compile", 0),
                     tandem_runner(args.target, args.dtype, prompts, args.new_tokens, compile=True)))
        if (args.draft / "config.json").exists():
            for k in args.ks:
                spec = SpeculativeConfig("draft_target", k, draft_model=str(args.draft))
                rows.append((("tandem", "draft_target+compile", k),
                             tandem_runner(args.target, args.dtype, prompts, args.new_tokens,
                                           spec, compile=True)))
    if not args.no_hf:
        hf = [(("hf", "none", 0), hf_runner(args.target, args.dtype, prompts, args.new_tokens))]
        if (args.draft / "config.json").exists():
            hf.append((("hf", "assisted", 0), hf_runner(args.target, args.dtype, prompts,
                                                        args.new_tokens, assistant_model=args.draft)))
        hf.append((("hf", "prompt_lookup", 0), hf_runner(args.target, args.dtype, prompts,
                                                         args.new_tokens, prompt_lookup_num_tokens=3)))
        rows += [(key, r) for key, r in hf if r is not None]
    return rows


def run(args) -> int:
    import torch
    torch.set_num_threads(args.threads)
    from tandem.backends.models.tokenizer import load_tokenizer
    if not (args.target / "config.json").exists():
        raise SystemExit(f"--target {args.target}: no checkpoint (train it: see checkpoints/demo/README.md)")
    tok = load_tokenizer(args.target)
    base_prompts = bench_prompt_ids(args.target, args.num_prompts, tok)
    print(f"target {args.target}, {args.dtype}, {args.threads} threads, {args.new_tokens} new tokens, "
          f"greedy, {args.repeats} interleaved repeats; tok/s per request stream")
    print(f"{'batch':>5} {'system':>7} {'method':>16} {'k':>3} {'tok/s median (min-max)':>24}  "
          "acceptance  length")
    rows = []
    for batch in args.batch_sizes:
        prompts = [base_prompts[i % len(base_prompts)] for i in range(batch)]
        runners = runners_for(args, prompts)
        runs: dict[tuple, list[RunResult]] = {key: [] for key, _ in runners}
        for _ in range(args.repeats):          # every row once per repeat: interleaved
            for key, run_once in runners:
                runs[key].append(run_once())
        for (system, method, k), results in runs.items():
            row = dict(batch=batch, system=system, method=method, k=k,
                       **{name: spread([r[name] for r in results]) for name in RESULT_KEYS})
            if results and results[-1].get("choices"):
                row["choices_last_run"] = results[-1]["choices"]
            rows.append(row)
            acc = "" if row["acceptance_rate"]["median"] is None else \
                f"{row['acceptance_rate']['median']:.2f}  {row['mean_acceptance_length']['median']:.2f}"
            print(f"{batch:>5} {system:>7} {method:>16} {k if k else '-':>3} "
                  f"{fmt(row['tokens_per_s']):>24}  {acc}  per CPU s {fmt(row['tokens_per_cpu_s'])}",
                  flush=True)
    result = dict(**header("spec", args), target=str(args.target), dtype=args.dtype,
                  new_tokens=args.new_tokens, repeats=args.repeats, rows=rows,
                  summary=summarize(rows))
    write(result, args.out)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {args.out}, {plot(rows, args.out, result)}")
    return 0


# tokens per CPU second as well: on a shared host the wall time includes waiting for a core
RESULT_KEYS = ("tokens_per_s", "tokens_per_cpu_s", "acceptance_rate", "mean_acceptance_length")
SPECULATIVE = ("draft_target", "mtp", "ngram", "auto")


def base_method(method: str) -> str:
    """``mtp/v1024`` and ``draft_target+compile`` are variants of mtp and draft_target."""
    return method.split("/")[0].split("+")[0]


def per_run(rows: list[dict], key: tuple, metric: str = "tokens_per_s") -> list[float] | None:
    r = next((r for r in rows if (r["system"], r["method"], r["k"]) == key), None)
    return None if r is None else r[metric]["runs"]


def ratio(a: list[float] | None, b: list[float] | None) -> dict | None:
    """The spread of a/b taken run by run (the rows of one repeat ran side by side)."""
    if not a or not b:
        return None
    return spread([x / y for x, y in zip(a, b) if x and y])


def summarize(rows: list[dict]) -> dict:
    """Per batch size, medians over the repeats with their spread: the faster plain
    (eager or compiled) against HF plain;
    the best speculative row (highest median) against plain, HF assisted generation and
    HF prompt lookup; the draft's cost per token relative to the target's."""
    out = {}
    for batch in sorted({r["batch"] for r in rows}):
        rs = [r for r in rows if r["batch"] == batch]
        plains = [r for r in rs if r["system"] == "tandem" and base_method(r["method"]) == "none"]
        fastest = max(plains, key=lambda r: r["tokens_per_s"]["median"], default=None)
        plain = None if fastest is None else fastest["tokens_per_s"]["runs"]
        spec = [r for r in rs if r["system"] == "tandem" and base_method(r["method"]) in SPECULATIVE]
        row = {"plain": fastest and fastest["method"], "plain_tok_s": spread(plain or [])["median"],
               "plain_over_hf_plain": ratio(plain, per_run(rs, ("hf", "none", 0)))}
        if spec and plain:
            best = max(spec, key=lambda r: r["tokens_per_s"]["median"])
            key = ("tandem", best["method"], best["k"])
            row.update(best=f"{best['method']} k={best['k']}",
                       best_tok_s=best["tokens_per_s"]["median"],
                       speedup_over_plain=ratio(per_run(rs, key), plain),
                       speedup_over_hf_assisted=ratio(per_run(rs, key),
                                                      per_run(rs, ("hf", "assisted", 0))),
                       speedup_over_hf_prompt_lookup=ratio(per_run(rs, key),
                                                           per_run(rs, ("hf", "prompt_lookup", 0))))
        for auto in sorted({r["method"] for r in rs if r["method"] == "auto" or r["method"].endswith("+adaptive")}):
            a = next(r for r in rs if r["method"] == auto)
            row[f"{auto}_over_plain"] = ratio(per_run(rs, ("tandem", auto, a["k"])), plain)
            row[f"{auto}_over_plain_cpu"] = ratio(per_run(rs, ("tandem", auto, a["k"]), "tokens_per_cpu_s"),
                                                  per_run(rs, ("tandem", "none", 0), "tokens_per_cpu_s"))
        fixed = [r for r in spec if r["method"] in ("draft_target", "mtp", "ngram")]
        if fixed and plain:
            best = max(fixed, key=lambda r: r["tokens_per_s"]["median"])
            row["best_fixed"] = f"{best['method']} k={best['k']}"
            row["best_fixed_over_plain"] = ratio(per_run(rs, ("tandem", best["method"], best["k"])), plain)
            row["best_fixed_over_plain_cpu"] = ratio(
                per_run(rs, ("tandem", best["method"], best["k"]), "tokens_per_cpu_s"),
                per_run(rs, ("tandem", "none", 0), "tokens_per_cpu_s"))
        draft = per_run(rs, ("tandem", "draft_alone", 0))
        if draft and plain:
            row["draft_cost_over_target_cost"] = ratio(plain, draft)
        out[f"batch {batch}"] = {k: v for k, v in row.items() if v is not None}
    return out


def plot(rows: list[dict], out: Path, report: dict) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 3.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rs = [r for r in rows if r["batch"] == batch]
        methods = sorted({r["method"] for r in rs if base_method(r["method"]) in SPECULATIVE})
        for method in methods:
            m = sorted((r for r in rs if r["method"] == method), key=lambda r: r["k"])
            med, err = error_bars([r["tokens_per_s"] for r in m])
            ax.errorbar([r["k"] for r in m], med, yerr=err, fmt="o-", capsize=2, label=method)
        for system, method, style in (("tandem", "none", "k--"), ("hf", "none", "c:"),
                                      ("hf", "assisted", "m:"), ("hf", "prompt_lookup", "y:")):
            r = next((r for r in rs if r["system"] == system and r["method"] == method), None)
            if r:
                ax.axhline(r["tokens_per_s"]["median"], ls=style[1:], color=style[0],
                           label=f"{system} {method if method != 'none' else 'plain'}")
        ax.set_xlabel("k (draft tokens per step)"); ax.set_ylabel("tokens/s per request (median)")
        ax.set_title(f"batch {batch}"); ax.legend(fontsize=7)
    return save_figure(fig, out.with_suffix(".png"), report)
