#!/usr/bin/env bash
# Download, here (where a package index is reachable), the exact wheels the two GPU checks need
# beyond what a bare GPU machine holds (Python 3.12, torch, transformers, accelerate and their
# own dependencies), into .whl/ (git-ignored); each check installs its folder into a temporary
# target (pip install --no-index --no-deps --target, scripts/gpu_site.sh):
#   .whl/stage1   scripts/gpu_check.sh          orjson, bitsandbytes (CPU + one CUDA library)
#   .whl/stage2   scripts/gpu_stage2_check.sh   orjson, trl, peft, datasets and what datasets needs
#                                               (pyarrow without Flight/S3/tests, pandas, ...)
# A call to a GPU machine carries at most 64 MiB (working tree + carried folders): carry one folder
# a check (~5 MiB and ~45 MiB). bitsandbytes keeps the library of BNB_CUDA only (default 130:
# torch 2.11 + CUDA 13; bitsandbytes loads libbitsandbytes_cuda<torch.version.cuda>.so).
#   bash scripts/gpu_wheels.sh                        # cp312, manylinux x86_64
#   GPU_WHEELS_PY=3.11 bash scripts/gpu_wheels.sh      # wheels for another Python (e.g. a local test)
#   GPU_WHEELS_DIR=/path bash scripts/gpu_wheels.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYV="${GPU_WHEELS_PY:-3.12}"
OUTDIR="${GPU_WHEELS_DIR:-$ROOT/.whl}"
BNB_CUDA="${BNB_CUDA:-130}"
PY="${PYTHON:-python3}"
ABI="cp${PYV/./}"

# --- the pins (the project's own, pyproject.toml; the rest: what datasets 5.2.0, trl 1.16.0 and
# peft 0.21.2 need that torch + transformers 5.17 + accelerate 1.15 do not bring, found with
# `pip install --dry-run --report` in a venv holding only those three)
STAGE1=(orjson==3.13.0 bitsandbytes==0.50.2)
STAGE2=(orjson==3.13.0 trl==1.16.0 peft==0.21.2 datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1
        python-dateutil==4.0.0 tzdata==2026.6 xxhash==4.1.0 multiprocess==0.70.19 dill==0.4.1)

fetch() {   # DIR SPEC...: exact wheels for $PYV on manylinux x86_64, no dependency resolution
  local dir=$1; shift
  mkdir -p "$dir"
  local plat=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 any; do plat+=(--platform "$p"); done
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYV" --implementation cp --abi "$ABI" --abi abi3 --abi none "${plat[@]}" -d "$dir" "$@"
}

rm -rf "$OUTDIR/stage1" "$OUTDIR/stage2"
echo "gpu_wheels: Python $PYV ($ABI), manylinux x86_64 -> $OUTDIR"
fetch "$OUTDIR/stage1" "${STAGE1[@]}"
fetch "$OUTDIR/stage2" "${STAGE2[@]}"

# --- trim what the checks never load (scripts/trim_wheel.py lists each dropped member in TRIMMED.txt)
keep_bnb=()
for f in "$OUTDIR"/stage1/bitsandbytes-*.whl; do
  "$PY" "$ROOT/scripts/trim_wheel.py" "$f" "bitsandbytes/libbitsandbytes_rocm*" \
    $(for v in 118 120 121 122 123 124 125 126 128 129 130 131 132; do
        [ "$v" = "$BNB_CUDA" ] || echo "bitsandbytes/libbitsandbytes_cuda$v.so"; done)
  "$PY" -c 'import sys, zipfile; n = zipfile.ZipFile(sys.argv[1]).namelist()
sys.exit(0 if f"bitsandbytes/libbitsandbytes_cuda{sys.argv[2]}.so" in n else f"no CUDA {sys.argv[2]} library in {sys.argv[1]}")' \
    "$f" "$BNB_CUDA"
done
for f in "$OUTDIR"/stage2/pyarrow-*.whl; do
  "$PY" "$ROOT/scripts/trim_wheel.py" "$f" "pyarrow/libarrow_flight.so*" "pyarrow/_flight.*" \
    "pyarrow/libarrow_python_flight.so*" "pyarrow/libarrow_s3.so*" "pyarrow/_s3fs.*" "pyarrow/tests/*" \
    "pyarrow/include/*" "pyarrow/src/*" "pyarrow/_pyarrow_cpp_tests.*" "pyarrow/*.pyx" "pyarrow/*.pxd" \
    "pyarrow/includes/*" "pyarrow/libarrow_python.so" "pyarrow/libarrow_python.so.*.*.*" \
    "pyarrow/libarrow_python_parquet_encryption.so" "pyarrow/libarrow_python_parquet_encryption.so.*.*.*"
done
for f in "$OUTDIR"/stage2/pandas-*.whl; do
  "$PY" "$ROOT/scripts/trim_wheel.py" "$f" "pandas/tests/*"
done
for d in stage1 stage2; do
  echo "gpu_wheels: $OUTDIR/$d: $(ls "$OUTDIR/$d"/*.whl | wc -l) wheels, $(du -sh "$OUTDIR/$d" | cut -f1)"
done
