#!/usr/bin/env bash
# The paper's production sequence on a GPU node (8×H200; stage 1 uses NPROC_PER_NODE of them):
#   1. corpus     through an OpenAI-compatible endpoint (configs/corpus/openai-local.yaml)
#   2. warm-up    NONE: the paper has no format warm-up (`aftraj train warmup` is the CPU demo's)
#   3. stage 1    BPPO, preferences sampled from a vLLM server, then `accelerate launch` FSDP on 2×H200
#   4. stage 2    GRPO with verl from the stage-1 checkpoint; verl's FSDP shards merged to final/
#   5. evaluate   the final checkpoint served by vLLM (`aftraj eval --auditor openai`) on the corpus
#                 test split and on Who&When, beside `rules` and the content-blind floors
#                 (heuristic:position-prior, heuristic:length: corpus only, they fit on a train
#                 split and Who&When has none), then `aftraj eval compare`; the server is stopped.
#
#   bash scripts/reproduce_paper.sh --dry-run      # validate every config, print every command (no GPU)
#   bash scripts/reproduce_paper.sh                # the run; a phase whose output exists is skipped
#   OUT=runs/paper-b MODEL=/data/Qwen2.5-7B-Instruct bash scripts/reproduce_paper.sh --dry-run
#
# Every variable below can be set from the environment. The configs are validated first by
# aftraj/drivers/reproduce.py with the loaders the run uses; the copies whose endpoint, process count
# or model a variable changes are written to $OUT/configs/. Needs: .venv (scripts/setup.sh),
# .venv-verl (bash scripts/setup_verl.sh --gpu) and a GPU vLLM in $VLLM_PYTHON's environment,
# the base model in a local folder. Servers started here are stopped on exit, error or Ctrl-C.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# --- variables (override any from the environment)
: "${OUT:=runs/paper}"                                   # everything the run writes
: "${MODEL:=/models/Qwen2.5-7B-Instruct}"               # base model, a local folder
# the project's environment: .venv when set up here, else the python3 on PATH (a pip install elsewhere)
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON="$(command -v python3)"; fi
fi
: "${VLLM_PYTHON:=$ROOT/.venv-vllm-gpu/bin/python}"     # GPU vLLM (corpus, sampling, serving)
: "${VERL_PYTHON:=$ROOT/.venv-verl/bin/python}"         # verl's environment (stage 2, merge)
# (1) corpus: the agents' policy and the judge behind one OpenAI-compatible endpoint
: "${CORPUS_CONFIG:=configs/corpus/openai-local.yaml}"
: "${CORPUS_PORT:=8000}"
: "${CORPUS_URL:=http://127.0.0.1:$CORPUS_PORT/v1}"
: "${CORPUS_MODEL:=Qwen/Qwen2.5-7B-Instruct}"           # the name the endpoint serves
# started before the build and stopped after it; set CORPUS_SERVER_CMD= (empty) for an endpoint
# that already runs (an API: export its key as the config's api_key_env). Tensor parallel must
# divide Qwen2.5-7B's 28 attention heads (and 4 KV heads): 1, 2 or 4, never 8.
CORPUS_SERVER_CMD="${CORPUS_SERVER_CMD-$VLLM_PYTHON -m vllm.entrypoints.openai.api_server --model $MODEL --served-model-name $CORPUS_MODEL --port $CORPUS_PORT --tensor-parallel-size 2 --generation-config vllm}"
# (3) stage 1
: "${STAGE1_CONFIG:=configs/stage1/qwen2.5-7b-2xh200.yaml}"
: "${ACCELERATE_CONFIG:=configs/accelerate/fsdp-2xh200.yaml}"
: "${NPROC_PER_NODE:=2}"                                # global batch = per_device × NPROC × accumulation
: "${SAMPLER_PORT:=8000}"
: "${SAMPLER_URL:=http://127.0.0.1:$SAMPLER_PORT/v1}"
: "${SAMPLER_MODEL:=Qwen2.5-7B-Instruct}"
SAMPLER_SERVER_CMD="${SAMPLER_SERVER_CMD-$VLLM_PYTHON -m vllm.entrypoints.openai.api_server --model $MODEL --served-model-name $SAMPLER_MODEL --port $SAMPLER_PORT --tensor-parallel-size 2 --generation-config vllm}"
# (4) stage 2
: "${STAGE2_CONFIG:=configs/stage2/qwen2.5-7b-8xh200.yaml}"
: "${GPUS_PER_NODE:=8}"
# (5) serving and evaluation
: "${SERVE_CONFIG:=configs/serve/vllm-qwen2.5-7b-h200.yaml}"
: "${SERVE_PORT:=8000}"
: "${SERVED_NAME:=auditor}"
: "${WW_DATA:=who_and_when}"                            # the built-in Who&When copy
: "${EVAL_CONCURRENCY:=32}"
: "${SERVER_WAIT_S:=900}"
export OUT MODEL VLLM_PYTHON VERL_PYTHON CORPUS_CONFIG CORPUS_URL CORPUS_MODEL STAGE1_CONFIG SAMPLER_URL SAMPLER_MODEL \
       ACCELERATE_CONFIG NPROC_PER_NODE STAGE2_CONFIG GPUS_PER_NODE SERVE_CONFIG SERVE_PORT SERVED_NAME
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "reproduce_paper: unknown argument $arg (--dry-run, --help)" >&2; exit 2 ;;
  esac
