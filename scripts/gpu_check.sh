#!/usr/bin/env bash
# The one-H200 check of the production stage-1 run (issue 12; see training/stage1/gpu_check.py):
# the real entry point under `accelerate launch` with ONE process and the production launch
# config (FSDP1), a random 4-layer model of Qwen2.5-7B's width, prompts of exactly 8,192 tokens
# and completions of 1,024, the SDPA math kernel disabled; stop at step 2, resume to step 4,
# export. Asserts fp32 rotary buffers, equal optimizer checksums across save/load, continuous
# metrics, a bf16 export that loads; prints its figures as key=value lines (peak memory, time
# per micro-step, the extrapolation to production) and writes them to FIGURES_DIR/gpu_check.json.
# Runs on a bare machine: `python3` with torch, transformers and accelerate; the rest (orjson,
# bitsandbytes, ...) from .whl/stage1 (bash scripts/gpu_wheels.sh, run where an index is reachable).
# Disk: ~32 GiB (the model, two checkpoints, the export).
#   bash scripts/gpu_check.sh [FIGURES_DIR]          # GPU_CHECK_DIR=/path keeps the run folder
#   bash scripts/gpu_check.sh --tiny [FIGURES_DIR]   # the same steps on CPU, tiny shapes, no FSDP
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
TINY=0
if [ "${1:-}" = --tiny ]; then TINY=1; shift; fi
FIGURES="${1:-}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# shellcheck source=scripts/gpu_site.sh
source "$ROOT/scripts/gpu_site.sh"
gpu_site stage1 torch transformers accelerate orjson yaml bitsandbytes
DIR="${GPU_CHECK_DIR:-$(mktemp -d -t aftraj-gpu-check.XXXXXX)}"
echo "gpu_check: folder $DIR"
ACC=configs/accelerate/fsdp-2xh200.yaml
if ((TINY)); then
  ACC="$DIR/one-cpu.yaml"   # one CPU process, no FSDP (FSDP needs a GPU process group here)
  printf 'compute_environment: LOCAL_MACHINE\ndistributed_type: "NO"\nnum_processes: 1\nnum_machines: 1\nmachine_rank: 0\nmixed_precision: "no"\nuse_cpu: true\n' >"$ACC"
  CFG="$("$PY" -m training.stage1.gpu_check prepare --root "$DIR" --tiny | tail -n 1)"
  VERIFY=(--allow-cpu)
else
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device (--tiny: the CPU path)")'
  CFG="$("$PY" -m training.stage1.gpu_check prepare --root "$DIR" | tail -n 1)"
  VERIFY=()
fi
launch() {
  "$PY" -m accelerate.commands.launch --config_file "$ACC" --num_processes 1 \
    -m training.stage1 --phase train --config "$CFG" --no-progress "$@"
}
launch --stop-at-step 2
launch --resume
"$PY" -m training.stage1.gpu_check verify --root "$DIR" --pairs "${PROD_PAIRS:-1100}" "${VERIFY[@]}" \
  ${FIGURES:+--figures-dir "$FIGURES"}
echo "gpu_check: disk used by $DIR: $(du -sh "$DIR" | cut -f1)"
