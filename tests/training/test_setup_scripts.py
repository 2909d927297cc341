"""The environment scripts' choices that need no install: which interpreter setup_verl.sh takes,
which torch build setup.sh selects, and where setup_vllm_gpu.sh takes its vLLM pin from.

    pytest tests/training/test_setup_scripts.py -q
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _fake_python(folder: Path, name: str, version: str) -> None:
    """An interpreter that answers setup_verl.sh's version probe as Python `version` would."""
    major, minor = version.split(".")
    (folder / name).write_text("#!/bin/sh\n"
                               f'[ "$1" = -c ] && [ {major} -eq 3 ] && [ {minor} -ge 10 ] && [ {minor} -le 12 ]\n')
    (folder / name).chmod(0o755)


def _tools(tmp_path: Path) -> Path:
    """A PATH folder with the few tools the scripts use and no Python of this machine."""
    import shutil

    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for t in ("grep", "dirname", "cat", "cut", "sha256sum", "sed", "uname", "mkdir"):
        if shutil.which(t) and not (tools / t).exists():
            (tools / t).symlink_to(shutil.which(t))
    return tools


def _setup_verl(tmp_path: Path, path: str, **env) -> subprocess.CompletedProcess:
    e = {"PATH": f"{path}:{_tools(tmp_path)}", "HOME": str(tmp_path), "VERL_VENV": str(tmp_path / "venv"), **env}
    return subprocess.run(["/bin/bash", str(REPO / "scripts" / "setup_verl.sh")], env=e, capture_output=True,
                          text=True, timeout=60)


def test_setup_verl_refuses_when_no_python_310_to_312(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _fake_python(bin_, "python3", "3.13")         # e.g. a newer Ubuntu's only Python
    r = _setup_verl(tmp_path, str(bin_))
    assert r.returncode == 1 and "no Python 3.10-3.12" in r.stderr, r.stderr
    assert not (tmp_path / "venv").exists()


def test_setup_verl_refuses_a_named_python_of_the_wrong_version(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _fake_python(bin_, "python3.9", "3.9")
    r = _setup_verl(tmp_path, str(bin_), PYTHON=str(bin_ / "python3.9"))
    assert r.returncode == 1 and "is not a Python 3.10-3.12" in r.stderr, r.stderr


def test_setup_verl_takes_python312_first(tmp_path):
    """Ubuntu 24.04 LTS has python3.12 and no python3.11: it is found and used (the fake then
    fails `-m venv`, so nothing is installed)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _fake_python(bin_, "python3.12", "3.12")
    (bin_ / "python3.12").write_text('#!/bin/sh\nif [ "$1" = -c ]; then exit 0; fi\necho "venv by $0 $*" >&2\nexit 3\n')
    r = _setup_verl(tmp_path, str(bin_))
    assert r.returncode == 3 and "venv by" in r.stderr and "python3.12 -m venv" in r.stderr, r.stderr