done
# every vLLM server this script starts decodes what the requests say: `--generation-config vllm`
# (serve/vllm.py GENERATION_CONFIG; without it vLLM fills unset fields from the model's
# generation_config.json, Qwen2.5's repetition_penalty 1.05 and top_k 20 among them)
for var in CORPUS_SERVER_CMD SAMPLER_SERVER_CMD; do
  cmd="${!var}"
  if [[ "$cmd" == *vllm* && "$cmd" != *"--generation-config vllm"* ]]; then
    echo "reproduce_paper: $var starts vLLM without --generation-config vllm (the model's" \
         "generation_config.json would set the sampling fields the requests leave unset): add it" >&2
    exit 1
  fi
done
AFTRAJ=("$PYTHON" -m aftraj.cli)
SERVE_URL="http://127.0.0.1:$SERVE_PORT/v1"
EVAL="$OUT/eval"
CMDS=""
SERVER_PID=""

# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"   # answers URL, stop_group PID SECONDS

stop_server() {
  if [[ -n "$SERVER_PID" ]] && stop_group "$SERVER_PID" 60; then
    echo "reproduce_paper: server (pid $SERVER_PID) stopped"
  fi
  SERVER_PID=""
}
cleanup() { stop_server; [[ -z "$CMDS" ]] || rm -f "$CMDS"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

step() {   # print the command; run it, or (dry run) record it for the flag check
  printf '+'; printf ' %q' "$@"; printf '\n'
  if ((DRY)); then printf '%q ' "$@" >>"$CMDS"; printf '\n' >>"$CMDS"; else "$@"; fi
}

start_server() {   # NAME URL CMD…: start CMD in its own process group, wait until URL answers
  local name=$1 url=$2; shift 2
  printf '+ (background, log %s)' "$OUT/logs/$name.log"; printf ' %q' "$@"; printf '\n'
  if ((DRY)); then printf '%q ' "$@" >>"$CMDS"; printf '\n' >>"$CMDS"; return 0; fi
  if answers "$url"; then
    echo "reproduce_paper: something already answers at $url; stop it first" >&2; exit 1
  fi
  mkdir -p "$OUT/logs"
  setsid "$@" >"$OUT/logs/$name.log" 2>&1 &
  SERVER_PID=$!
  for ((i = 0; i < SERVER_WAIT_S; i += 5)); do
    answers "$url" && { echo "reproduce_paper: $name answers at $url (pid $SERVER_PID)"; return 0; }
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "reproduce_paper: $name exited; see $OUT/logs/$name.log" >&2; exit 1; }
    sleep 5
  done
  echo "reproduce_paper: no answer from $name at $url after $SERVER_WAIT_S s; see $OUT/logs/$name.log" >&2
  exit 1
}

