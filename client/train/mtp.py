"""``tandem train mtp`` and ``tandem train mtp-eval``: an MTP head for a target, and
its acceptance measured through the engine; ``tandem train token-frequencies``: the
proposers' frequent-token vocabulary. Registered by ``tandem.client.train.cli``.

    tandem train mtp --target checkpoints/demo/target --data .cache/train/target/data \\
        --out checkpoints/demo/mtp [--no-norms] [--config configs/mtp.json] [--device cuda]
    tandem train mtp --target checkpoints/demo/target --data .cache/train/target/data \
        --distill-data .cache/train/distill --init-from checkpoints/demo/mtp \
        --config configs/mtp_selfdistill.json --out checkpoints/demo/mtp
    tandem train mtp-eval --target checkpoints/demo/target --draft checkpoints/demo/draft \\
        --mtp mtp=checkpoints/demo/mtp --mtp mtp_no_norms=.cache/train/mtp-no-norms/head
    tandem train mtp-offline-eval --target checkpoints/demo/target --distill-data .cache/train/distill \
        --mtp mtp=checkpoints/demo/mtp --mtp fused=.cache/train/mtp-fused-2/out

``--data`` is a token cache from ``tandem train lm`` (a directory holding ``tokens.pt``,
or the file), or a directory of Python sources to tokenize with the target's tokenizer;
without it the standard-library corpus is tokenized with the target's tokenizer.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.client.paths import REPO_ROOT
from tandem.client.train.run import add_run_options, start_run

DEFAULT_CONFIG = REPO_ROOT / "configs" / "mtp.json"


def add_subcommands(sub) -> None:
    """Add ``mtp``, ``mtp-eval`` and ``token-frequencies`` to the ``tandem train`` subparsers."""
    p = sub.add_parser("mtp", help="train an MTP head (EAGLE-style, norms re-introduced) for a "
                                   "Llama-family HF target")
    p.add_argument("--target", required=True, help="the target's HF checkpoint directory")
    p.add_argument("--out", required=True, help="directory for the head (bf16 safetensors)")
    p.add_argument("--data", default=None,
                   help="tokens.pt (or a directory holding it) from `tandem train lm`, or a "
                        "directory of .py sources; default: the stdlib corpus, tokenized with "
                        "the target's tokenizer")
    p.add_argument("--config", default=None,
                   help=f"training config JSON (default {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[1])})")
    p.add_argument("--no-norms", action="store_true",
                   help="the EAGLE-1 head without the re-introduced RMSNorms (for comparison)")
    p.add_argument("--work-dir", default=None,
                   help="state.pt, best/ and logs (default .cache/train/mtp[-no-norms])")
    p.add_argument("--hidden-cache", default=".cache/train/mtp-hidden",
                   help="where the target's hidden states are cached (shared by runs)")
    p.add_argument("--distill-data", default=None,
                   help="rows from `tandem train distill-data` (the target's own continuations): "
                        "mtp.distill_fraction of the steps train on them, validation uses theirs")
    p.add_argument("--init-from", default=None,
                   help="a trained head to fine-tune (overrides the config's init_from)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_run_options(p)
    p.add_argument("--restart", action="store_true",
                   help="discard <work-dir>/state.pt and start over (e.g. for a new target)")
    p.set_defaults(func=run_mtp)

    e = sub.add_parser("mtp-eval", help="top-1 agreement and acceptance of a draft and MTP heads, "
                                        "through the engine")
    e.add_argument("--target", required=True)
    e.add_argument("--draft", action="append", default=[], metavar="[NAME=]DIR",
                   help="a draft model checkpoint (repeatable; NAME defaults to draft)")
    e.add_argument("--mtp", action="append", default=[], metavar="NAME=DIR",
                   help="an MTP head to evaluate (repeatable), e.g. mtp=checkpoints/demo/mtp")
    e.add_argument("--ks", default="1,2,3,4")
    e.add_argument("--num-prompts", type=int, default=48, help="held-out prompts (balanced by kind)")
    e.add_argument("--new-tokens", type=int, default=64)
    e.add_argument("--max-prompt-tokens", type=int, default=256)
    e.add_argument("--prompts", default=None, help="prompts.json (default <target>/prompts.json)")
    e.add_argument("--stop-at-eos", action="store_true",
                   help="continuations end at the target's EOS (chat answers): nothing it writes "
                        "after its answer counts")
    e.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    e.add_argument("--device", default="cpu")
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--out", default=None, help="write the report as JSON here")
    e.set_defaults(func=run_mtp_eval)

    o = sub.add_parser("mtp-offline-eval",
                       help="MTP heads (fused ones too) on the same held-out windows with the "
                            "training forward: top-1, KL, teacher-forced acceptance at k=3")
    o.add_argument("--target", required=True)
    o.add_argument("--mtp", action="append", required=True, metavar="NAME=DIR",
                   help="an MTP head (repeatable)")
    o.add_argument("--distill-data", default=None,
                   help="evaluate on its validation rows too (`tandem train distill-data`)")
    o.add_argument("--data", default=None, help="as for `tandem train mtp` (the corpus's "
                                                "validation split gives the windows)")
    o.add_argument("--windows", type=int, default=64, help="corpus validation windows")
    o.add_argument("--window-len", type=int, default=512)
    o.add_argument("--hidden-cache", default=".cache/train/mtp-hidden")
    o.add_argument("--work-dir", default=".cache/train/mtp-offline-eval")
    o.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    o.add_argument("--device", default="cpu")
    o.add_argument("--threads", type=int, default=1)
    o.add_argument("--log", default=None, help="log file (default <work-dir>/eval.log)")
    o.add_argument("--out", default=None, help="write the report as JSON here")
    o.set_defaults(func=run_mtp_offline_eval)

    f = sub.add_parser("token-frequencies",
                       help="rank the target's tokens by their count in the training data, for "
                            "a proposer's frequent-token vocabulary (--draft-vocab-size)")
    f.add_argument("--target", required=True, help="the target's HF checkpoint directory")
    f.add_argument("--data", default=None, help="as for `tandem train mtp`")
    f.add_argument("--out", action="append", required=True, metavar="DIR",
                   help="proposer checkpoint directory to write token_frequencies.json into "
                        "(repeatable: the draft and the MTP head)")
    f.add_argument("--work-dir", default=".cache/train/token-frequencies")
    f.set_defaults(func=run_token_frequencies)


def run_token_frequencies(args: argparse.Namespace) -> int:
    from tandem.backends.models import ModelConfig
    from tandem.backends.speculative.draft_vocab import (FREQUENCIES_FILE, coverage,
                                                         rank_by_frequency, save_frequencies)
    from tandem.backends.training.mtp import load_token_streams

    vocab_size = ModelConfig.from_dir(args.target).vocab_size
    stream = load_token_streams(args.data, args.target, args.work_dir).train
    ids, counts = rank_by_frequency(stream, vocab_size)
    for out in args.out:
        save_frequencies(Path(out) / FREQUENCIES_FILE, ids, counts,
                         f"training split of {args.data or 'the stdlib corpus'}, "
                         f"{len(stream)} tokens")
        print(f"wrote {Path(out) / FREQUENCIES_FILE}")
    for size in (256, 512, 1024, 2048):
        print(f"the {size} most frequent tokens cover {coverage(counts, size):.3f} of the training split")
    return 0


def run_mtp(args: argparse.Namespace) -> int:
    import torch

    from tandem.backends.models.model_path import resolve_model_path
    from tandem.backends.training.distill import load_distill_rows
    from tandem.backends.training.mtp import (MTPTrainConfig, TokenStreams, load_token_streams,
                                              train_mtp)

    cfg = MTPTrainConfig.from_file(args.config or DEFAULT_CONFIG)
    if args.no_norms:
        cfg.mtp.use_norms = False
    if args.init_from:
        cfg.init_from = args.init_from
    work = Path(args.work_dir or f".cache/train/mtp{'' if cfg.mtp.use_norms else '-no-norms'}")
    if args.restart:
        (work / "state.pt").unlink(missing_ok=True)
    command = start_run(args, work, "mtp")
    target = resolve_model_path(args.target)
    distill = load_distill_rows(args.distill_data, target) if args.distill_data else None
    if distill is not None and cfg.mtp.distill_fraction == 1.0 and args.data is None:
        empty = torch.zeros(0, dtype=torch.long)   # every step on the rows: no corpus needed
        data = TokenStreams(empty, empty)
    else:
        data = load_token_streams(args.data, target, work)
    result = train_mtp(cfg, target, data, work, args.out, device=args.device,
                       resume=args.resume, max_steps=args.max_steps, command=command,
                       hidden_cache=args.hidden_cache, distill=distill)
    best = result["best"] or {}
    print(f"step {result['step']}/{result['steps_planned']}  best validation top-1 "
          f"{best.get('top1', float('nan')):.3f} at step {best.get('step')}  work dir {work}")
    return 0


def run_mtp_eval(args: argparse.Namespace) -> int:
    import torch

    from tandem.backends.training.acceptance import evaluate_proposers, format_report
    from tandem.backends.training.loop import setup_logging

    torch.set_num_threads(args.threads)
    setup_logging(None)
    proposers = {}
    for spec in args.draft:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = "draft", spec
        proposers[name] = ("draft_target", path)
    for spec in args.mtp:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).name, spec
        proposers[name] = ("mtp", path)
    if not proposers:
        raise ValueError("mtp-eval: nothing to evaluate; pass --draft and/or --mtp NAME=DIR")
    from tandem.backends.models.model_path import resolve_model_path
    report = evaluate_proposers(resolve_model_path(args.target), proposers, tuple(map(int, args.ks.split(","))),
                                args.num_prompts, args.new_tokens, args.max_prompt_tokens,
                                args.dtype, args.device, args.prompts, args.stop_at_eos)
    return _report(format_report(report), report, args.out)


def _report(text: str, report: dict, out: str | None) -> int:
    """Print an evaluation's table, and write its JSON to ``out`` when given."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


def run_mtp_offline_eval(args: argparse.Namespace) -> int:
    import torch

    from tandem.backends.training.distill import load_distill_rows
    from tandem.backends.training.hidden_states import first_windows
    from tandem.backends.training.loop import setup_logging
    from tandem.backends.training.mtp import load_token_streams
    from tandem.backends.training.mtp_offline import evaluate_heads, format_report

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    setup_logging(args.log or work / "eval.log")
    heads = {}
    for spec in args.mtp:
        name, sep, path = spec.partition("=")
        heads[name if sep else Path(spec).name] = path if sep else spec
    sets = {}
    if args.distill_data:
        val = load_distill_rows(args.distill_data, args.target)["validation"]
        sets["distill validation rows"] = (val.windows, val.lengths)
    if args.windows > 0:
        stream = load_token_streams(args.data, args.target, work).validation
        sets["corpus validation windows"] = (first_windows(stream, args.windows, args.window_len),
                                             None)
    report = evaluate_heads(args.target, heads, sets, args.hidden_cache, args.dtype, args.device)
    return _report(format_report(report), report, args.out)
