"""``tandem train lora-data`` and ``tandem train lora``: a LoRA adapter in PEFT's format.
Registered by ``tandem.client.train.cli``.

    tandem train lora-data --target smollm2-135m-instruct --chat-prompts configs/chat_prompts.json \\
        --out .cache/train/smollm2/lora-data [--train-questions 640] [--max-answer-tokens 48]
    tandem train lora --target smollm2-135m-instruct --data .cache/train/smollm2/lora-data \\
        --config configs/lora_shout.json --out checkpoints/smollm2/lora-shout

``lora-data`` answers chat questions with the base model (greedy, through the engine);
``lora`` trains the adapter on those answers rewritten in a style (``shout``,
``json-answer``: :mod:`tandem.backends.training.lora_data`), writes
``adapter_config.json``, ``adapter_model.safetensors`` and ``training.json``, and
measures the share of held-out greedy answers in the style with and without it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tandem.client.train.run import add_run_options, start_run


def add_subcommands(sub) -> None:
    d = sub.add_parser("lora-data", help="the base model's short greedy answers to chat questions "
                                         "(the data of `tandem train lora`)")
    d.add_argument("--target", required=True, help="the base model (HF directory, GGUF or name)")
    d.add_argument("--chat-prompts", required=True, help="topics and templates "
                                                         "(configs/chat_prompts.json)")
    d.add_argument("--out", required=True, help="directory for answers.json")
    d.add_argument("--train-questions", type=int, default=640)
    d.add_argument("--held-out-questions", type=int, default=96,
                   help="questions on held-out topics: validation rows, then the measurement")
    d.add_argument("--max-answer-tokens", type=int, default=48,
                   help="answers are cut to their whole sentences within this many tokens")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    d.add_argument("--log", default=None, help="log file (default <out>/lora_data.log)")
    d.set_defaults(func=run_lora_data)

    p = sub.add_parser("lora", help="train a LoRA adapter (PEFT format) on styled answers")
    p.add_argument("--target", required=True, help="the base model (HF directory, GGUF or name)")
    p.add_argument("--data", required=True, help="a `tandem train lora-data` directory")
    p.add_argument("--config", required=True, help="LoRATrainConfig JSON (configs/lora_shout.json)")
    p.add_argument("--out", required=True, help="the adapter's directory")
    p.add_argument("--work-dir", default=None, help="state.pt and log (default .cache/train/<config>)")
    p.add_argument("--restart", action="store_true", help="discard <work-dir>/state.pt first")
    add_run_options(p)
    p.set_defaults(func=run_lora)


def run_lora_data(args: argparse.Namespace) -> int:
    import time

    from tandem.backends.models.model_path import resolve_model_path
    from tandem.backends.training.chat_prompts import chat_messages
    from tandem.backends.training.hidden_states import target_fingerprint
    from tandem.backends.training.lora_data import answer_questions, pick_questions, save_answers
    from tandem.client.openai.chat_template import ChatTemplate

    out = Path(args.out)
    args.log = args.log or out / "lora_data.log"
    command = start_run(args, out, "lora-data")
    target = resolve_model_path(args.target)
    train, held, pc = pick_questions(args.chat_prompts, args.train_questions,
                                     args.held_out_questions, args.seed)
    template = ChatTemplate.for_checkpoint(target)
    rendered = {split: [(q, template.render(chat_messages(q, pc.system))) for q in qs]
                for split, qs in (("train", train), ("held_out", held))}
    t0 = time.monotonic()
    rows = answer_questions(target, rendered, args.max_answer_tokens)
    summary = {"command": command, "target": args.target,
               "target_fingerprint": target_fingerprint(target), "chat_prompts": args.chat_prompts,
               "questions": {"train": len(train), "held_out": len(held)},
               "rows": {k: len(v) for k, v in rows.items()},
               "max_answer_tokens": args.max_answer_tokens, "seed": args.seed,
               "wall_time_s": round(time.monotonic() - t0, 1), "licence": pc.licence}
    path = save_answers(rows, out, summary)
    print(f"{summary['rows']['train']} + {summary['rows']['held_out']} answers -> {path}")
    return 0


def run_lora(args: argparse.Namespace) -> int:
    from tandem.backends.models.model_path import resolve_model_path
    from tandem.backends.training.lora_train import LoRATrainConfig, train_lora

    cfg = LoRATrainConfig.from_file(args.config)
    work = Path(args.work_dir or Path(".cache/train") / Path(args.config).stem)
    if args.restart:
        (work / "state.pt").unlink(missing_ok=True)
    command = start_run(args, work, "lora")
    record = train_lora(cfg, args.target, resolve_model_path(args.target), args.data, work,
                        args.out, resume=args.resume, max_steps=args.max_steps, command=command)
    e = record["effect"]
    print(f"step {record['step']}/{record['steps_planned']}  in style {cfg.style!r}: "
          f"{e['with_adapter']['in_style']:.2f} with the adapter, {e['base']['in_style']:.2f} "
          f"without  -> {args.out}")
    return 0