skip() {   # PATH PHASE: true (and says so) when PATH exists and this is a real run
  if ((!DRY)) && [[ -e "$1" ]]; then echo "reproduce_paper: $2: $1 exists, skipped"; return 0; fi
  return 1
}

# --- 0. every config, validated with the loaders the run uses
echo "== configs (aftraj/drivers/reproduce.py)"
"$PYTHON" -m aftraj.drivers.reproduce configs
# one token budget (aftraj.tokens.prompt_budget): the stage configs' max_prompt_tokens less the
# chat template's margin for rendering, stage 2's max_completion_length for the answer
BUDGET="$("$PYTHON" -m aftraj.drivers.reproduce budget)"
read -r RENDER_BUDGET RESPONSE_TOKENS <<<"$BUDGET"
echo "   budget: render $RENDER_BUDGET tokens, respond with up to $RESPONSE_TOKENS (every phase)"
if ((DRY)); then CMDS="$(mktemp)"; fi

# --- 1. corpus through the OpenAI-compatible endpoint
echo "== 1. corpus ($CORPUS_CONFIG, endpoint $CORPUS_URL, model $CORPUS_MODEL)"
if ! skip "$OUT/corpus/COMPLETE" corpus; then
  if [[ -n "$CORPUS_SERVER_CMD" ]]; then
    # shellcheck disable=SC2086  # the command is a line of words, like SAMPLER_SERVER_CMD
    start_server corpus-endpoint "$CORPUS_URL" $CORPUS_SERVER_CMD
  fi
  step "${AFTRAJ[@]}" corpus build --config "$OUT/configs/corpus.yaml" --out "$OUT/corpus" --no-progress
  stop_server
  if ((!DRY)); then   # an endpoint that answers /models but fails every call builds an empty corpus
    [[ -s "$OUT/corpus/train.jsonl" ]] || { echo "reproduce_paper: $OUT/corpus/train.jsonl is empty; see" \
      "$OUT/corpus/stats.md and $OUT/logs/corpus-endpoint.log" >&2; exit 1; }
    touch "$OUT/corpus/COMPLETE"
  fi
fi

# --- 2. no warm-up
echo "== 2. warm-up: none (not in the paper; stage 1 starts from $MODEL)"

# --- 3. stage 1: preferences through a vLLM sampler, then accelerate launch (FSDP)
echo "== 3. stage 1 ($STAGE1_CONFIG, accelerate $ACCELERATE_CONFIG, $NPROC_PER_NODE processes)"
if ! skip "$OUT/stage1/final" "stage 1"; then
  RESUME=()   # an interrupted run continues from its latest checkpoint (the trainer refuses otherwise)
  if compgen -G "$OUT/stage1/checkpoint-*" >/dev/null; then RESUME=(--resume); fi
  step env ACCELERATE_CONFIG="$OUT/configs/accelerate.yaml" SAMPLER_SERVER_CMD="$SAMPLER_SERVER_CMD" \
    SAMPLER_WAIT_S="$SERVER_WAIT_S" PYTHON="$PYTHON" \
    bash scripts/train_stage1.sh --config "$STAGE1_CONFIG" --model "$MODEL" --data "$OUT/corpus" \
    --out "$OUT/stage1" --set "openai_base_url=$SAMPLER_URL" --set "openai_model=$SAMPLER_MODEL" --no-progress "${RESUME[@]}"
fi

