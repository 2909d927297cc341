"""The environment scripts' choices that need no install: which interpreter setup_verl.sh takes,
which torch build setup.sh selects, and where setup_vllm_gpu.sh takes its vLLM pin from.

    pytest tests/training/test_setup_scripts.py -q
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

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


VLLM_GPU_PINS = REPO / "training" / "verl" / "requirements-vllm-gpu.txt"


def _pins(path: Path) -> dict[str, str]:
    """{name: version} of a requirements file; AssertionError on any line that is not name==version."""
    import re

    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)", line)
        assert m, f"{path}:{n}: {line!r} is not pinned with == (a range, a marker or an extra floats)"
        assert m.group(1).lower() not in out, f"{path}:{n}: {m.group(1)} twice"
        out[m.group(1).lower()] = m.group(2)
    return out


def test_the_gpu_vllm_pins_are_exact_and_verls_vllm_extra():
    """Every requirement of .venv-vllm-gpu is pinned with ==, so two installs give the same versions
    of everything named; the five verl 0.9.1's `vllm` extra pins are the extra's (its METADATA), and
    transformers is one of them (issue 46 item 3: it floated before)."""
    pins = _pins(VLLM_GPU_PINS)
    assert {k: pins[k] for k in ("vllm", "torch", "torchvision", "torchaudio", "transformers")} == {
        "vllm": "0.24.0", "torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0", "transformers": "5.9.0"}
    text = VLLM_GPU.read_text()
    assert 'PINS="${VLLM_GPU_LOCK:-$ROOT/training/verl/requirements-vllm-gpu.txt}"' in text
    assert f"VLLM_VERSION={pins['vllm']}" in text
    verl_gpu = (REPO / "scripts" / "setup_verl.sh").read_text()
    assert '-c "$VLLM_GPU_PINS"' in verl_gpu and "requirements-vllm-gpu.txt" in verl_gpu
    for other in ("requirements.txt", "requirements-gpu.txt"):     # verl's own sets are exact too
        _pins(REPO / "training" / "verl" / other)


def test_a_floating_requirement_is_refused(tmp_path):
    bad = tmp_path / "r.txt"
    bad.write_text("vllm==0.24.0\ntransformers>=5.9\n")
    with pytest.raises(AssertionError, match=r"r.txt:2: 'transformers>=5.9' is not pinned"):
        _pins(bad)


def test_setup_vllm_gpu_installs_the_pins_on_a_gpu_node(tmp_path):
    bin_, log = _fake_gpu_node(tmp_path)
    env = {"PATH": f"{bin_}:{_tools(tmp_path)}", "HOME": str(tmp_path), "VLLM_GPU_VENV": str(tmp_path / "v")}
    r = subprocess.run(["/bin/bash", str(VLLM_GPU)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text()
    assert f"-m pip install -q --disable-pip-version-check -r {VLLM_GPU_PINS}" in calls, calls
    assert "-m pip freeze --all" in calls                       # the whole environment recorded
    r2 = subprocess.run(["/bin/bash", str(VLLM_GPU)], env=env, capture_output=True, text=True, timeout=60)
    assert r2.returncode == 0 and "already holds every pin" in r2.stdout   # idempotent
    lock = tmp_path / "freeze.txt"
    lock.write_text("vllm==0.24.0\n")
    env3 = {**env, "VLLM_GPU_VENV": str(tmp_path / "v3"), "VLLM_GPU_LOCK": str(lock)}
    r3 = subprocess.run(["/bin/bash", str(VLLM_GPU)], env=env3, capture_output=True, text=True, timeout=60)
    assert r3.returncode == 0 and f"-r {lock}" in log.read_text()       # a recorded set, installed again


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
