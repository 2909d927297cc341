"""`aftraj train steps` under the production launch config's FSDP1 path on two CPU ranks (gloo,
`training.accelerate_config.cpu_variant`, the workarounds of tests/training/fsdp_cpu_launch.py):
every parameter trains under bf16 autocast, the optimizer is built over the prepared model, a
run interrupted after its first step (a checkpoint: the sharded model, each rank's optimizer)
and resumed ends with the weights of the uninterrupted run, and the main process alone scores
the val split from final/ and writes the calibration.

Marker `slow`: three launches of two CPU ranks, ~10-40 s each on a 2-core machine.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/training/test_steps_fsdp.py -m slow -q
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aftraj.schema import write_jsonl
from training.common import synthetic_trajectories

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "tests" / "training" / "steps_fsdp_launch.py"


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _launch(cpu_yaml: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cpu_yaml),
           "--main_process_port", _port(), str(LAUNCH), *args]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_two_fsdp_ranks_train_resume_and_calibrate(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from training.accelerate_config import cpu_variant

    cpu_yaml = cpu_variant(REPO / "configs" / "accelerate" / "fsdp-2xh200.yaml", tmp_path / "fsdp-cpu.yaml")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(synthetic_trajectories(8, seed=0), corpus / "train.jsonl")
    write_jsonl(synthetic_trajectories(4, seed=7), corpus / "val.jsonl")
    common = ["--config", "configs/steps/tiny-cpu.yaml", "--data", str(corpus), "--model", str(tiny_model_dir),
              "--set", "trainable_layers=null", "--set", "heldout_split=val", "--set", "save_steps=1",
              "--set", "num_epochs=1", "--set", "mixed_precision=bf16", "--no-progress"]
    whole = _launch(cpu_yaml, [*common, "--out", str(tmp_path / "whole")])
    lines = [json.loads(x) for x in whole.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1 and lines[0]["steps"] == 2          # the main process reports, once
    assert lines[0]["calibration"]["val"]["n_runs"] == 4
    assert (tmp_path / "whole" / "final" / "steps_calibration.json").is_file()
    _launch(cpu_yaml, [*common, "--out", str(tmp_path / "part"), "--set", "max_steps=1"])
    ck = tmp_path / "part" / "checkpoint"
    assert (ck / "rank0.pt").is_file() and (ck / "rank1.pt").is_file() and not (tmp_path / "part" / "final").exists()
    _launch(cpu_yaml, [*common, "--out", str(tmp_path / "part"), "--resume"])
    a = load_file(str(tmp_path / "whole" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "final" / "model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=0, rtol=0)
    moved = [k for k in a if k in base and not torch.equal(a[k].float(), base[k].float())]
    assert len(moved) == len([k for k in a if k in base])          # every parameter trained
    losses = lambda d: [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(tmp_path / "part") == losses(tmp_path / "whole")
