"""scripts/gpu/gpu_site.sh (sourced by the one GPU check, scripts/gpu_check.sh) and scripts/gpu/trim_wheel.py,
on CPU: wheels in .whl/NAME are installed into a temporary --target and importable after the
repository; a module neither carried nor installed is named; a trimmed wheel installs without the
dropped members.

    pytest tests/training/test_gpu_site.py -q
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _wheel(folder: Path, name: str, files: dict[str, str]) -> Path:
    """A minimal pure-Python wheel of `name` 1.0 holding `files`."""
    folder.mkdir(parents=True, exist_ok=True)
    whl = folder / f"{name}-1.0-py3-none-any.whl"
    di = f"{name}-1.0.dist-info"
    meta = {f"{di}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
            f"{di}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    allf = {**files, **meta}
    record = "".join(f"{p},,\n" for p in allf) + f"{di}/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for p, text in allf.items():
            z.writestr(p, text)
        z.writestr(f"{di}/RECORD", record)
    return whl


def _root(tmp_path: Path) -> Path:
    """A copy of the scripts the helper needs, with its own .whl/ (never the repository's)."""
    root = tmp_path / "repo"
    (root / "scripts" / "gpu").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "gpu" / "gpu_site.sh", root / "scripts" / "gpu")
    return root


def _source(root: Path, *modules: str) -> subprocess.CompletedProcess:
    # dill (datasets' fingerprint) must take the carried modules for installed ones (pickled by
    # reference): by value, pickling pyarrow fails ("Can't pickle <class 'MonthDayNano'>")
    check = ("import carried_mod, dill._dill as d; print(carried_mod.X, "
             "'by-reference' if d._is_builtin_module(carried_mod) else 'by-value')")
    script = (f'set -euo pipefail; ROOT={root}; PY={sys.executable}; source "$ROOT/scripts/gpu/gpu_site.sh"; '
              f'gpu_site demo {" ".join(modules)}; "$PY" -c "{check}"')
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(root), "PIP_CONFIG_FILE": "/dev/null"})


def test_carried_wheels_are_installed_into_a_target_and_imported(tmp_path):
    root = _root(tmp_path)
    _wheel(root / ".whl" / "demo", "carried_mod", {"carried_mod/__init__.py": "X = 'from the carried wheel'\n"})
    r = _source(root, "carried_mod")
    assert r.returncode == 0, r.stderr
    assert "1 wheels from" in r.stdout and "from the carried wheel by-reference" in r.stdout


def test_a_module_neither_carried_nor_installed_is_named(tmp_path):
    root = _root(tmp_path)
    _wheel(root / ".whl" / "demo", "carried_mod", {"carried_mod/__init__.py": "X = 1\n"})
    r = _source(root, "carried_mod", "no_such_module_xyz")
    assert r.returncode != 0 and "cannot import: no_such_module_xyz" in r.stderr and "gpu_wheels.sh" in r.stderr


def test_trimmed_wheel_installs_without_the_dropped_members(tmp_path):
    sys.path.insert(0, str(REPO / "scripts" / "gpu"))
    try:
        from trim_wheel import trim
    finally:
        sys.path.pop(0)
    whl = _wheel(tmp_path / "w", "carried_mod", {"carried_mod/__init__.py": "X = 1\n",
                                                 "carried_mod/libbig_cuda118.so": "x" * 1000,
                                                 "carried_mod/libbig_cuda130.so": "y"})
    dropped = trim(whl, ["carried_mod/libbig_cuda118.so"])
    assert dropped == ["carried_mod/libbig_cuda118.so"]
    names = zipfile.ZipFile(whl).namelist()
    assert "carried_mod/libbig_cuda118.so" not in names and "carried_mod/libbig_cuda130.so" in names
    record = zipfile.ZipFile(whl).read("carried_mod-1.0.dist-info/RECORD").decode()
    assert "cuda118" not in record and "cuda130" in record
    assert "dropped 1 members" in (tmp_path / "w" / "TRIMMED.txt").read_text()
    target = tmp_path / "t"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                        str(target), str(whl)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (target / "carried_mod" / "libbig_cuda130.so").is_file()
    assert not (target / "carried_mod" / "libbig_cuda118.so").exists()
