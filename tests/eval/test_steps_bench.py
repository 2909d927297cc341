"""benchmarks/steps_walk.py and benchmarks/steps_train.py run end to end on the tiny model and
print the figures benchmarks/README.md quotes (a smoke run: the figures themselves are measured
with SmolLM2 on a corpus)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aftraj.schema import write_jsonl
from training.common import synthetic_trajectories

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _run(args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_steps_benchmarks_print_their_figures(tiny_model_dir, tmp_path):
    write_jsonl(synthetic_trajectories(6, seed=0), tmp_path / "train.jsonl")     # 5 unsafe, 1 safe
    write_jsonl(synthetic_trajectories(4, seed=3), tmp_path / "test.jsonl")
    walk = _run(["benchmarks/steps_walk.py", "--data", str(tmp_path / "test.jsonl"), "--model", str(tiny_model_dir),
                 "--config", "configs/steps/tiny-cpu.yaml", "--runs", "2", "--min-steps", "3", "--max-steps", "9",
                 "--events", "30", "--repeats", "2"])
    w = walk["walk"]
    assert w["runs"] == 2 and w["reencode_runs_measured"] == 1
    assert w["ratio_tokens_computed_vs_reencode"] < w["ratio_vs_kv_reusing_generation_walk"]["tokens_computed"] < 1
    lat = walk["latency"]
    assert lat["around_step_10"]["n"] == 20 and lat["around_step_30"]["n"] == 20 and lat["p99_ratio"] > 0
    train = _run(["benchmarks/steps_train.py", "--data", str(tmp_path), "--model", str(tiny_model_dir),
                  "--config", "configs/steps/tiny-cpu.yaml", "--runs", "4"])
    assert train["runs_trained"] == 3 and train["tokens_per_s"] > 0 and train["split_runs"] == 6
