#!/usr/bin/env bash
# Stage 1 (BPPO) on one node with 2×H200, phase by phase; extra arguments go to both phases.
#   1. preferences, ONE process (never a process group): sample the base policy, cache the pairs
#      in the run folder. With SAMPLER_SERVER_CMD set, the script starts that OpenAI-compatible
#      server first, waits until it answers, and stops it when sampling ends.
#   2. training, `accelerate launch` (FSDP over both GPUs), reading the cache only.
# Before phase 2 nothing may still answer at the config's openai_base_url: a vLLM server on the
# training GPUs holds the memory training needs (ALLOW_LIVE_SAMPLER=1: it runs elsewhere).
#   SAMPLER_SERVER_CMD="vllm serve /models/Qwen2.5-7B-Instruct --served-model-name Qwen2.5-7B-Instruct" \
#     bash scripts/train_stage1.sh --config configs/stage1/qwen2.5-7b-2xh200.yaml --data runs/corpus
#   bash scripts/train_stage1.sh --config … --resume          # the cache is kept: phase 1 is a no-op
#   ACCELERATE_CONFIG=configs/accelerate/fsdp-2xh200.yaml SAMPLER_WAIT_S=900 (defaults)
# Gradient checkpointing is the model's own (config `gradient_checkpointing`), not FSDP's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

URL="$("$PY" -m training.stage1 "$@" --print-config | "$PY" -c '
import json, sys
c = json.load(sys.stdin)
print(c["openai_base_url"] if c["sampler"] == "openai" and c["samples_per_prompt"] > 0 else "")')"

# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"   # answers URL, stop_group PID SECONDS (answers uses $PYTHON, as $PY does)

SERVER_PID=""
stop_server() {   # the server's whole process group: vLLM's tensor-parallel workers hold GPU memory too
  if [[ -n "$SERVER_PID" ]] && stop_group "$SERVER_PID" "${SAMPLER_STOP_S:-60}"; then
    echo "train_stage1: sampling server (pid $SERVER_PID, its process group) stopped"
  fi
  SERVER_PID=""
}
trap stop_server EXIT

# --- phase 1: preferences
if [[ -n "${SAMPLER_SERVER_CMD:-}" && -n "$URL" ]]; then
  # its own session and process group (pgid = its pid), so that stop_server reaches its workers
  setsid bash -c "exec $SAMPLER_SERVER_CMD" &
  SERVER_PID=$!
  echo "train_stage1: started sampling server (pid $SERVER_PID): $SAMPLER_SERVER_CMD"
  for ((i = 0; i < ${SAMPLER_WAIT_S:-900}; i += 2)); do
    answers "$URL" && break
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "train_stage1: the sampling server exited" >&2; exit 1; }
    sleep 2
  done
  answers "$URL" || { echo "train_stage1: no answer at $URL after ${SAMPLER_WAIT_S:-900} s" >&2; exit 1; }
fi
"$PY" -m training.stage1 --phase preferences "$@"
stop_server

# --- phase 2: training
if [[ -n "$URL" && "${ALLOW_LIVE_SAMPLER:-0}" != 1 ]] && answers "$URL"; then
  echo "train_stage1: a sampling server still answers at $URL; stop it before training (it holds" \
       "GPU memory), or set ALLOW_LIVE_SAMPLER=1 if it runs on other GPUs" >&2
  exit 1
fi
"$PY" -m accelerate.commands.launch \
  --config_file "${ACCELERATE_CONFIG:-configs/accelerate/fsdp-2xh200.yaml}" \
  -m training.stage1 --phase train "$@"
