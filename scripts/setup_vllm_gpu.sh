#!/usr/bin/env bash
# The GPU vLLM of the paper sequence, in its own venv (.venv-vllm-gpu): the corpus endpoint and
# the stage-1 sampler (VLLM_PYTHON in scripts/reproduce_paper.sh) and the auditor's server
# (configs/serve/vllm-qwen2.5-7b-h200.yaml, `python: .venv-vllm-gpu/bin/python`).
# vLLM 0.24.0 is the version verl 0.9.1's `vllm` extra pins (.venv-verl's rollouts), so corpus,
# sampling, rollouts and serving run one vLLM; it brings its own CUDA torch (2.11.0).
#   bash scripts/setup_vllm_gpu.sh                      # on the GPU node; refuses without an NVIDIA GPU
#   VLLM_GPU_VENV=/path PYTHON=python3.12 bash scripts/setup_vllm_gpu.sh
# Idempotent: skipped when the venv already holds the pinned vLLM with a CUDA torch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VERSION=0.24.0
VENV="${VLLM_GPU_VENV:-$ROOT/.venv-vllm-gpu}"

if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
  echo "[setup_vllm_gpu] no NVIDIA GPU here (nvidia-smi -L fails): vllm==$VLLM_VERSION pulls a CUDA torch;" \
       "run this on the GPU node (the CPU build for tests: bash scripts/test_vllm.sh)" >&2
  exit 1
fi
# shellcheck source=scripts/pick_python.sh
source "$ROOT/scripts/pick_python.sh"
pick_python setup_vllm_gpu || exit 1

venv_ok() {
  "$VENV/bin/python" -c "import sys, importlib.metadata as md, torch
assert md.version('vllm') == sys.argv[1], md.version('vllm')
assert torch.version.cuda is not None, 'a CPU torch'" "$VLLM_VERSION" >/dev/null 2>&1
}
if [ -x "$VENV/bin/python" ] && venv_ok; then
  echo "[setup_vllm_gpu] $VENV already holds vllm==$VLLM_VERSION"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "vllm==$VLLM_VERSION"
venv_ok || { echo "[setup_vllm_gpu] $VENV does not hold vllm==$VLLM_VERSION with a CUDA torch" >&2; exit 1; }
echo "[setup_vllm_gpu] ready: $VENV (vllm==$VLLM_VERSION)"
