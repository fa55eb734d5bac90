"""``tandem bench tp``: a decode step split over N tensor-parallel ranks (one thread
each: a core per rank on a 2-core machine) against one rank with 2 threads, at batch 1
and 16, and a prefill forward of one ``--prefill-tokens`` prompt, per model and dtype. N is ``--tp``, or by default the smallest size above 1
that splits the model (2 for the demo; 3 for SmolLM2-135M, whose 9 heads and 3 KV heads
2 does not divide: 3 ranks then share the 2 cores).

Both sides are the engine's own (``LLMEngine`` with ``enforce_eager``: a compiled step
holds a whole model, so tensor parallelism runs eager, and one rank runs eager here too
for a like-for-like step): ``runner.forward`` over a batch whose sequences each have
``--context`` tokens of KV, then the logits of each sequence's last row, in wall ms
(two processes work in a TP step, so one process's CPU time would not count it). The
variants take turns (interleaved repeats) and each figure is the median with its spread.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from tandem.client.bench.args import CommaList, model_path, names, non_negative_int, positive_int, positive_ints
from tandem.client.bench.repeats import fmt, spread
from tandem.client.bench.report import cpu_info, header, write

THREADS = 2      # one rank's threads; N ranks share them out (at least one each)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=lambda s: CommaList(s.split(",")), default="demo,smollm2-135m-instruct",
                   help="comma list of what --model takes (demo, a packaged name, a directory or .gguf)")
    p.add_argument("--dtypes", type=names("float32", "bfloat16"), default="float32,bfloat16")
    p.add_argument("--batch-sizes", type=positive_ints, default="1,16")
    p.add_argument("--tp", type=positive_int, default=None,
                   help="ranks of the split side (default: the smallest size above 1 that splits each model)")
    p.add_argument("--context", type=positive_int, default=128, help="tokens already in each sequence's KV")
    p.add_argument("--prefill-tokens", type=non_negative_int, default=512,
                   help="tokens of the one prompt a prefill forward computes (0: no prefill row)")
    p.add_argument("--steps", type=positive_int, default=30, help="decode steps per measurement")
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs of every variant")
    p.add_argument("--out", type=Path, default=Path("docs/bench/tp.json"))


def make_engine(model_dir: Path, dtype: str, tp: int, threads: int, max_seqs: int, pages: int):
    import torch

    from tandem.backends.engine.config import EngineConfig
    from tandem.backends.engine.llm_engine import LLMEngine
    torch.set_num_threads(threads)       # a TP group shares these out: one per rank
    return LLMEngine(EngineConfig(str(model_dir), dtype=dtype, tensor_parallel_size=tp, enforce_eager=True,
                                  enable_prefix_caching=False, max_num_seqs=max_seqs, num_pages=pages))


def smallest_split(model_dir: Path) -> int:
    """The smallest rank count above 1 that splits the model's heads and MLP."""
    from tandem.backends.models.config import ModelConfig
    from tandem.backends.parallel.sharding import check_tp
    cfg = ModelConfig.from_dir(str(model_dir))
    for tp in range(2, cfg.num_attention_heads + 1):
        try:
            check_tp(cfg, tp)
            return tp
        except ValueError:
            continue
    raise ValueError(f"{model_dir}: no rank count above 1 splits this model")


def decode_batch(batch: int, context: int, page_size: int):
    """``batch`` sequences' next token at position ``context``."""
    from tandem.backends.engine.model_runner import ForwardBatch
    per_seq = -(-(context + 1) // page_size)
    return ForwardBatch([[5]] * batch, [context] * batch,
                        [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)])


