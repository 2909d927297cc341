#!/usr/bin/env bash
# The main job, end to end on a CPU, from a clean clone (set-up included):
#   1. Who&When -> our schema, a summary per subset
#   2. the recipe on SmolLM2-135M-Instruct (aftraj ablation, configs/ablation/demo.yaml):
#      build a small corpus -> prepare the model -> format warm-up -> stage 1 (BPPO) -> stage 2
#      (GRPO) and stage 1 + 2 -> every row evaluated with the strict online walk on a small
#      held-out sample and a Who&When sample, beside the content-blind floors and the rules
#   3. fold one unsafe corpus run into run state: the rule detectors' findings
# Writes reports/demo/ablation.md (+ ablation.json, plots, the config); runs land in out/demo/.
#   bash scripts/demo.sh              # SmolLM2, a few steps a phase (measured time in the README)
#   bash scripts/demo.sh --quick      # the same pipeline on a random tiny model, in a few minutes (CI)
#   bash scripts/demo.sh --resume     # keep the phases a previous run finished
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0 RESUME=0
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1 ;;
    --resume) RESUME=1 ;;
    *) echo "demo.sh: unknown argument $a (use --quick, --resume)" >&2; exit 2 ;;
  esac
done
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PATH="$ROOT/.venv/bin:$PATH"
if [ "$QUICK" = 1 ]; then
  CONFIG=configs/ablation/quick.yaml; OUT="${OUT:-out/demo-quick}"; REPORT="${REPORT:-reports/demo-quick}"
else
  CONFIG=configs/ablation/demo.yaml; OUT="${OUT:-out/demo}"; REPORT="${REPORT:-reports/demo}"
fi
[ "$RESUME" = 1 ] || rm -rf "$OUT"
mkdir -p "$OUT"
banner() { printf '\n######## %s\n' "$*"; }
START=$SECONDS

banner "1. Who&When -> our schema, and a summary per subset"
aftraj convert --from whoandwhen who_and_when --out "$OUT/who_and_when.jsonl"
aftraj summary "$OUT/who_and_when.jsonl"

banner "2. Corpus, warm-up, stage 1, stage 2, evaluation ($CONFIG)"
aftraj ablation --config "$CONFIG" --out "$OUT/ablation" --report "$REPORT"

banner "3. Fold one unsafe corpus run into run state; the rule detectors' findings"
RUN_ID=$(python - "$OUT/ablation/corpus/test.jsonl" <<'PY'
import sys
from aftraj.schema import iter_jsonl
print(next(t.id for t in iter_jsonl(sys.argv[1]) if t.label.unsafe and t.domain == "agentic"))
PY
)
aftraj fold "$OUT/ablation/corpus/test.jsonl" --run "$RUN_ID" --policy configs/policies/templates.yaml | head -30

banner "Done in $(( (SECONDS - START) / 60 )) min $(( (SECONDS - START) % 60 )) s (after set-up). Report: $REPORT/ablation.md; runs: $OUT/"
