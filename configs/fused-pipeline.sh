#!/bin/bash
# EAGLE-3-style fused MTP head (issue 24, tried): the shipped head's self-distillation
# rounds (configs/selfdistill-pipeline.sh) with mtp.fuse_layers [1, 3, 5], then both heads on
# the same held-out windows offline (the engine does not feed a fused head; its proposer
# refuses one). Needs .cache/train/distill (the pipeline's `tandem train distill-data`).
# The fused head stays in .cache/train/mtp-fused-2/out. One torch thread each, one after another.
set -e
cd "$(dirname "$0")/.."
T=${TARGET:-checkpoints/demo/target}
TANDEM=${TANDEM:-.venv/bin/tandem}
NICE=${NICE:-19}
LOGS=${LOGS:-.cache/train/logs}
mkdir -p "$LOGS"
DATA=()
[ -f .cache/train/target/data/tokens.pt ] && DATA=(--data .cache/train/target/data)
# the stdlib corpus as distill-data tokenized it (the same files, split and tokenizer)
[ -z "${DATA[*]}" ] && [ -f .cache/train/distill-work/data/tokens.pt ] && DATA=(--data .cache/train/distill-work/data)
# hidden states + layers 1, 3, 5 of the rows and 1,024 corpus windows; 1,200 steps; fc fresh,
# the rest from the shipped head
nice -n $NICE $TANDEM train mtp --target "$T" "${DATA[@]}" --distill-data .cache/train/distill \
    --init-from checkpoints/demo/mtp --config configs/mtp_fused.json \
    --work-dir .cache/train/mtp-fused --out .cache/train/mtp-fused/out \
    --log $LOGS/train_mtp_fused.log --restart
# 600 steps at half the lr from the first round's head
nice -n $NICE $TANDEM train mtp --target "$T" "${DATA[@]}" --distill-data .cache/train/distill \
    --init-from .cache/train/mtp-fused/out --config configs/mtp_fused_2.json \
    --work-dir .cache/train/mtp-fused-2 --out .cache/train/mtp-fused-2/out \
    --log $LOGS/train_mtp_fused_2.log --restart
nice -n $NICE $TANDEM train mtp-offline-eval --target "$T" "${DATA[@]}" --distill-data .cache/train/distill \
    --mtp mtp=checkpoints/demo/mtp --mtp fused=.cache/train/mtp-fused-2/out \
    --log $LOGS/mtp_offline_eval.log --out .cache/train/mtp-fused-offline.json
echo PIPELINE DONE
