#!/usr/bin/env bash
# GPU check of the stage-2 TRL path on one GPU (see training/stage2/gpu_check.py): a format
# warm-start (so the reward varies within a group), then 2 GRPO steps, random ~0.6B-parameter
# Qwen2 (152k vocab), bf16, 8 completions of 512 tokens per prompt. Asserts a non-zero reward
# spread within groups and a parameter change; prints key=value figures and writes them to
# FIGURES_DIR/gpu_stage2.json. Runs on a bare machine: `python3` with torch, transformers and
# accelerate; trl, peft, datasets and their dependencies from .whl/stage2 (scripts/gpu_wheels.sh).
#   bash scripts/gpu_stage2_check.sh [FIGURES_DIR] [-- extra gpu_check flags]
#   bash scripts/gpu_stage2_check.sh --tiny [FIGURES_DIR]     # the same code path on CPU, shrunk
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
ARGS=()
if [ "${1:-}" = --tiny ]; then ARGS+=(--tiny); shift; fi
if [ -n "${1:-}" ] && [ "$1" != -- ]; then ARGS+=(--figures-dir "$1"); shift; fi
[ "${1:-}" = -- ] && shift
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# shellcheck source=scripts/gpu_site.sh
source "$ROOT/scripts/gpu_site.sh"
gpu_site stage2 torch transformers accelerate orjson yaml trl peft datasets pyarrow
exec "$PY" -m training.stage2.gpu_check "${ARGS[@]}" "$@"
