"""scripts/train_stage2_verl.sh on CPU, with a stand-in for `aftraj` (PYTHON): the script parses
(it did not: an apostrophe inside "${HEAD_IP:?…}" left the `case` unterminated), one node passes
its arguments through, and several nodes need an --out that every node shares.

    pytest tests/training/test_train_stage2_verl_script.py -q
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "train_stage2_verl.sh"


def _run(tmp_path: Path, *args: str, **env) -> subprocess.CompletedProcess:
    fake = tmp_path / "fake-python"
    fake.write_text('#!/bin/sh\necho "aftraj called: $*"\n')
    fake.chmod(0o755)
    e = {**os.environ, "PYTHON": str(fake), **env}
    e.pop("NNODES", None)
    e.update(env)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=e, capture_output=True, text=True, timeout=60)


def test_script_parses():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_one_node_passes_the_arguments_to_aftraj(tmp_path):
    r = _run(tmp_path, "--config", "c.yaml", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert "aftraj called: -m aftraj.cli train stage2 --engine verl" in r.stdout and "--out" in r.stdout


def test_several_nodes_refuse_a_local_out(tmp_path):
    r = _run(tmp_path, "--config", "c.yaml", "--out", str(tmp_path / "o"), NNODES="2")
    assert r.returncode == 2 and "node-local filesystem" in r.stderr and str(tmp_path / "o") in r.stderr
    assert "aftraj called" not in r.stdout
    r = _run(tmp_path, "--config", "c.yaml", NNODES="2")
    assert r.returncode == 2 and "needs --out" in r.stderr


def test_several_nodes_with_a_shared_out(tmp_path):
    r = _run(tmp_path, "--config", "c.yaml", f"--out={tmp_path / 'o'}", NNODES="2", OUT_IS_SHARED="1")
    assert r.returncode == 0, r.stderr
    assert "--set verl_nnodes=2" in r.stdout
