#!/usr/bin/env bash
# The `verl`-marked tests (tests/training/test_verl_recipe.py) in verl's own environment: Hydra
# composes training/verl/stage2_grpo.yaml against the installed verl, verl's validate_config and
# dataset class accept our config and parquet, verl's DAPO reward manager scores through our reward.
#   bash scripts/test_verl.sh            # creates .venv-verl (CPU) on first use, then runs the tests
#   bash scripts/test_verl.sh -k dapo    # extra arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VERL_VENV:-$ROOT/.venv-verl}"
bash "$ROOT/scripts/setup_verl.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$VENV/bin/python" -m pytest -m verl \
  tests/training/test_verl_recipe.py -q -p no:cacheprovider "$@"
