"""``tandem train distill-data``: the target's own continuations of training prompts, the
self-distillation data of its draft and MTP head. Registered by ``tandem.client.train.cli``.

    tandem train distill-data --target checkpoints/demo/target --data .cache/train/target/data \\
        --out .cache/train/distill [--num-prompts 4096] [--config configs/distill.json]
    tandem train mtp --target ... --distill-data .cache/train/distill --init-from checkpoints/demo/mtp ...
    tandem train lm --config configs/draft_selfdistill.json ...    (data.distill_data)

``--data`` is read as for ``tandem train mtp``. Prompts cut at def/class headers need
the corpus's files: they are found from the ``corpus.json`` next to ``tokens.pt`` (what
``tandem train lm`` writes), from a ``--data`` directory of sources, or the stdlib
corpus when ``--data`` is not given; otherwise every prompt is a window of the stream.

A chat model (``--chat-prompts configs/chat_prompts.json``) is continued from chat
questions instead (:mod:`tandem.backends.training.chat_prompts`), rendered with its own
chat template; ``--data`` is not read. Held-out questions give the validation rows and
``<out>/prompts.json``, the held-out prompts of ``tandem train mtp-eval --prompts``:

    tandem train distill-data --target smollm2-135m-instruct --chat-prompts configs/chat_prompts.json \
        --config configs/distill_smollm2.json --out .cache/train/smollm2-distill [--device cuda]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.client.train.run import start_run


def add_subcommands(sub) -> None:
    p = sub.add_parser("distill-data", help="generate the target's continuations of training "
                                            "prompts through the engine (self-distillation data)")
    p.add_argument("--target", required=True, help="the target's HF checkpoint directory")
    p.add_argument("--out", required=True, help="directory for distill.pt, tokens.pt, distill.json")
    p.add_argument("--data", default=None, help="as for `tandem train mtp`")
    p.add_argument("--config", default=None, help="JSON with DistillDataConfig fields "
                                                  "(configs/distill.json)")
    p.add_argument("--num-prompts", type=int, default=None, help="training rows (overrides --config)")
    p.add_argument("--val-prompts", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--temperatures", default=None,
                   help="comma-separated, cycled over rows; 0 = greedy (e.g. 0,0,0.8)")
    p.add_argument("--chat-prompts", default=None,
                   help="JSON of topics, templates and stdlib question templates "
                        "(configs/chat_prompts.json): continue chat questions rendered with the "
                        "target's chat template instead of --data windows")
    p.add_argument("--eval-prompts", type=int, default=96,
                   help="with --chat-prompts: held-out prompts written to <out>/prompts.json")
    p.add_argument("--generator", default=None, choices=["auto", "engine", "dense"],
                   help="what continues the prompts (overrides --config; auto: the engine, or "
                        "the dense generator on CUDA without FlashInfer)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--work-dir", default=".cache/train/distill-work",
                   help="where --data sources are tokenized when they are not a tokens.pt")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--log", default=None, help="log file (default <work-dir>/distill.log)")
    p.set_defaults(func=run_distill_data)


def corpus_for(data: str | None):
    """The corpus whose training files give header prompts, or None (see module doc)."""
    from tandem.backends.training.corpus import build_corpus
    if data is None:
        return build_corpus()
    path = Path(data)
    manifest = (path if path.is_dir() else path.parent) / "corpus.json"
    if manifest.is_file():
        m = json.loads(manifest.read_text())
        if Path(m.get("root", "")).is_dir():
            return build_corpus(m["root"], m.get("val_fraction", 0.05))
        return None
    if path.is_dir() and not (path / "tokens.pt").is_file():
        return build_corpus(path)
    return None


def chat_prompts(target: Path, config: str, cfg, eval_prompts: int):
    """Token ids of the training and validation chat prompts, and the held-out
    :class:`~tandem.backends.training.corpus.Prompt` records (rendered text) for
    ``prompts.json``. Prompts longer than ``cfg.max_prompt_tokens`` are left out (a
    chat prompt cut at its start loses its template)."""
    from tandem.backends.models.tokenizer import load_tokenizer
    from tandem.backends.training.chat_prompts import (ChatPromptConfig, chat_messages,
                                                       sample_questions, split_topics,
                                                       stdlib_questions, topic_questions)
    from tandem.backends.training.corpus import Prompt, build_corpus
    from tandem.client.openai.chat_template import ChatTemplate

    pc = ChatPromptConfig.from_file(config)
    template, tokenizer = ChatTemplate.for_checkpoint(target), load_tokenizer(target)
    topic_train, topic_held = split_topics(topic_questions(pc.topics, pc.templates),
                                           pc.held_out_fraction)
    std_train = std_held = []
    if pc.stdlib_fraction > 0 and pc.stdlib_templates:
        corpus = build_corpus()
        std_train = stdlib_questions(corpus.train, pc.stdlib_templates)
        std_held = stdlib_questions(corpus.validation, pc.stdlib_templates)

    def encoded(questions):
        out = []
        for q in questions:
            text = template.render(chat_messages(q, pc.system))
            ids = tokenizer.encode(text).ids
            if cfg.min_prompt_tokens <= len(ids) <= cfg.max_prompt_tokens:
                out.append((q, text, ids))
        return out

    n_std = min(len(std_train), round(cfg.num_prompts * pc.stdlib_fraction))
    train = encoded(sample_questions(std_train, n_std, cfg.seed)
                    + sample_questions(topic_train, cfg.num_prompts - n_std, cfg.seed))
    train = sample_questions(train, len(train), cfg.seed + 1)     # the two kinds mixed
    # held out: topics never trained on and stdlib validation files, the two kinds in turn
    held = encoded(interleave(sample_questions(topic_held, len(topic_held), cfg.seed + 2),
                              sample_questions(std_held, len(std_held), cfg.seed + 3)))
    n_val = min(cfg.val_prompts, len(held) // 2)
    val, test = held[:n_val], held[n_val:n_val + eval_prompts]
    records = [Prompt(q.kind, q.source, 0, text, q.text) for q, text, _ in test]
    counts = {"train": len(train), "validation": len(val), "held_out_prompts": len(records),
              "topic_questions": {"train": len(topic_train), "held_out": len(topic_held)},
              "stdlib_questions": {"train": len(std_train), "held_out": len(std_held)},
              "licence": pc.licence}
    return [ids for *_, ids in train], [ids for *_, ids in val], records, counts


def interleave(a: list, b: list) -> list:
    """a[0], b[0], a[1], b[1], ... then the rest of the longer one."""
    out = [x for pair in zip(a, b) for x in pair]
    return out + a[len(b):] + b[len(a):]


def run_distill_data(args: argparse.Namespace) -> int:
    from tandem.backends.models.model_path import resolve_model_path
    from tandem.backends.training.corpus import save_prompts
    from tandem.backends.training.distill import (DistillDataConfig, build_distill_data,
                                                  continue_and_write)
    from tandem.backends.training.mtp import load_token_streams

    d = json.loads(Path(args.config).read_text()) if args.config else {}
    for key in ("num_prompts", "val_prompts", "new_tokens", "generator"):
        if getattr(args, key) is not None:
            d[key] = getattr(args, key)
    if args.temperatures is not None:
        d["temperatures"] = [float(t) for t in args.temperatures.split(",")]
    cfg = DistillDataConfig.from_dict(d)
    work = Path(args.work_dir)
    args.log = args.log or work / "distill.log"
    command = start_run(args, work, "distill-data")
    target = resolve_model_path(args.target)
    if args.chat_prompts:
        train, val, records, counts = chat_prompts(target, args.chat_prompts, cfg, args.eval_prompts)
        summary = continue_and_write(target, {"train": train, "validation": val}, args.out, cfg,
                                     args.device, command,
                                     {"chat_prompts": args.chat_prompts, "prompts": counts})
        save_prompts(records, Path(args.out) / "prompts.json")
    else:
        streams = load_token_streams(args.data, target, work)
        summary = build_distill_data(target, streams.train, streams.validation, args.out, cfg,
                                     corpus_for(args.data), args.device, command)
    print(f"{summary['rows']['train']} + {summary['rows']['validation']} rows, "
          f"{sum(summary['generated_tokens'].values())} generated tokens in "
          f"{summary['wall_time_s']} s -> {args.out}")
    return 0
