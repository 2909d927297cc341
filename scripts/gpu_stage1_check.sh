#!/usr/bin/env bash
# GPU check of the production stage-1 settings on one GPU (see training/stage1/gpu_check.py):
# 5 steps, random ~0.6B-parameter Qwen2 (152k vocab), bf16, gradient checkpointing, adamw_bnb_8bit.
#   bash scripts/gpu_stage1_check.sh            # prints per-step rows and a `gpu_stage1: …` line
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m training.stage1.gpu_check "$@"