# --- 4. stage 2: verl from the stage-1 checkpoint, then its FSDP shards merged into final/
echo "== 4. stage 2 ($STAGE2_CONFIG, verl $VERL_PYTHON, $GPUS_PER_NODE GPUs)"
if ! skip "$OUT/stage2/final" "stage 2"; then
  RESUME=()   # verl resumes from its latest checkpoint (resume_mode auto)
  if [[ -e "$OUT/stage2/verl/latest_checkpointed_iteration.txt" ]]; then RESUME=(--resume); fi
  step "${AFTRAJ[@]}" train stage2 --engine verl --verl-python "$VERL_PYTHON" --config "$STAGE2_CONFIG" \
    --init "$OUT/stage1/final" --data "$OUT/corpus" --out "$OUT/stage2" --set "verl_gpus_per_node=$GPUS_PER_NODE" \
    "${RESUME[@]}"
  if ((DRY)); then ITER="N"; else ITER="$(cat "$OUT/stage2/verl/latest_checkpointed_iteration.txt")"; fi
  step "$VERL_PYTHON" -m verl.model_merger merge --backend fsdp \
    --local_dir "$OUT/stage2/verl/global_step_$ITER/actor" --target_dir "$OUT/stage2/final"
fi

# --- 5. serve the final checkpoint with vLLM, evaluate through it, then the floors and rules
echo "== 5. evaluation ($SERVE_CONFIG as $SERVED_NAME at $SERVE_URL; corpus test split and $WW_DATA)"
declare -A DATA=([corpus]="$OUT/corpus" [ww]="$WW_DATA")
declare -A SPLIT=([corpus]="--split=test" [ww]="--split=all")
# an evaluation killed mid-walk left its folder: continue it (eval refuses an existing folder otherwise)
resume_if() { if [ -e "$1" ]; then echo --resume; fi; }
if ! { skip "$EVAL/corpus-auditor/metrics.json" "eval corpus" && skip "$EVAL/ww-auditor/metrics.json" "eval ww"; }; then
  start_server vllm-auditor "$SERVE_URL" "${AFTRAJ[@]}" serve vllm --config "$OUT/configs/serve.yaml" \
    --log "$OUT/logs/vllm-auditor.server.log"
  for d in corpus ww; do
    skip "$EVAL/$d-auditor/metrics.json" "eval $d" && continue
    # the training budget, counted with the served checkpoint's tokenizer (the merged folder holds it)
    step "${AFTRAJ[@]}" eval --auditor openai --endpoint "$SERVE_URL" --api-model "$SERVED_NAME" \
      --model "$OUT/stage2/final" --budget "$RENDER_BUDGET" --max-new-tokens "$RESPONSE_TOKENS" \
      --data "${DATA[$d]}" "${SPLIT[$d]}" --concurrency "$EVAL_CONCURRENCY" --out "$EVAL/$d-auditor" $(resume_if "$EVAL/$d-auditor") --no-progress
  done
  stop_server
fi
for spec in rules heuristic:position-prior heuristic:length; do
  for d in corpus ww; do
    [[ $d == ww && $spec == heuristic:* ]] && continue      # floors fit on a train split: none in Who&When
    name="$d-${spec#heuristic:}"
    skip "$EVAL/$name/metrics.json" "eval $name" && continue
    step "${AFTRAJ[@]}" eval --auditor "$spec" --data "${DATA[$d]}" "${SPLIT[$d]}" --out "$EVAL/$name" $(resume_if "$EVAL/$name") --no-progress
  done
done
step "${AFTRAJ[@]}" eval compare "$EVAL/corpus-auditor" "$EVAL/corpus-rules" "$EVAL/corpus-position-prior" \
  "$EVAL/corpus-length" --out "$EVAL/compare-corpus"
step "${AFTRAJ[@]}" eval compare "$EVAL/ww-auditor" "$EVAL/ww-rules" --out "$EVAL/compare-ww"

if ((DRY)); then
  echo "== flags of the commands above, and one budget across them (aftraj/drivers/reproduce.py)"
  "$PYTHON" -m aftraj.drivers.reproduce commands "$CMDS"
  echo "  (the verl recipe itself is composed and validated against verl by \`bash scripts/test_verl.sh\`" \
       "in verl's environment; vLLM's flags by the server at start)"
  echo "reproduce_paper: dry run OK: configs valid, commands printed above; nothing was run"
else
  echo "reproduce_paper: done; tables in $EVAL/compare-corpus and $EVAL/compare-ww"
fi
