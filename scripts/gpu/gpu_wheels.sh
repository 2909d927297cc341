#!/usr/bin/env bash
# Download, here (where a package index is reachable), the wheels the one GPU check
# (scripts/gpu_check.sh) needs beyond what the borrowed H200's image holds, into .whl/check
# (git-ignored; the device call carries it: `carry=['.whl/check']`). The image (docs/gpu.md) has
# Python 3.12, torch 2.11.0+cu130, transformers, accelerate, peft, pyarrow, pandas, xxhash, pyyaml,
# safetensors; it lacks orjson (the schema), bitsandbytes (8-bit AdamW), trl, datasets and what
# datasets needs beyond the image (dill, multiprocess). bitsandbytes keeps one CUDA library,
# BNB_CUDA (default 130: torch 2.11 + CUDA 13.0; bitsandbytes loads
# libbitsandbytes_cuda<torch.version.cuda>.so), dropped members listed in .whl/check/TRIMMED.txt.
#   bash scripts/gpu/gpu_wheels.sh                          # cp312, manylinux x86_64
#   GPU_WHEELS_PY=3.11 bash scripts/gpu/gpu_wheels.sh        # wheels for another Python
#   GPU_WHEELS_DIR=/path bash scripts/gpu/gpu_wheels.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYV="${GPU_WHEELS_PY:-3.12}"
OUTDIR="${GPU_WHEELS_DIR:-$ROOT/.whl/check}"
BNB_CUDA="${BNB_CUDA:-130}"
PY="${PYTHON:-python3}"
ABI="cp${PYV/./}"

# --- the pins (pyproject.toml's; dill and multiprocess: what datasets 5.2.0 resolved to in .venv)
WHEELS=(orjson==3.13.0 bitsandbytes==0.50.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)

plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 any; do plat+=(--platform "$p"); done
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR"
echo "gpu_wheels: Python $PYV ($ABI), manylinux x86_64 -> $OUTDIR"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PYV" --implementation cp --abi "$ABI" --abi abi3 --abi none "${plat[@]}" -d "$OUTDIR" "${WHEELS[@]}"

# --- bitsandbytes: one CUDA library (scripts/gpu/trim_wheel.py lists each dropped member in TRIMMED.txt)
for f in "$OUTDIR"/bitsandbytes-*.whl; do
  "$PY" "$ROOT/scripts/gpu/trim_wheel.py" "$f" "bitsandbytes/libbitsandbytes_rocm*" \
    $(for v in 118 120 121 122 123 124 125 126 128 129 130 131 132; do
        [ "$v" = "$BNB_CUDA" ] || echo "bitsandbytes/libbitsandbytes_cuda$v.so"; done)
  "$PY" -c 'import sys, zipfile; n = zipfile.ZipFile(sys.argv[1]).namelist()
sys.exit(0 if f"bitsandbytes/libbitsandbytes_cuda{sys.argv[2]}.so" in n else f"no CUDA {sys.argv[2]} library in {sys.argv[1]}")' \
    "$f" "$BNB_CUDA"
done
echo "gpu_wheels: $OUTDIR: $(ls "$OUTDIR"/*.whl | wc -l) wheels, $(du -sh "$OUTDIR" | cut -f1)"
