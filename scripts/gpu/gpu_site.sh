# Sourced by scripts/gpu_check.sh: make the check's Python dependencies importable on the
# borrowed GPU machine (its image: Python 3.12 + torch + transformers + accelerate + ..., no
# package index). `gpu_site NAME` installs the wheels that scripts/gpu/gpu_wheels.sh put in
# .whl/NAME/ into a temporary folder (pip install --no-index --no-deps --target; plain unzip when
# the machine has no pip) and puts it on PYTHONPATH after the repository. Without .whl/NAME, the
# interpreter must already import them (e.g. the project's .venv).
#   PY=python3; source scripts/gpu/gpu_site.sh; gpu_site check orjson bitsandbytes
gpu_site() {   # NAME MODULE...: .whl/NAME installed into a temporary target, MODULEs checked
  local name=$1; shift
  local wheels="$ROOT/.whl/$name"
  if compgen -G "$wheels/*.whl" >/dev/null; then
    # a folder named site-packages: dill (datasets' fingerprint) pickles a module outside the
    # interpreter's prefix BY VALUE unless its path holds "site-packages" (dill _is_builtin_module),
    # and pickling pyarrow by value fails ("Can't pickle <class 'MonthDayNano'>")
    GPU_SITE="$(mktemp -d -t aftraj-gpu-site.XXXXXX)/site-packages"
    if "$PY" -m pip --version >/dev/null 2>&1; then
      "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$GPU_SITE" "$wheels"/*.whl
    else
      "$PY" -c 'import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])' "$GPU_SITE" "$wheels"/*.whl
    fi
    echo "gpu_site: $(compgen -G "$wheels/*.whl" | wc -l) wheels from $wheels in $GPU_SITE"
  else
    GPU_SITE=""
  fi
  export PYTHONPATH="$ROOT${GPU_SITE:+:$GPU_SITE}${PYTHONPATH:+:$PYTHONPATH}"
  local missing
  missing="$("$PY" -c 'import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "$@")"
  if [ -n "$missing" ]; then
    echo "gpu_site: $PY cannot import: $missing; run \`bash scripts/gpu/gpu_wheels.sh\` where an index is" \
         "reachable and carry .whl/ (or use an environment that has them)" >&2
    return 1
  fi
}
