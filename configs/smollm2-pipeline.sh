#!/bin/bash
# SmolLM2-135M-Instruct's MTP head (checkpoints/smollm2/mtp, issue 34): the model's own answers to
# chat questions (tandem train distill-data --chat-prompts), the head trained on its hidden states
# and next-token distributions over them, then acceptance through the engine on held-out prompts.
#   configs/smollm2-pipeline.sh                      # CPU, one thread: hours
#   DEVICE=cuda configs/smollm2-pipeline.sh          # what trained the shipped head (one H200)
# TARGET: the model (default the packaged GGUF); TANDEM: the CLI; WORK: the run's files;
# DISTILL_ARGS, MTP_CONFIG: to try it small first.
set -e
cd "$(dirname "$0")/.."
T=${TARGET:-smollm2-135m-instruct}
TANDEM=${TANDEM:-.venv/bin/tandem}
WORK=${WORK:-.cache/train/smollm2}
DEVICE=${DEVICE:-cpu}
THREADS=${THREADS:-1}
# 6,144 questions answered (up to 256 tokens each) + 64 validation rows; prompts.json: 96 held out
$TANDEM train distill-data --target "$T" --chat-prompts configs/chat_prompts.json \
    --config configs/distill_smollm2.json --out $WORK/distill --work-dir $WORK/distill-work \
    --device $DEVICE --threads $THREADS --log $WORK/distill_data.log ${DISTILL_ARGS:-}
# the head from scratch on the rows alone (no corpus windows)
${TRAIN_PREFIX:-} $TANDEM train mtp --target "$T" --distill-data $WORK/distill \
    --config ${MTP_CONFIG:-configs/mtp_smollm2.json} --work-dir $WORK/mtp --hidden-cache $WORK/hidden \
    --out $WORK/head --device $DEVICE --threads $THREADS --log $WORK/train_mtp.log --restart
[ -n "$SKIP_ROUND2" ] || ${TRAIN_PREFIX:-} $TANDEM train mtp --target "$T" --distill-data $WORK/distill \
    --config configs/mtp_smollm2_2.json --init-from $WORK/head --work-dir $WORK/mtp2 \
    --hidden-cache $WORK/hidden --out $WORK/head2 --device $DEVICE --threads $THREADS \
    --log $WORK/train_mtp_2.log --restart
[ -n "$SKIP_EVAL" ] && exit 0
# top-1 agreement and acceptance at k = 1..4 through the engine (bf16 where the CPU has it):
# answers to EOS (what a chat user gets), then 128 tokens each whatever comes after the answer
$TANDEM train mtp-eval --target "$T" --mtp round1=$WORK/head --mtp round2=$WORK/head2 \
    --prompts $WORK/distill/prompts.json --num-prompts 48 --new-tokens 256 --stop-at-eos \
    --threads $THREADS --out $WORK/acceptance.json
$TANDEM train mtp-eval --target "$T" --mtp round1=$WORK/head --mtp round2=$WORK/head2 \
    --prompts $WORK/distill/prompts.json --num-prompts 48 --new-tokens 128 \
    --threads $THREADS --out $WORK/acceptance_128.json
