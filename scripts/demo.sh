#!/usr/bin/env bash
# The main job, end to end on a CPU (about 9 minutes on 2 cores; set-up adds ~1.5 minutes the
# first time). Everything lands under out/demo/ (OUT=... to change):
#   1. Who&When -> our schema, summary per subset
#   2. build a small AFTraj-style corpus (scripted multi-agent rollouts, curation, injection, diagnosis)
#   3. fold one run's events and show the rule detectors' findings
#   4. evaluate baselines on Who&When (post-hoc heuristics, the rules auditor, strict online walk)
#   5. stage 1 (BPPO) on SmolLM2-135M-Instruct with LoRA, a few steps, from the corpus's train split
#   6. the trained auditor walks held-out corpus trajectories prefix by prefix (hf backend, KV reuse)
#   bash scripts/demo.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PATH="$ROOT/.venv/bin:$PATH"
OUT="${OUT:-out/demo}"
WW="${WHO_AND_WHEN:-$ROOT/eval/data/who_and_when}"
mkdir -p "$OUT"
banner() { printf '\n######## %s\n' "$*"; }

banner "1. Who&When -> our schema, and a summary per subset"
aftraj convert --from whoandwhen "$WW" --out "$OUT/who_and_when.jsonl"
aftraj summary "$OUT/who_and_when.jsonl"

banner "2. Build a small corpus (configs/corpus/demo-small.yaml)"
aftraj corpus build --config configs/corpus/demo-small.yaml --out "$OUT/corpus" --no-progress
sed -n '1,25p' "$OUT/corpus/stats.md"
aftraj corpus verify --config configs/corpus/demo-small.yaml --corpus "$OUT/corpus"

banner "3. Fold one unsafe corpus run into run state; rule detectors' findings"
RUN_ID=$(python - "$OUT/corpus/test.jsonl" <<'PY'
import sys
from aftraj.schema import iter_jsonl
print(next(t.id for t in iter_jsonl(sys.argv[1]) if t.label.unsafe and t.domain == "agentic"))
PY
)
aftraj fold "$OUT/corpus/test.jsonl" --run "$RUN_ID" --policy configs/policies/templates.yaml
aftraj inspect "$OUT/corpus/test.jsonl" --id "$RUN_ID" | head -20

banner "4. Baselines on Who&When (strict protocol; post-hoc heuristics are labelled as such)"
aftraj eval --auditor heuristic:uniform-random --data "$WW" --out "$OUT/eval/ww-uniform-random" --no-progress
aftraj eval --auditor rules --data "$WW" --out "$OUT/eval/ww-rules" --no-progress
aftraj eval --auditor rules:configs/policies/templates.yaml --data "$OUT/corpus/test.jsonl" \
  --out "$OUT/eval/corpus-rules" --no-progress
sed -n '1,30p' "$OUT/eval/ww-uniform-random/report.md"

banner "5. Stage 1 (BPPO) on SmolLM2-135M-Instruct, LoRA, a few steps on the corpus's train split"
aftraj models prepare smollm2-135m
rm -rf "$OUT/stage1-smollm2"   # a re-run trains afresh (a run folder with checkpoints needs --resume)
aftraj train stage1 --config configs/stage1/smollm2-135m-cpu.yaml --data "$OUT/corpus" \
  --set max_trajectories=24 --out "$OUT/stage1-smollm2" --no-progress

banner "6. The trained auditor walks 2 held-out corpus trajectories, prefix by prefix"
aftraj eval --auditor hf --model "$OUT/stage1-smollm2/final" --data "$OUT/corpus/test.jsonl" \
  --limit 2 --max-new-tokens 64 --out "$OUT/eval/corpus-smollm2" --no-progress
sed -n '1,30p' "$OUT/eval/corpus-smollm2/report.md"

banner "Done. Reports and plots: $OUT/eval/*/ (report.md, metrics.json, predictions.jsonl, *.png)"
