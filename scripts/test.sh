#!/usr/bin/env bash
# The test suite, as CI runs it: set up .venv if needed, then pytest (CPU, no network).
#   bash scripts/test.sh                 # the default suite
#   bash scripts/test.sh -m fast         # the fast tier (< 5 min): every test not marked slow or opt-in
#   bash scripts/test.sh -m slow         # extra arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$ROOT/.venv/bin/python" -m pytest "$@"
