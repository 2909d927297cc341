#!/usr/bin/env bash
# The CPU-scale ablation (configs/ablation/cpu.yaml): raw base, warmed base, stage 1, stage 2,
# stage 1 + 2, the content-blind floors and the rules auditor, on a stratified held-out sample
# and a Who&When sample, with 95 % intervals, overall and per domain. Budget: 90 minutes on
# 2 cores. Every phase caches its output in the run folder: run it again after an interruption
# and it resumes at the phase it stopped in.
#   bash scripts/ablation_cpu.sh                      # runs/ablation-cpu, report in reports/ablation-cpu
#   OUT=/tmp/abl bash scripts/ablation_cpu.sh --set heldout_sample=16
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-runs/ablation-cpu}"
REPORT="${REPORT:-reports/ablation-cpu}"
SETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --set) SETS+=(--set "$2"); shift 2 ;;
    *) echo "ablation_cpu.sh: unknown argument $1 (use --set KEY=VALUE)" >&2; exit 2 ;;
  esac
done
exec "$ROOT/.venv/bin/aftraj" ablation --config configs/ablation/cpu.yaml --out "$OUT" --report "$REPORT" "${SETS[@]}"
