#!/usr/bin/env bash
# Stage 2 (GRPO) with verl on GPU nodes. verl runs from its own environment (.venv-verl:
# bash scripts/setup_verl.sh --gpu on every node); the stage-2 config drives the recipe
# training/verl/stage2_grpo.yaml through `aftraj train stage2 --engine verl` (run from .venv).
#
# One node (8 GPUs; Ray starts inside the trainer):
#   bash scripts/train_stage2_verl.sh --config configs/stage2/qwen2.5-7b-8xh200.yaml \
#       --init runs/stage1-qwen2.5-7b/final --out runs/stage2-qwen2.5-7b [--dry-run] [--resume]
#
# Several nodes (a Ray cluster; the repository and .venv-verl at the same path on every node):
#   bash scripts/train_stage2_verl.sh ray-head                      # on the head node
#   HEAD_IP=10.0.0.1 bash scripts/train_stage2_verl.sh ray-worker   # on each other node
#   NNODES=4 bash scripts/train_stage2_verl.sh --config … --init …  # on the head: trainer.nnodes=4
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
VERL_VENV="${VERL_VENV:-$ROOT/.venv-verl}"
RAY_PORT="${RAY_PORT:-6379}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Ray workers import training.reward (and aftraj.verdict) from the repository
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

case "${1:-}" in
  ray-head)
    exec "$VERL_VENV/bin/ray" start --head --port="$RAY_PORT" --num-gpus="$GPUS_PER_NODE" --block ;;
  ray-worker)
    : "${HEAD_IP:?set HEAD_IP to the head node's address}"
    exec "$VERL_VENV/bin/ray" start --address="$HEAD_IP:$RAY_PORT" --num-gpus="$GPUS_PER_NODE" --block ;;
esac

EXTRA=()
if [ "${NNODES:-1}" -gt 1 ]; then
  export RAY_ADDRESS="${RAY_ADDRESS:-auto}"     # the trainer joins the running cluster
  EXTRA+=(--set "verl_nnodes=$NNODES" --set "verl_gpus_per_node=$GPUS_PER_NODE")
fi
exec "$PY" -m aftraj.cli train stage2 --engine verl --verl-python "$VERL_VENV/bin/python" "$@" "${EXTRA[@]}"
