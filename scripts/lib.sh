# Shell helpers shared by scripts/reproduce_paper.sh and scripts/train_stage1.sh. Sourced, never run:
#   source "$ROOT/scripts/lib.sh"
# They use $PYTHON (default: the project's .venv) for the one HTTP check.

_LIB_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

answers() {   # URL: does an OpenAI-compatible server answer at URL/models?
  "${PYTHON:-$_LIB_ROOT/.venv/bin/python}" -c 'import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/models", timeout=5)
except Exception:
    sys.exit(1)' "$1"
}

stop_group() {   # PID SECONDS: stop the process group PID leads (started with setsid: vLLM's
                 # tensor-parallel workers hold GPU memory too): SIGTERM, up to SECONDS for the
                 # group to go, then SIGKILL. False (and nothing sent) when PID is not running.
  local pid=$1 secs=$2 i
  kill -0 "$pid" 2>/dev/null || return 1
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
  for ((i = 0; i < secs; i++)); do
    kill -0 -- "-$pid" 2>/dev/null || break
    sleep 1
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
