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
    for t in ("grep", "dirname", "cat", "cut", "sha256sum", "sed", "uname", "mkdir", "chmod", "touch"):
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


# --------------------------------------------------------------------------- the GPU vLLM (issue 22, defect 5)

VLLM_GPU = REPO / "scripts" / "setup_vllm_gpu.sh"


def test_the_gpu_vllm_environment_is_made_where_every_caller_looks():
    """configs/serve's GPU config and reproduce_paper.sh's VLLM_PYTHON name .venv-vllm-gpu: the
    setup script must create exactly that, with an exact vLLM pin."""
    import re

    import yaml

    text = VLLM_GPU.read_text()
    assert re.search(r"^VLLM_VERSION=\d+\.\d+\.\d+$", text, re.M)
    assert 'VENV="${VLLM_GPU_VENV:-$ROOT/.venv-vllm-gpu}"' in text
    serve = yaml.safe_load((REPO / "configs" / "serve" / "vllm-qwen2.5-7b-h200.yaml").read_text())
    assert serve["python"] == ".venv-vllm-gpu/bin/python"
    assert ': "${VLLM_PYTHON:=$ROOT/.venv-vllm-gpu/bin/python}"' in (REPO / "scripts" / "reproduce_paper.sh").read_text()
    assert "setup_vllm_gpu.sh" in (REPO / "README.md").read_text()


def _fake_gpu_node(tmp_path: Path) -> tuple[Path, Path]:
    """nvidia-smi that lists a GPU, and a python3.12 whose venv's python logs its arguments."""
    bin_, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    venv_py = ('#!/bin/sh\necho "$*" >> ' + str(log) + '\n'
               'case "$1" in -c) [ -e "$(dirname "$0")/installed" ];; *) touch "$(dirname "$0")/installed";; esac\n')
    (bin_ / "python3.12").write_text(
        '#!/bin/sh\nif [ "$1" = -c ]; then exit 0; fi\n'
        f'mkdir -p "$3/bin" && cat > "$3/bin/python" <<\'EOF\'\n{venv_py}EOF\nchmod +x "$3/bin/python"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    return bin_, log


def test_setup_vllm_gpu_installs_the_pin_on_a_gpu_node(tmp_path):
    bin_, log = _fake_gpu_node(tmp_path)
    env = {"PATH": f"{bin_}:{_tools(tmp_path)}", "HOME": str(tmp_path), "VLLM_GPU_VENV": str(tmp_path / "v")}
    r = subprocess.run(["/bin/bash", str(VLLM_GPU)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text()
    assert "-m pip install -q --disable-pip-version-check vllm==0.24.0" in calls, calls
    r2 = subprocess.run(["/bin/bash", str(VLLM_GPU)], env=env, capture_output=True, text=True, timeout=60)
    assert r2.returncode == 0 and "already holds vllm==0.24.0" in r2.stdout   # idempotent


def test_setup_vllm_gpu_refuses_without_a_gpu(tmp_path):
    env = {"PATH": str(_tools(tmp_path)), "HOME": str(tmp_path), "VLLM_GPU_VENV": str(tmp_path / "v")}
    r = subprocess.run(["/bin/bash", str(VLLM_GPU)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no NVIDIA GPU" in r.stderr
    assert not (tmp_path / "v").exists()


# --------------------------------------------------------------------------- the project's torch build

def _print_torch(tmp_path: Path, gpu: bool, **env) -> subprocess.CompletedProcess:
    bin_ = tmp_path / ("gpu" if gpu else "cpu")
    bin_.mkdir(exist_ok=True)
    if gpu:
        (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
        (bin_ / "nvidia-smi").chmod(0o755)
    e = {"PATH": f"{bin_}:{_tools(tmp_path)}", "HOME": str(tmp_path), **env}
    return subprocess.run(["/bin/bash", str(REPO / "scripts" / "setup.sh"), "--print-torch"], env=e,
                          capture_output=True, text=True, timeout=60)


def test_setup_selects_the_torch_build_explicitly(tmp_path):
    assert _print_torch(tmp_path, gpu=False).stdout.strip() == "torch==2.13.0+cpu"
    assert _print_torch(tmp_path, gpu=True).stdout.strip() == "torch==2.13.0"
    assert _print_torch(tmp_path, gpu=True, TORCH_BUILD="cpu").stdout.strip() == "torch==2.13.0+cpu"
    r = _print_torch(tmp_path, gpu=False, TORCH_BUILD="rocm")
    assert r.returncode == 2 and "TORCH_BUILD must be cpu or cuda" in r.stderr
