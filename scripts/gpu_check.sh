#!/usr/bin/env bash
# The one prepared GPU check (issue 46): one command of at most 9 minutes on a borrowed H200 (a
# bare image: Python 3.12 with torch, transformers, accelerate, peft, pyarrow, pandas; no package
# index), carrying the working tree and .whl/check (what the image lacks: orjson, bitsandbytes
# trimmed to one CUDA library, trl, datasets, dill, multiprocess; `bash scripts/gpu/gpu_wheels.sh`).
# Phases, each cut at its share of the budget, figures written to OUT whatever happened:
#   0. environment  `python3 -m pip list` (OUT/pip-list.txt), the GPU, the carried wheels
#   1. stage 1      the production stage-1 path (training/stage1/gpu_check.py): the production
#                   launch config (FSDP), prompts of 8,192 tokens + completions of 1,024, 8-bit
#                   AdamW, sharded checkpoints, stop at step 2 and resume to 4, the bf16 export
#                   reloaded on the GPU; peak memory and the production extrapolation
#                   (OUT/gpu_check.json, OUT/stage1.log)
#   2. stage 2      the TRL GRPO path (training/stage2/gpu_check.py) at the production learning
#                   rate with float32 masters and bf16 autocast: a format warm-start, 2 GRPO steps;
#                   asserts a reward spread and that the update was kept (OUT/gpu_stage2.json,
#                   OUT/stage2.log)
#   (the learning check does not fit: SmolLM2 cannot travel in one command, and a model built on
#   the machine learns nothing the ablation measures; scripts/gpu_ablation.sh runs it on a node
#   of one's own)
# OUT/summary.json: each phase's status and seconds, the budget, the versions that ran.
#   bash scripts/gpu_check.sh --dry-run        # here: payload size, estimated time, the device call
#   bash scripts/gpu_check.sh [OUT]            # on the GPU machine (OUT defaults to $OUT)
#   bash scripts/gpu_check.sh --tiny [OUT]     # the same phases on CPU with tiny shapes (the test)
# GPU_CHECK_BUDGET_S (default 540) is the whole command's budget; stage 1 gets at most
# GPU_CHECK_STAGE1_S (default 330) of it. Disk: ~32 GiB (stage 1's model, checkpoints, export).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
T0=$SECONDS
BUDGET="${GPU_CHECK_BUDGET_S:-540}"
STAGE1_S="${GPU_CHECK_STAGE1_S:-330}"
WHEELS=.whl/check
CARRY_LIMIT=$((64 * 1048576))
# ESTIMATES (nothing of this has run on a GPU yet), seconds on one H200: stage 1 builds a 2.0B-
# parameter model on the CPU (~60), two launches of 2 steps at 8,192 + 1,024 tokens with a 12 GB
# sharded checkpoint each (~2 × 90), export and reload (~40); stage 2 builds a 0.6B model, 40
# warm-up steps and 2 GRPO steps of 32 completions of 512 tokens (~150); imports and pip (~30)
EST_ENV=30 EST_STAGE1=280 EST_STAGE2=150
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
say() { echo "gpu_check: $*"; }

TINY=0 DRY=0 PHASE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) TINY=1 ;;
    --dry-run) DRY=1 ;;
    --phase) PHASE=$2; shift ;;          # (internal) one phase, run under `timeout` by the main path
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) say "unknown argument $1 (--dry-run, --tiny, OUT)" >&2; exit 2 ;;
    *) OUT_ARG=$1 ;;
  esac
  shift
done
if ((TINY)); then   # the project's environment: the carried cp312 wheels are for the GPU image only
  PY="${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}"
  WHEEL_SET=none
else
  PY="${PYTHON:-python3}"
  WHEEL_SET=check
fi

