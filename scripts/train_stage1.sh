#!/usr/bin/env bash
# Stage 1 (BPPO) launch line for one node with 2×H200 (FSDP); extra arguments go to the trainer.
#   bash scripts/train_stage1.sh --config configs/stage1/qwen2.5-7b-2xh200.yaml --data runs/corpus
#   ACCELERATE_CONFIG=configs/accelerate/fsdp-2xh200.yaml bash scripts/train_stage1.sh --resume …
# Gradient checkpointing is the model's own (config `gradient_checkpointing`), not FSDP's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m accelerate.commands.launch \
  --config_file "${ACCELERATE_CONFIG:-configs/accelerate/fsdp-2xh200.yaml}" \
  -m training.stage1 "$@"
