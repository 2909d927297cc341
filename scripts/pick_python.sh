# Sourced by scripts/setup_verl.sh and scripts/setup_vllm_gpu.sh: `pick_python TAG` sets PYTHON
# to the interpreter for a new venv: $PYTHON if given (refused unless 3.10-3.12), else the first
# of python3.12, python3.11, python3.10, python3 that is 3.10-3.12 (verl 0.9.1's Requires-Python;
# current Ubuntu LTS has 3.12 and no 3.11). TAG prefixes the messages.
py_ok() { "$1" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 12) else 1)' 2>/dev/null; }
pick_python() {
  if [ -n "${PYTHON:-}" ]; then
    py_ok "$PYTHON" || { echo "[$1] PYTHON=$PYTHON is not a Python 3.10-3.12 (verl 0.9.1 needs one)" >&2; return 1; }
    return 0
  fi
  for p in python3.12 python3.11 python3.10 python3; do
    if command -v "$p" >/dev/null && py_ok "$p"; then PYTHON="$p"; return 0; fi
  done
  echo "[$1] no Python 3.10-3.12 found (verl 0.9.1 needs one); set PYTHON" >&2
  return 1
}
