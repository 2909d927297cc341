"""scripts/gpu_check.sh, the one prepared GPU check (issue 46 item 4): `--dry-run` prints the payload
a device call carries and the estimated time; `--tiny` runs every phase on CPU with tiny shapes
(slow: ~4 min on the shared 2-core machine), so the script cannot rot; `gpu` runs it on an H200.

    pytest tests/training/test_gpu_check_script.py -q
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
RETURNS = {"pip-list.txt", "summary.json", "gpu_check.json", "gpu_stage2.json", "stage1.log", "stage2.log"}


def _figures(out: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"^gpu_check: .*?\b(payload_bytes)=(\d+)", out, re.M)) | \
        dict(re.findall(r"\b([a-z_]+)=(\d+)\b", out.splitlines()[-1]))


def test_dry_run_prints_the_payload_and_the_estimated_time():
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    f = _figures(r.stdout)
    tree, wheels, total = int(f["tree_bytes"]), int(f["wheel_bytes"]), int(f["payload_bytes"])
    assert total == tree + wheels and 0 < tree < 64 * 2 ** 20
    assert 0 < int(f["estimated_s"]) <= int(f["budget_s"]) <= 540          # one command of <= 9 minutes
    assert "run(command='bash scripts/gpu_check.sh \"$OUT\"', carry=['.whl/check'], timeout_s=600)" in r.stdout
    assert "ESTIMATE" in r.stdout


def test_a_machine_without_cuda_still_gets_its_summary(tmp_path):
    """The environment phase fails (no CUDA visible: hidden on a GPU machine too): pip-list.txt and
    summary.json come back anyway."""
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DIR": str(tmp_path / "w"),
                                         "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode != 0 and "no CUDA device" in r.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["environment"] == "failed: no CUDA device"
    assert summary["phases"]["stage1"]["status"] == summary["phases"]["stage2"]["status"] == "not run"
    assert "torch" in (tmp_path / "out" / "pip-list.txt").read_text()


def test_an_unknown_argument_is_refused():
    r = subprocess.run(["bash", str(SCRIPT), "--gpu"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown argument --gpu" in r.stderr


def _check_outputs(out: Path, *, tiny: bool) -> dict:
    files = {p.name for p in out.iterdir()}
    assert RETURNS <= files and len(files) <= 8, files          # a device call returns at most 8 files
    assert "torch" in (out / "pip-list.txt").read_text()        # the image's packages, recorded by the check
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tiny"] is tiny and summary["wall_s"] <= summary["budget_s"] + 60
    assert summary["environment"] == "ready"
    assert {k: v["status"] for k, v in summary["phases"].items() if k != "learning"} == \
        {"stage1": "passed", "stage2": "passed"}
    assert summary["versions"]["torch"]
    s1 = json.loads((out / "gpu_check.json").read_text())
    assert s1["prod_steps"] == 69 and s1["micro_step_s"] > 0
    s2 = json.loads((out / "gpu_stage2.json").read_text())
    from training.stage2.gpu_check import MIN_CHANGED_FRACTION, production_learning_rate

    assert s2["learning_rate"] == production_learning_rate() == 1e-6        # the production rate
    assert s2["dtype"] == "float32" and s2["layer_elements_changed_fraction"] >= MIN_CHANGED_FRACTION
    assert s2["reward_std_max"] > 0 and s2["params_changed"] > 0
    return summary


@pytest.mark.slow
def test_the_check_runs_every_phase_on_cpu_with_tiny_shapes(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DIR": str(tmp_path / "work")}
    r = subprocess.run(["bash", str(SCRIPT), "--tiny", str(tmp_path / "out")], cwd=REPO, capture_output=True,
                       text=True, timeout=1500, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    _check_outputs(tmp_path / "out", tiny=True)
    assert "gpu_check: stage1: passed" in r.stdout and "gpu_check: stage2: passed" in r.stdout


@pytest.mark.gpu
def test_the_check_on_one_h200(tmp_path):
    """bash scripts/gpu_check.sh on one H200 within its 540-s budget (not run yet: no session so far
    had a GPU)."""
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                       timeout=700)
    sys.stdout.write(r.stdout[-6000:])
    assert r.returncode == 0, r.stderr[-4000:]
    summary = _check_outputs(tmp_path / "out", tiny=False)
    assert summary["device"].startswith("NVIDIA") and summary["wall_s"] <= 540
    s1 = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert 0 < s1["peak_alloc_gib"] <= s1["peak_reserved_gib"] < 141 and s1["prod_peak_gib"] < 141
