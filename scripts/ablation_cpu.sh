#!/usr/bin/env bash
# The CPU-scale ablation (configs/ablation/cpu.yaml, the amended DESIGN §5): warmed base, stage 1,
# stage 1 + 2; the learning ladder (linear probe, decision-token probe beside the content-blind
# rules) on the held-out families; the strict walk beside the floors and the rules auditor, with
# 95 % intervals, overall and per domain; it prints each phase's wall time and peak memory (README,
# "The CPU ablation", has the last measured run). Every phase caches its output in the run folder:
# run it again after an interruption and it resumes at the phase it stopped in.
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