def prefill_batch(tokens: int, page_size: int):
    """One prompt of ``tokens`` tokens from position 0 (as the prefill engine runs a chunk)."""
    from tandem.backends.engine.model_runner import ForwardBatch
    return ForwardBatch([[5 + i % 100 for i in range(tokens)]], [0], [list(range(-(-tokens // page_size)))])


def step_ms(engine, fb, steps: int) -> float:
    """Wall ms per forward of ``fb`` (and the logits of each sequence's last row)."""
    import torch

    runner = engine.runner

    def one():
        inputs, hidden = runner.forward(fb)
        runner.logits(hidden[inputs.last_rows])

    with torch.inference_mode():
        for _ in range(3):
            one()
        start = time.perf_counter()
        for _ in range(steps):
            one()
    return 1000 * (time.perf_counter() - start) / steps


def run(args: argparse.Namespace) -> int:
    import torch
    rows = []
    print(f"CPU {cpu_info()['model']} ({', '.join(cpu_info()['flags'])})", flush=True)
    report = {**header("tp", args), "context": args.context, "steps": args.steps, "repeats": args.repeats,
              "threads_per_rank": 1, "threads_one_rank": THREADS}
    for name in args.models:
        model_dir = model_path(name)
        tp = args.tp or smallest_split(model_dir)
        for dtype in args.dtypes:
            pages = max(max(args.batch_sizes) * -(-(args.context + 1) // 16), -(-args.prefill_tokens // 16))
            engines = {}
            try:
                for size in (1, tp):
                    engines[size] = make_engine(model_dir, dtype, size, THREADS, max(args.batch_sizes), pages)
                ps = engines[1].config.page_size
                steps = [("decode", b, decode_batch(b, args.context, ps), args.steps) for b in args.batch_sizes]
                if args.prefill_tokens:   # a prefill forward is long: fewer of them
                    steps.append(("prefill", 1, prefill_batch(args.prefill_tokens, ps), max(1, args.steps // 10)))
                for kind, batch, fb, n in steps:
                    runs: dict[int, list[float]] = {size: [] for size in engines}
                    for _ in range(args.repeats):
                        for size, engine in engines.items():
                            # one rank computes on 2 threads; a split's leader on its share
                            torch.set_num_threads(engine.tp_group.threads if engine.tp_group else THREADS)
                            runs[size].append(step_ms(engine, fb, n))
                    row = dict(model=name, dtype=dtype, step=kind, batch=batch, tokens=sum(map(len, fb.token_ids)),
                               tp=tp, tp1_ms=spread(runs[1]), tpn_ms=spread(runs[tp]),
                               tpn_over_tp1=spread([b / a for a, b in zip(runs[1], runs[tp])]))
                    rows.append(row)
                    print(f"{row['model']} {dtype} {label(row)}: TP 1 ({THREADS} threads) {fmt(row['tp1_ms'], 2)} ms"
                          f"  TP {tp} (1 thread per rank) {fmt(row['tpn_ms'], 2)} ms  TP{tp}/TP1 "
                          f"{fmt(row['tpn_over_tp1'], 2)}", flush=True)
            finally:
                for engine in engines.values():
                    engine.close()
    report["rows"] = rows
    write(report, args.out)
    args.out.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}")
    return 0


def label(row: dict) -> str:
    return f"prefill {row['tokens']} tokens" if row.get("step") == "prefill" else f"decode batch {row['batch']}"


def markdown(report: dict) -> str:
    cpu = report["cpu"]
    lines = ["# tandem bench tp", "", f"`{report['command']}`", "", f"{report['date']}; {report['machine']}", "",
             f"CPU: {cpu['model']}, flags {', '.join(cpu['flags']) or 'none of note'}; {report['context']} tokens of "
             f"KV per decoding sequence; wall ms per forward (and the logits of each sequence's last row), eager "
             f"on both sides; medians of {report['repeats']} interleaved repeats (min–max).", "",
             f"| model | dtype | step | TP 1, {report['threads_one_rank']} threads (ms) | TP N | TP N, 1 thread "
             "per rank (ms) | TP N / TP 1 |", "|---|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['dtype']} | {label(r)} | {fmt(r['tp1_ms'], 2)} | {r['tp']} | "
              f"{fmt(r['tpn_ms'], 2)} | {fmt(r['tpn_over_tp1'], 2)} |" for r in report["rows"]]
    return "\n".join(lines) + "\n"
