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


def run_distill_data(args: argparse.Namespace) -> int:
    from tandem.backends.training.distill import DistillDataConfig, build_distill_data
    from tandem.backends.training.mtp import load_token_streams

    d = json.loads(Path(args.config).read_text()) if args.config else {}
    for key in ("num_prompts", "val_prompts", "new_tokens"):
        if getattr(args, key) is not None:
            d[key] = getattr(args, key)
    if args.temperatures is not None:
        d["temperatures"] = [float(t) for t in args.temperatures.split(",")]
    cfg = DistillDataConfig.from_dict(d)
    work = Path(args.work_dir)
    args.log = args.log or work / "distill.log"
    command = start_run(args, work, "distill-data")
    streams = load_token_streams(args.data, args.target, work)
    summary = build_distill_data(args.target, streams.train, streams.validation, args.out, cfg,
                                 corpus_for(args.data), args.device, command)
    print(f"{summary['rows']['train']} + {summary['rows']['validation']} rows, "
          f"{sum(summary['generated_tokens'].values())} generated tokens in "
          f"{summary['wall_time_s']} s -> {args.out}")
    return 0
