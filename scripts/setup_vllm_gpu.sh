#!/usr/bin/env bash
# The GPU vLLM of the paper sequence, in its own venv (.venv-vllm-gpu): the corpus endpoint and
# the stage-1 sampler (VLLM_PYTHON in scripts/reproduce_paper.sh) and the auditor's server
# (configs/serve/vllm-qwen2.5-7b-h200.yaml, `python: .venv-vllm-gpu/bin/python`).
# The pins are training/verl/requirements-vllm-gpu.txt (every line name==version): vLLM 0.24.0,
# torch 2.11.0 and transformers 5.9.0 are what verl 0.9.1's `vllm` extra pins (.venv-verl's
# rollouts), so corpus, sampling, rollouts and serving run one vLLM, one torch, one transformers.
# The whole environment is recorded in $VENV/pip-freeze.txt; VLLM_GPU_LOCK=FILE installs such a
# record instead of the pins (the same versions on another node).
#   bash scripts/setup_vllm_gpu.sh                      # on the GPU node; refuses without an NVIDIA GPU
#   VLLM_GPU_VENV=/path PYTHON=python3.12 bash scripts/setup_vllm_gpu.sh
#   VLLM_GPU_LOCK=/other/.venv-vllm-gpu/pip-freeze.txt bash scripts/setup_vllm_gpu.sh
# Idempotent: skipped when the venv already holds every pin with a CUDA torch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PINS="${VLLM_GPU_LOCK:-$ROOT/training/verl/requirements-vllm-gpu.txt}"
VLLM_VERSION=0.24.0
VENV="${VLLM_GPU_VENV:-$ROOT/.venv-vllm-gpu}"

if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
  echo "[setup_vllm_gpu] no NVIDIA GPU here (nvidia-smi -L fails): vllm==$VLLM_VERSION pulls a CUDA torch;" \
       "run this on the GPU node (the CPU build for tests: bash scripts/test_vllm.sh)" >&2
  exit 1
fi
[ -f "$PINS" ] || { echo "[setup_vllm_gpu] no pins at $PINS" >&2; exit 1; }
# shellcheck source=scripts/pick_python.sh
source "$ROOT/scripts/pick_python.sh"
pick_python setup_vllm_gpu || exit 1

venv_ok() {   # every pin installed at its version, vLLM the expected one, torch a CUDA build
  "$VENV/bin/python" -c "import sys, importlib.metadata as md, torch
bad = []
for line in open(sys.argv[1]):
    line = line.split('#')[0].strip()
    if line:
        name, want = line.split('==')
        try:
            got = md.version(name)
        except md.PackageNotFoundError:
            got = None
        if got != want:
            bad.append(f'{name} {got} != {want}')
assert md.version('vllm') == sys.argv[2], md.version('vllm')
assert torch.version.cuda is not None, 'a CPU torch'
assert not bad, bad" "$PINS" "$VLLM_VERSION" >/dev/null 2>&1
}
if [ -x "$VENV/bin/python" ] && venv_ok; then
  echo "[setup_vllm_gpu] $VENV already holds every pin of $PINS"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$PINS"
venv_ok || { echo "[setup_vllm_gpu] $VENV does not hold the pins of $PINS with a CUDA torch" >&2; exit 1; }
"$VENV/bin/python" -m pip freeze --all >"$VENV/pip-freeze.txt"
echo "[setup_vllm_gpu] ready: $VENV (vllm==$VLLM_VERSION; every version in $VENV/pip-freeze.txt)"
