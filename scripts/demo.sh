#!/usr/bin/env bash
# The main job, end to end on a CPU, from a clean clone (set-up included):
#   1. Who&When -> our schema, a summary per subset
#   2. the step-scored auditor on SmolLM2-135M-Instruct (aftraj ablation, configs/ablation/demo.yaml):
#      build a small corpus -> train the decision at every step of every train run (one forward a
#      run), the threshold chosen on val -> walk the whole test split and 20 Who&When runs with
#      one incremental forward an event, beside every floor (paired differences to the best)
#   3. a live run through the gateway: the checkpoint served in process (configs/serve/gateway-steps.yaml),
#      a held-out unsafe run replayed as events, stopped when the auditor alarms
#   4. fold one unsafe corpus run into run state: the rule detectors' findings
# Writes reports/demo/ablation.md (+ ablation.json, plots, the config); runs land in out/demo/.
# The paper's generative recipe at demo scale: aftraj ablation --config configs/ablation/demo-recipe.yaml
#   bash scripts/demo.sh              # SmolLM2 (measured time in the README)
#   bash scripts/demo.sh --quick      # the same pipeline, every row, on a random tiny model (CI)
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

banner "2. Corpus, training, the strict online walk beside the floors ($CONFIG)"
aftraj ablation --config "$CONFIG" --out "$OUT/ablation" --report "$REPORT"

banner "3. A live run through the gateway, the step-scored auditor in its process"
# the held-out unsafe run the walk stopped at its decisive step (else the first it alarmed on)
LIVE=$(python - "$OUT/ablation" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
preds = [json.loads(x) for x in (out / "eval/heldout/step-scored/predictions.jsonl").read_text().splitlines() if x]
unsafe = [p for p in preds if p["gold"] == "UNSAFE"]
pick = next((p for p in unsafe if p["k_hat"] == p["k_star"]), None) or next((p for p in unsafe if p["alarmed"]), unsafe[0])
print(pick["id"])
PY
)
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$OUT/gateway"
python - "$OUT" <<'PY'
import sys, yaml
out = sys.argv[1]
cfg = yaml.safe_load(open("configs/serve/gateway-steps.yaml"))
cfg["ledger_url"] = f"sqlite:///{out}/gateway/ledger.db"
cfg["auditor"]["options"]["model"] = f"{out}/ablation/steps/final"
cfg["auditor"]["options"]["reason_max_new_tokens"] = 64
yaml.safe_dump(cfg, open(f"{out}/gateway/gateway.yaml", "w"), sort_keys=False)
PY
aftraj serve gateway --config "$OUT/gateway/gateway.yaml" --port "$PORT" > "$OUT/gateway/gateway.log" 2>&1 &
GATEWAY=$!
trap 'kill $GATEWAY 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/healthz', timeout=2)" 2>/dev/null && break
  kill -0 $GATEWAY 2>/dev/null || { cat "$OUT/gateway/gateway.log"; exit 1; }
  sleep 0.5
done
python -m serve.example_agent --gateway "http://127.0.0.1:$PORT" --key aft-local-demo-key \
  --replay "$OUT/ablation/corpus/test.jsonl" --trajectory "$LIVE" --run-id "live-$LIVE" \
  || echo "(the auditor did not stop this run: it went to its end)"
kill $GATEWAY; wait $GATEWAY 2>/dev/null || true
trap - EXIT

banner "4. Fold one unsafe corpus run into run state; the rule detectors' findings"
RUN_ID=$(python - "$OUT/ablation/corpus/test.jsonl" <<'PY'
import sys
from aftraj.schema import iter_jsonl
print(next(t.id for t in iter_jsonl(sys.argv[1]) if t.label.unsafe and t.domain == "agentic"))
PY
)
aftraj fold "$OUT/ablation/corpus/test.jsonl" --run "$RUN_ID" --policy configs/policies/templates.yaml | head -30

banner "Done in $(( (SECONDS - START) / 60 )) min $(( (SECONDS - START) % 60 )) s (after set-up). Report: $REPORT/ablation.md; runs: $OUT/"
