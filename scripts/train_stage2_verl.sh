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
#   NNODES=4 bash scripts/train_stage2_verl.sh --config … --init … --out /shared/runs/stage2
# With NNODES > 1, --out (and --init) must be ONE folder that every node sees at the same path:
# every rank writes its FSDP checkpoint shards under OUT/verl and the workers load the model and
# read OUT/data there. The script refuses an --out on a local filesystem (ext4, xfs, overlay,
# tmpfs, …: `stat -f`); OUT_IS_SHARED=1 when a shared one is not recognised.
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
    : "${HEAD_IP:?set HEAD_IP to the address of the head node}"
    exec "$VERL_VENV/bin/ray" start --address="$HEAD_IP:$RAY_PORT" --num-gpus="$GPUS_PER_NODE" --block ;;
esac

out_arg() {   # the value of --out in the arguments
  local prev=""
  for a in "$@"; do
    if [[ $prev == --out ]]; then echo "$a"; return; fi
    if [[ $a == --out=* ]]; then echo "${a#--out=}"; return; fi
    prev=$a
  done
}

EXTRA=()
if [ "${NNODES:-1}" -gt 1 ]; then
  OUT_DIR="$(out_arg "$@")"
  if [ -z "$OUT_DIR" ]; then
    echo "train_stage2_verl: NNODES=$NNODES needs --out on a filesystem every node shares" >&2; exit 2
  fi
  mkdir -p "$OUT_DIR"
  FSTYPE="$(stat -f -c %T "$OUT_DIR")"
  case "$FSTYPE" in
    nfs|nfs4|lustre|gpfs|beegfs|ceph|cephfs|glusterfs|wekafs|panfs|cifs|smb2|fuse|fuseblk|fuse.*) ;;
    *) if [ "${OUT_IS_SHARED:-0}" != 1 ]; then
         echo "train_stage2_verl: --out $OUT_DIR is on $FSTYPE, a node-local filesystem; with NNODES=$NNODES" \
              "every node writes its checkpoint shards and reads the data there, so it must be one shared" \
              "folder (NFS, Lustre, GPFS, CephFS, …); set OUT_IS_SHARED=1 if it is" >&2
         exit 2
       fi ;;
  esac
  export RAY_ADDRESS="${RAY_ADDRESS:-auto}"     # the trainer joins the running cluster
  EXTRA+=(--set "verl_nnodes=$NNODES" --set "verl_gpus_per_node=$GPUS_PER_NODE")
fi
exec "$PY" -m aftraj.cli train stage2 --engine verl --verl-python "$VERL_VENV/bin/python" "$@" "${EXTRA[@]}"
