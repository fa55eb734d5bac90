"""``tandem train``: train the demo target / draft (``lm``) and export checkpoints.

    tandem train lm --config configs/target.json --out checkpoints/demo/target
    tandem train lm --config configs/target.json --out checkpoints/demo/target --resume
    tandem train export --work-dir .cache/train/target --out checkpoints/demo/target [--best]
    tandem train sample --model checkpoints/demo/target --n 3
    tandem train mtp --target checkpoints/demo/target --out checkpoints/demo/mtp   (tandem.client.train.mtp)
    tandem train mtp-eval --target checkpoints/demo/target --draft checkpoints/demo/draft \
        --mtp mtp=checkpoints/demo/mtp
    tandem train distill-data --target checkpoints/demo/target --out .cache/train/distill
        (tandem.client.train.distill)
    tandem train lora-data --target smollm2-135m-instruct --chat-prompts configs/chat_prompts.json \
        --out .cache/train/smollm2/lora-data
    tandem train lora --target smollm2-135m-instruct --data .cache/train/smollm2/lora-data \
        --config configs/lora_shout.json --out checkpoints/smollm2/lora-shout   (tandem.client.train.lora)

The CLI (``tandem.client.cli``) registers this module with ``add_parser(subparsers)``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.client.train import distill, lora, mtp
from tandem.client.train.run import add_run_options, start_run


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train demo checkpoints (target, draft)")
    sub = p.add_subparsers(dest="train_command", required=True)

    lm = sub.add_parser("lm", help="train a Llama-architecture causal LM on the stdlib corpus")
    lm.add_argument("--config", required=True, help="training config JSON (configs/target.json)")
    lm.add_argument("--out", required=True, help="final HF checkpoint directory")
    lm.add_argument("--work-dir", default=None,
                    help="data cache, resumable state and periodic exports "
                         "(default .cache/train/<config name>)")
    add_run_options(lm)
    lm.set_defaults(func=run_lm)

    ex = sub.add_parser("export", help="copy the last saved checkpoint of a run to --out")
    ex.add_argument("--work-dir", required=True)
    ex.add_argument("--out", required=True)
    ex.add_argument("--best", action="store_true",
                    help="the checkpoint with the lowest validation loss instead of the last save")
    ex.set_defaults(func=run_export)

    sa = sub.add_parser("sample", help="greedy completions of held-out prompts (model cards)")
    sa.add_argument("--model", required=True, help="HF checkpoint dir with prompts.json")
    sa.add_argument("--n", type=int, default=3, help="prompts per kind")
    sa.add_argument("--max-new-tokens", type=int, default=96)
    sa.add_argument("--threads", type=int, default=1)
    sa.set_defaults(func=run_sample)

    mtp.add_subcommands(sub)   # mtp, mtp-eval, token-frequencies
    distill.add_subcommands(sub)   # distill-data
    lora.add_subcommands(sub)   # lora-data, lora
    return p


def run_lm(args: argparse.Namespace) -> int:
    from tandem.backends.training.lm import LMTrainConfig, train_lm

    cfg = LMTrainConfig.from_file(args.config)
    work = Path(args.work_dir or Path(".cache/train") / Path(args.config).stem)
    command = start_run(args, work, "lm")
    result = train_lm(cfg, work, args.out, resume=args.resume, max_steps=args.max_steps,
                      command=command)
    print(f"step {result['step']}/{result['steps_planned']}  "
          f"val_loss {result['val_loss_full'] or result['val_loss_periodic']}  work dir {work}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from tandem.backends.training.lm import export_from_work_dir

    print(export_from_work_dir(args.work_dir, args.out, "best" if args.best else "latest"))
    return 0


def run_sample(args: argparse.Namespace) -> int:
    import torch

    from tandem.backends.training.samples import sample_prompts

    torch.set_num_threads(args.threads)
    samples = sample_prompts(args.model, args.n, args.max_new_tokens)
    for s in samples:
        print(f"### {s.kind} {s.path}:{s.line} (parses: {s.parses})")
        print(s.prompt[-400:] + "\033[1m" + s.completion + "\033[0m" if sys.stdout.isatty()
              else s.prompt[-400:] + "<<<" + s.completion + ">>>")
    ok = sum(s.parses for s in samples)
    print(f"{ok}/{len(samples)} samples parse as Python (rough check)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m tandem.client.train.cli lm ...``."""
    parser = argparse.ArgumentParser(prog="tandem")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"tandem train: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
