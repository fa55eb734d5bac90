#!/bin/bash
# SmolLM2-135M-Instruct's LoRA adapters (checkpoints/smollm2/lora-*, issue 38): the model's own
# short greedy answers to chat questions (tandem train lora-data), then one adapter per style
# trained on them (tandem train lora): "shout" (UPPERCASE) and "json-answer" ({"answer": "..."}).
#   configs/smollm2-lora.sh                 # CPU, one thread: ~2.5 min of answers, ~32 + ~13 min of training
# TARGET: the base model (default the packaged GGUF); TANDEM: the CLI; WORK: the run's files;
# OUT: where the adapters go.
set -e
cd "$(dirname "$0")/.."
T=${TARGET:-smollm2-135m-instruct}
TANDEM=${TANDEM:-.venv/bin/tandem}
WORK=${WORK:-.cache/train/smollm2}
OUT=${OUT:-checkpoints/smollm2}
THREADS=${THREADS:-1}
# 640 training questions + 96 on held-out topics, answered greedily, cut to whole sentences <= 48 tokens
$TANDEM train lora-data --target "$T" --chat-prompts configs/chat_prompts.json \
    --out $WORK/lora-data --threads $THREADS
for style in shout json_answer; do
    $TANDEM train lora --target "$T" --data $WORK/lora-data --config configs/lora_$style.json \
        --work-dir $WORK/lora-$style --out $OUT/lora-${style//_/-} --threads $THREADS \
        --log $WORK/train_lora_$style.log --restart
done
