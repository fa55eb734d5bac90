"""Structured output: what a guide costs the decoder, and whether every output is valid.

On the demo checkpoints, in the engine (no server), sampling at temperature 1:

- latency: inter-token latency (per token: the gap between a request's emissions shared
  by the tokens they carried) and output tokens/s of a batch, with a JSON-schema guide
  and without (``ignore_eos``, the same number of tokens), for plain decoding and each
  speculation method, rounds interleaved;
- validity: ``--samples`` outputs per guide type (json_schema, regex, ebnf_grammar,
  json) with speculation on, each checked (parsed and validated against its schema /
  matched / parsed by its grammar); an output cut by max_tokens is counted apart.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from tandem.client.bench.args import add_dtype, model_path, names, non_negative_int, positive_int, positive_ints
from tandem.client.bench.report import header, write
from tandem.client.bench.stats import percentile

DEMO = Path("checkpoints/demo")
DEFAULT_OUT = Path("docs/bench/guided.json")
METHODS = ("none", "draft_target", "mtp", "ngram")
# a schema whose answer takes ~50-70 tokens of this tokenizer: long enough to time
SCHEMA = {"type": "object", "required": ["id", "tags"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                         "tags": {"type": "array", "minItems": 12, "maxItems": 12,
                                  "items": {"type": "string", "maxLength": 6}}}}
REGEX = r"[a-z]{2,8}(\.[a-z]{2,8}){0,2}@[a-z]{2,10}\.(com|org|net)"
EBNF = 'root ::= "[" item ("," item){0,7} "]"\nitem ::= [a-z]{1,8} "=" [0-9] [0-9]?'
GUIDES = {"json_schema": json.dumps(SCHEMA), "regex": REGEX, "ebnf_grammar": EBNF, "json": ""}
PROMPTS = ["def main():", "import os\n", "class Path:", "# settings\n", "    return", "x = "]


def valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "ebnf_grammar":
        return re.fullmatch(r"\[[a-z]{1,8}=[0-9][0-9]?(,[a-z]{1,8}=[0-9][0-9]?){0,7}\]", text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if kind == "json":
        return True
    return (isinstance(value, dict) and set(value) == {"id", "tags"} and type(value["id"]) is int
            and 0 <= value["id"] <= 99999 and isinstance(value["tags"], list) and len(value["tags"]) == 12
            and all(isinstance(t, str) and len(t) <= 6 for t in value["tags"]))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=model_path, default=DEMO / "target")
    p.add_argument("--draft", type=Path, default=DEMO / "draft")
    p.add_argument("--mtp", type=Path, default=DEMO / "mtp")
    add_dtype(p)
    p.add_argument("--methods", type=names(*METHODS), default=",".join(METHODS))
    p.add_argument("--k", type=positive_int, default=3, help="speculative tokens per step")
    p.add_argument("--batch-sizes", type=positive_ints, default="1,8")
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds per row")
    p.add_argument("--samples", type=non_negative_int, default=200, help="outputs per guide type (0: no validity run)")
    p.add_argument("--validity-method", choices=METHODS, default="draft_target")
    p.add_argument("--validity-batch", type=positive_int, default=16, help="samples generated at once")
    p.add_argument("--validity-max-tokens", type=positive_int, default=192)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def speculative(args, method: str):
    from tandem.backends import SpeculativeConfig
    if method == "none":
        return None
    extra = {"draft_target": dict(draft_model=str(args.draft)), "mtp": dict(mtp_head=str(args.mtp)),
             "ngram": {}}[method]
    return SpeculativeConfig(method, args.k, **extra)


def timed_batch(llm, params, batch: int) -> tuple[list[float], int, float]:
    """Per-token gaps, tokens and seconds of one batch stepped to the end."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request(PROMPTS[i % len(PROMPTS)], params)
    last: dict[str, float] = {}
    gaps: list[float] = []
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = len(out.new_token_ids)
            if not n:
                continue
            tokens += n
            if out.request_id in last:      # the first token's gap is TTFT, not ITL
                gaps += [(now - last[out.request_id]) / n] * n
            last[out.request_id] = now
    return gaps, tokens, time.perf_counter() - start


