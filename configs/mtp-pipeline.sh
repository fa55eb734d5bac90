#!/bin/bash
# MTP heads for a target (with the re-introduced norms -> checkpoints/demo/mtp, and without,
# for comparison), then top-1 agreement and acceptance of draft and heads through the engine.
#   configs/mtp-pipeline.sh                    # the demo target, checkpoints/demo/target
#   TARGET=DIR configs/mtp-pipeline.sh         # another Llama-family HF checkpoint
# ~2.5 min of hidden states + ~20 min per head + ~1 min of evaluation at 1 CPU thread.
set -e
cd "$(dirname "$0")/.."
T=${TARGET:-checkpoints/demo/target}
TANDEM=${TANDEM:-.venv/bin/tandem}
# the token streams `tandem train lm` cached for the target; without them the stdlib
# corpus is tokenized again with the target's tokenizer
DATA=()
[ -f .cache/train/target/data/tokens.pt ] && DATA=(--data .cache/train/target/data)
nice -n 10 $TANDEM train mtp --target "$T" "${DATA[@]}" --out checkpoints/demo/mtp \
    --log checkpoints/demo/logs/train_mtp.log --restart
nice -n 10 $TANDEM train mtp --target "$T" "${DATA[@]}" --out .cache/train/mtp-no-norms/head \
    --no-norms --log checkpoints/demo/logs/train_mtp_no_norms.log --restart
nice -n 10 $TANDEM train mtp-eval --target "$T" --draft checkpoints/demo/draft \
    --mtp mtp=checkpoints/demo/mtp --mtp mtp_no_norms=.cache/train/mtp-no-norms/head \
    --out checkpoints/demo/mtp/acceptance.json
echo PIPELINE DONE
