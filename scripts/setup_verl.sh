#!/usr/bin/env bash
# verl's OWN environment for stage 2 (verl pins transformers<5.11, its vllm extra torch 2.11, so
# it never shares .venv). verl's version is pinned in training/verl/requirements.txt only.
#   bash scripts/setup_verl.sh          # CPU: torch 2.13.0 (CPU wheel) + the pinned CPU set; enough to
#                                       # compose/validate the recipe and run the `verl` tests
#   bash scripts/setup_verl.sh --gpu    # a GPU node: verl[vllm] at the pinned version (pulls CUDA torch
#                                       # 2.11 and vLLM) + bitsandbytes for 8-bit AdamW; for training
#   VERL_VENV=/path bash scripts/setup_verl.sh ...    # another location (default .venv-verl)
#   PYTHON=python3.12 bash scripts/setup_verl.sh ...  # the interpreter (default: the first of
#                                       # python3.12, python3.11, python3.10, python3 that is 3.10-3.12,
#                                       # verl 0.9.1's Requires-Python)
# Idempotent: skipped when the venv already holds the pinned verl and imports cleanly.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VERL_VENV:-$ROOT/.venv-verl}"
REQ="$ROOT/training/verl/requirements.txt"
REQ_GPU="$ROOT/training/verl/requirements-gpu.txt"
VLLM_GPU_PINS="$ROOT/training/verl/requirements-vllm-gpu.txt"   # .venv-vllm-gpu's pins, as constraints
# shellcheck source=scripts/pick_python.sh
source "$ROOT/scripts/pick_python.sh"
pick_python setup_verl || exit 1
VERL_PIN="$(grep -E '^verl==' "$REQ")"
TORCH_CPU=2.13.0
MODE=cpu
[ "${1:-}" = "--gpu" ] && MODE=gpu

venv_ok() {
  "$VENV/bin/python" - "${VERL_PIN#verl==}" "$MODE" >/dev/null 2>&1 <<'PY'
import sys, importlib.metadata as md
assert md.version("verl") == sys.argv[1]
import torch, verl, hydra  # noqa: F401
if sys.argv[2] == "cpu":
    assert torch.version.cuda is None, "a CUDA torch in the CPU environment"
else:
    import vllm, bitsandbytes  # noqa: F401
PY
}

if [ -x "$VENV/bin/python" ] && venv_ok; then
  echo "[setup_verl] $VENV already holds $VERL_PIN ($MODE)"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [ "$MODE" = cpu ]; then
  # torch first, the CPU build, so nothing pulls a multi-GB CUDA build; then the pinned set.
  "${PIP[@]}" "torch==$TORCH_CPU"
  "${PIP[@]}" -r "$REQ"
  "$VENV/bin/python" -c "import torch; assert torch.version.cuda is None, torch.__version__"
else
  # verl's vllm extra pins torch 2.11 (CUDA), vllm 0.24.0 and transformers 5.9.0; no flash-attn
  # (the recipe uses SDPA). The rest of the GPU set: training/verl/requirements-gpu.txt; what
  # .venv-vllm-gpu pins beyond the extra (tokenizers, huggingface-hub, ...) constrains this one too.
  "${PIP[@]}" "verl[vllm]==${VERL_PIN#verl==}" -r "$REQ_GPU" -c "$VLLM_GPU_PINS"
fi
venv_ok || { echo "[setup_verl] $VENV does not import verl cleanly" >&2; exit 1; }
echo "[setup_verl] ready: $VENV ($VERL_PIN, $MODE)"
