#!/bin/bash
# MTP heads (with and without norms) for the current target snapshot, then validation through the engine
set -e
cd /work/main
T=${TARGET:-.cache/train/target-snapshot}
TANDEM=".venv/bin/tandem"
nice -n 10 $TANDEM train mtp --target $T --data .cache/train/target/data --out checkpoints/demo/mtp \
    --log checkpoints/demo/logs/train_mtp.log --restart
nice -n 10 $TANDEM train mtp --target $T --data .cache/train/target/data --out .cache/train/mtp-no-norms/head \
    --no-norms --log checkpoints/demo/logs/train_mtp_no_norms.log --restart
nice -n 10 $TANDEM train mtp-eval --target $T --draft checkpoints/demo/draft \
    --mtp mtp=checkpoints/demo/mtp --mtp mtp_no_norms=.cache/train/mtp-no-norms/head \
    --out checkpoints/demo/mtp/acceptance.json
echo PIPELINE DONE
