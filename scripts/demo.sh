#!/usr/bin/env bash
# The main job, end to end on a CPU: set up .venv, then convert Who&When into our schema and
# summarise it per subset. Later stages (corpus, training, evaluation) extend this script.
#   bash scripts/demo.sh            # writes everything under out/demo/
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PATH="$ROOT/.venv/bin:$PATH"
OUT="${OUT:-out/demo}"
WW="${WHO_AND_WHEN:-$ROOT/../shared/data/who_and_when}"
mkdir -p "$OUT"

echo "### 1. Who&When -> our schema"
aftraj convert --from whoandwhen "$WW" --out "$OUT/who_and_when.jsonl"
echo
echo "### 2. Who&When summary per subset"
aftraj summary "$OUT/who_and_when.jsonl"
echo
echo "### 3. What the auditor sees at prefix t=3 of the first trajectory (first lines)"
aftraj inspect "$OUT/who_and_when.jsonl" --prompt 3 | sed -n '1,3p;/^===== user/,+6p'