def latency(args) -> list[dict]:
    from tandem.backends import LLM, SamplingParams
    from tandem.backends.engine.params import GuidedDecoding

    rows = []
    guide = GuidedDecoding("json_schema", GUIDES["json_schema"])
    for method in args.methods:
        llm = LLM(str(args.target), dtype=args.dtype, speculative=speculative(args, method),
                  max_num_seqs=max(args.batch_sizes))
        free = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
        # the guided answer ends with the schema (~50-70 tokens); its max_tokens is a bound only
        guided = SamplingParams(max_tokens=4 * args.new_tokens, temperature=1.0, guided_decoding=guide)
        timed_batch(llm, guided, 1)      # warm-up: compiles the guide, imports xgrammar
        timed_batch(llm, free, 1)
        for batch in args.batch_sizes:
            acc = {"free": ([], 0, 0.0), "guided": ([], 0, 0.0)}
            for _ in range(args.rounds):
                for name, params in (("free", free), ("guided", guided)):
                    g, t, s = timed_batch(llm, params, batch)
                    acc[name] = (acc[name][0] + g, acc[name][1] + t, acc[name][2] + s)
            row = dict(method=method, batch=batch)
            for name, (g, t, s) in acc.items():
                row[name] = dict(itl_p50_ms=1e3 * percentile(g, 50), itl_p99_ms=1e3 * percentile(g, 99),
                                 tokens_per_s=t / s, tokens=t)
            row["itl_p50_ratio"] = row["guided"]["itl_p50_ms"] / row["free"]["itl_p50_ms"]
            rows.append(row)
            print(f"{method:>12} batch {batch}: ITL p50 {row['free']['itl_p50_ms']:.2f} -> "
                  f"{row['guided']['itl_p50_ms']:.2f} ms ({row['itl_p50_ratio']:.3f}x), tok/s "
                  f"{row['free']['tokens_per_s']:.1f} -> {row['guided']['tokens_per_s']:.1f}", flush=True)
    return rows


def validity(args) -> list[dict]:
    from tandem.backends import LLM, SamplingParams
    from tandem.backends.engine.params import GuidedDecoding

    llm = LLM(str(args.target), dtype=args.dtype, speculative=speculative(args, args.validity_method),
              max_num_seqs=args.validity_batch)
    rows = []
    for kind, guide in GUIDES.items():
        params = SamplingParams(max_tokens=args.validity_max_tokens, temperature=1.0,
                                guided_decoding=GuidedDecoding(kind, guide))
        outs = []
        for start in range(0, args.samples, args.validity_batch):
            n = min(args.validity_batch, args.samples - start)
            outs += llm.generate([PROMPTS[(start + i) % len(PROMPTS)] for i in range(n)], params)
        ended = [o for o in outs if o.finish_reason == "stop"]
        row = dict(guide_type=kind, method=args.validity_method, samples=len(outs), ended=len(ended),
                   valid=sum(valid(kind, o.text) for o in ended), cut_by_max_tokens=len(outs) - len(ended),
                   examples=[o.text for o in ended[:2]])
        rows.append(row)
        print(f"{kind:>12}: {row['valid']}/{row['ended']} valid of {row['samples']} "
              f"({row['cut_by_max_tokens']} cut by max_tokens={args.validity_max_tokens})", flush=True)
    return rows


def run(args) -> int:
    import torch
    torch.set_num_threads(args.threads)
    report = header("guided", args)
    report["latency"] = latency(args) if args.methods else []
    report["validity"] = validity(args) if args.samples else []
    write(report, args.out)
    print(f"wrote {args.out}")
    return 0
