#!/usr/bin/env bash
# The one-H200 check of the production stage-1 run (issue 12; see training/stage1/gpu_check.py):
# the real entry point under `accelerate launch` with ONE process and the production launch
# config (FSDP1), a random 14-layer model of Qwen2.5-7B's width, prompts of exactly 8,192 tokens
# and completions of 1,024, the SDPA math kernel disabled; stop at step 2, resume to step 4,
# export. Asserts fp32 rotary buffers, equal optimizer checksums across save/load, continuous
# metrics, a bf16 export that loads; prints peak memory, time per micro-step and the
# extrapolation to production. Needs ~40 GiB of disk for the model and checkpoints.
#   bash scripts/gpu_check.sh                  # GPU_CHECK_DIR=/path to keep the folder
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$ROOT"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device")'
DIR="${GPU_CHECK_DIR:-$(mktemp -d -t aftraj-gpu-check.XXXXXX)}"
echo "gpu_check: folder $DIR"
CFG="$("$PY" -m training.stage1.gpu_check prepare --root "$DIR" | tail -n 1)"
launch() {
  "$PY" -m accelerate.commands.launch --config_file configs/accelerate/fsdp-2xh200.yaml --num_processes 1 \
    -m training.stage1 --phase train --config "$CFG" --no-progress "$@"
}
launch --stop-at-step 2
launch --resume
"$PY" -m training.stage1.gpu_check verify --root "$DIR" --pairs "${PROD_PAIRS:-1100}"