# ----------------------------------------------------------------------------- --dry-run (here)
bytes_of() { awk '{s+=$1} END {print s+0}'; }
tree_bytes() {   # what a device call carries without `carry`: tracked + untracked-not-ignored files
  git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | bytes_of
}
if ((DRY)); then
  tree=$(tree_bytes)
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    wheels=$(stat -c %s "$WHEELS"/*.whl | bytes_of)
    wheel_note="$(ls "$WHEELS"/*.whl | wc -l) wheels in $WHEELS"
  else
    wheels=0
    wheel_note="NOT PREPARED: run \`bash scripts/gpu/gpu_wheels.sh\` here first (~5 MB)"
  fi
  total=$((tree + wheels))
  mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
  est=$((EST_ENV + EST_STAGE1 + EST_STAGE2))
  say "payload: working tree $(mib "$tree") + $WHEELS $(mib "$wheels") ($wheel_note) = $(mib "$total") of $(mib "$CARRY_LIMIT")"
  say "estimated time (ESTIMATE, not measured on a GPU): environment ~${EST_ENV} s, stage 1 ~${EST_STAGE1} s" \
      "(cut at ${STAGE1_S} s), stage 2 ~${EST_STAGE2} s: ~${est} s of the ${BUDGET} s budget, plus the machine's start"
  say "device call: run(command='bash scripts/gpu_check.sh \"\$OUT\"', carry=['$WHEELS'], timeout_s=600)"
  say "payload_bytes=$total tree_bytes=$tree wheel_bytes=$wheels estimated_s=$est budget_s=$BUDGET"
  if ((total > CARRY_LIMIT)); then say "the payload is over the 64 MiB a call carries" >&2; exit 1; fi
  exit 0
fi

OUT="${OUT_ARG:-${OUT:-}}"
[ -n "$OUT" ] || OUT="$(mktemp -d -t aftraj-gpu-check.XXXXXX)"
mkdir -p "$OUT"
WORK="${GPU_CHECK_DIR:-$(mktemp -d -t aftraj-gpu-check-work.XXXXXX)}"
export GPU_CHECK_DIR="$WORK"    # the phases' run folders (kept: GPU_CHECK_DIR=/path names them)

# ----------------------------------------------------------------------------- the phases
stage1() {   # the production stage-1 path: prepare, stop at step 2, resume to 4, verify
  local dir="$WORK/stage1" acc=configs/accelerate/fsdp-2xh200.yaml cfg verify=()
  mkdir -p "$dir"
  if ((TINY)); then
    acc="$dir/one-cpu.yaml"   # one CPU process, no FSDP (FSDP needs a GPU process group here)
    printf 'compute_environment: LOCAL_MACHINE\ndistributed_type: "NO"\nnum_processes: 1\nnum_machines: 1\nmachine_rank: 0\nmixed_precision: "no"\nuse_cpu: true\n' >"$acc"
    cfg="$("$PY" -m training.stage1.gpu_check prepare --root "$dir" --tiny | tail -n 1)"
    verify=(--allow-cpu)
  else
    cfg="$("$PY" -m training.stage1.gpu_check prepare --root "$dir" | tail -n 1)"
  fi
  for args in "--stop-at-step 2" "--resume"; do
    # shellcheck disable=SC2086  # two words
    "$PY" -m accelerate.commands.launch --config_file "$acc" --num_processes 1 \
      -m training.stage1 --phase train --config "$cfg" --no-progress $args
  done
  "$PY" -m training.stage1.gpu_check verify --root "$dir" --pairs "${PROD_PAIRS:-1100}" "${verify[@]}" \
    --figures-dir "$OUT"
  say "disk used by stage 1: $(du -sh "$dir" | cut -f1)"
}

stage2() {   # the TRL path at the production learning rate, float32 masters, bf16 autocast
  local tiny=()
  ((TINY)) && tiny=(--tiny)
  "$PY" -m training.stage2.gpu_check "${tiny[@]}" --out "$WORK/stage2" --figures-dir "$OUT"
}

if [ -n "$PHASE" ]; then
  # shellcheck source=scripts/gpu/gpu_site.sh
  [ -n "${GPU_SITE_DONE:-}" ] || { source "$ROOT/scripts/gpu/gpu_site.sh"; gpu_site "$WHEEL_SET" torch transformers accelerate yaml orjson; }
  case "$PHASE" in stage1|stage2) "$PHASE" ;; *) say "unknown phase $PHASE" >&2; exit 2 ;; esac
  exit 0
fi

# ----------------------------------------------------------------------------- summary (on any exit)
declare -A STATUS=([environment]="not run" [stage1]="not run" [stage2]="not run") SECS=([stage1]=0 [stage2]=0)
write_summary() {   # OUT/summary.json: each phase's status and seconds, the versions that ran
  "$PY" - "$OUT/summary.json" "$BUDGET" $((SECONDS - T0)) "$TINY" "${STATUS[environment]}" \
    "${STATUS[stage1]}" "${SECS[stage1]}" "${STATUS[stage2]}" "${SECS[stage2]}" <<'EOF_PY' || true
import importlib.metadata as md, json, platform, sys
path, budget, wall, tiny, env, s1, t1, s2, t2 = sys.argv[1:]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
try:
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    cuda = torch.version.cuda
except Exception as e:              # the summary is written whatever happened
    device, cuda = f"torch failed: {e}", None
names = ["torch", "transformers", "accelerate", "trl", "peft", "datasets", "bitsandbytes", "pyarrow", "orjson"]
summary = {"budget_s": int(budget), "wall_s": int(wall), "tiny": tiny == "1", "device": device, "cuda": cuda,
           "python": platform.python_version(), "environment": env,
           "phases": {"stage1": {"status": s1, "seconds": int(t1)}, "stage2": {"status": s2, "seconds": int(t2)},
                      "learning": {"status": "not run: does not fit one command (docs/gpu.md)", "seconds": 0}},
           "versions": {n: version(n) for n in names}}
json.dump(summary, open(path, "w"), indent=2)
print(json.dumps({"environment": env, **summary["phases"]}))
EOF_PY
}
trap write_summary EXIT

# ----------------------------------------------------------------------------- 0. environment
say "out $OUT, work $WORK, budget ${BUDGET} s"
"$PY" -m pip list >"$OUT/pip-list.txt" 2>/dev/null || echo "(no pip: $("$PY" -V 2>&1))" >"$OUT/pip-list.txt"
STATUS[environment]="failed: no CUDA device"
if ((!TINY)); then
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device (--tiny: the CPU path)")'
fi
# shellcheck source=scripts/gpu/gpu_site.sh
source "$ROOT/scripts/gpu/gpu_site.sh"
MODULES=(torch transformers accelerate yaml orjson safetensors)
((TINY)) || MODULES+=(bitsandbytes)
STATUS[environment]="failed: the carried wheels did not install or a module is missing (pip-list.txt)"
gpu_site "$WHEEL_SET" "${MODULES[@]}"
STATUS[environment]=ready
export GPU_SITE_DONE=1          # the phases inherit PYTHONPATH
STAGE2_MODULES=(trl datasets peft)
missing2="$("$PY" -c 'import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "${STAGE2_MODULES[@]}")"

run_phase() {   # NAME SECONDS: the phase in a child process, stopped at SECONDS; its log in OUT
  local name=$1 limit=$2 t=$SECONDS rc=0
  if ((limit < 20)); then STATUS[$name]="skipped: ${limit} s left of the budget"; SECS[$name]=0; return; fi
  say "== $name (at most $limit s)"
  timeout --signal=TERM --kill-after=15 "$limit" bash "$0" --phase "$name" $( ((TINY)) && echo --tiny ) "$OUT" \
    2>&1 | tee "$OUT/$name.log" || rc=$?
  SECS[$name]=$((SECONDS - t))
  case $rc in
    0) STATUS[$name]=passed ;;
    124|137) STATUS[$name]="stopped at ${limit} s (budget)" ;;
    *) STATUS[$name]="failed (exit $rc)" ;;
  esac
  say "$name: ${STATUS[$name]} in ${SECS[$name]} s"
}
left() { echo $((BUDGET - (SECONDS - T0))); }

# ----------------------------------------------------------------------------- 1. stage 1, 2. stage 2
l=$(left); run_phase stage1 $((l < STAGE1_S ? l : STAGE1_S))
if [ -n "$missing2" ]; then
  STATUS[stage2]="skipped: $PY cannot import $missing2 (carry them in $WHEELS)"; SECS[stage2]=0
else
  run_phase stage2 "$(left)"
fi

say "wall $((SECONDS - T0)) s; figures and logs in $OUT"
[ "${STATUS[stage1]}" = passed ] && [ "${STATUS[stage2]}" = passed ]
