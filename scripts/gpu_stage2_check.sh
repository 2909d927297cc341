#!/usr/bin/env bash
# GPU check of the stage-2 TRL path on one GPU (see training/stage2/gpu_check.py): 2 GRPO steps,
# random ~0.6B-parameter Qwen2 (152k vocab), bf16, 8 completions of 512 tokens per prompt.
#   bash scripts/gpu_stage2_check.sh            # prints per-step rows and a `gpu_stage2: …` line
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m training.stage2.gpu_check "$@"
