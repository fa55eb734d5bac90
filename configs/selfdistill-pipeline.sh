#!/bin/bash
# Self-distillation of a target's proposers (issue 24): the target's own continuations of
# training prompts (tandem train distill-data), the MTP head and the draft fine-tuned on
# them, then top-1 agreement and acceptance of the old and new proposers through the engine.
#   configs/selfdistill-pipeline.sh             # the demo target, checkpoints/demo/*
# The new proposers go to .cache/train/*-selfdistill/out; copy them over checkpoints/demo/*
# only if the evaluation says they are better. One torch thread each, run one after the other.
set -e
cd "$(dirname "$0")/.."
T=${TARGET:-checkpoints/demo/target}
TANDEM=${TANDEM:-.venv/bin/tandem}
LOGS=checkpoints/demo/logs
DATA=()
[ -f .cache/train/target/data/tokens.pt ] && DATA=(--data .cache/train/target/data)
# ~12-20 min: 6,144 prompts x 128 tokens through the engine
nice -n 5 $TANDEM train distill-data --target "$T" "${DATA[@]}" --config configs/distill.json \
    --out .cache/train/distill --log $LOGS/distill_data.log
# ~40 min: hidden states of the rows + 1,200 steps from the shipped head (round 1)
nice -n 5 $TANDEM train mtp --target "$T" "${DATA[@]}" --distill-data .cache/train/distill \
    --init-from checkpoints/demo/mtp --config configs/mtp_selfdistill.json \
    --work-dir .cache/train/mtp-selfdistill --out .cache/train/mtp-selfdistill/out \
    --log $LOGS/train_mtp_selfdistill.log --restart
# ~10 min: a second round at half the lr from the first round's head (what ships)
nice -n 5 $TANDEM train mtp --target "$T" "${DATA[@]}" --distill-data .cache/train/distill \
    --init-from .cache/train/mtp-selfdistill/out --config configs/mtp_selfdistill_2.json \
    --work-dir .cache/train/mtp-selfdistill-2 --out .cache/train/mtp-selfdistill-2/out \
    --log $LOGS/train_mtp_selfdistill_2.log --restart
# ~30-50 min: the draft from the shipped one, target as teacher (data.distill_data in the config)
nice -n 5 $TANDEM train lm --config configs/draft_selfdistill.json \
    --work-dir .cache/train/draft-selfdistill --out .cache/train/draft-selfdistill/out \
    --log $LOGS/train_draft_selfdistill.log
nice -n 5 $TANDEM train mtp-eval --target "$T" \
    --draft draft=checkpoints/demo/draft --draft draft_selfdistill=.cache/train/draft-selfdistill/out \
    --mtp mtp=checkpoints/demo/mtp --mtp mtp_selfdistill=.cache/train/mtp-selfdistill/out \
    --mtp mtp_selfdistill_2=.cache/train/mtp-selfdistill-2/out \
    --out .cache/train/selfdistill-acceptance.json
echo PIPELINE DONE
