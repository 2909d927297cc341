"""Stage 1 under the production launch config's FSDP1 path on two CPU ranks (gloo), through the
real entry point: `configs/accelerate/fsdp-2xh200.yaml` adapted to CPU
(`training.accelerate_config.cpu_variant`), bf16 mixed precision, bitsandbytes 8-bit AdamW,
SHARDED_STATE_DICT checkpoints, 2 accumulation micro-steps.

Run A trains 4 steps and saves at 2 and 4; run B resumes from a copy of A's step-2 checkpoint.
The restored optimizer checksums and steps 3-4 (step 4's loss is the first that the restored
optimizer state shapes) must equal A's; rotary buffers stay float32; the
gradient between micro-steps is the rank's shard; the bf16 export loads. A second launch shows
that accelerate's own bf16 policy puts `inv_freq` in bf16 (the check above is not vacuous).

Marker `slow`: each `accelerate launch` of two CPU ranks costs ~35-45 s on a 2-core machine, most
of it importing torch/transformers twice; the module runs three (~2 min).

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/training/test_stage1_fsdp.py -m slow -q
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "stage1" / "tiny-cpu.yaml"
LAUNCH = REPO / "tests" / "training" / "fsdp_cpu_launch.py"
pytestmark = pytest.mark.slow


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _launch(cpu_yaml: Path, script: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cpu_yaml),
           "--main_process_port", _port(), str(script), *args]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def _metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _last_invocation(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())["invocations"][-1]


def _checksums(out: Path, step: int) -> list:
    return json.loads((out / f"checkpoint-{step:06d}" / "trainer_state.json").read_text())["optimizer_checksum"]


@pytest.fixture(scope="module")
def cpu_yaml(tmp_path_factory) -> Path:
    from training.accelerate_config import cpu_variant

    return cpu_variant(REPO / "configs" / "accelerate" / "fsdp-2xh200.yaml",
                       tmp_path_factory.mktemp("acc") / "fsdp-cpu.yaml")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, handmade_corpus, cpu_yaml, tmp_path_factory):
    from aftraj.cli import main

    root = tmp_path_factory.mktemp("fsdp")
    a, b = root / "a", root / "b"
    common = ["--config", str(TINY), "--data", str(handmade_corpus), "--model", str(tiny_model_dir),
              "--no-progress", "--max-steps", "4", "--set", "report_to=[]", "--set", "per_device_batch_size=2",
              "--set", "gradient_accumulation_steps=2", "--set", "mixed_precision=bf16",
              "--set", "optimizer=adamw_bnb_8bit", "--set", "save_steps=2", "--set", "export_dtype=bfloat16",
              "--set", "process_group_timeout_minutes=7", "--set", "samples_per_prompt=2",
              "--set", "sample_max_new_tokens=4"]
    # phase 1 in this (single) process; phase 2 on two ranks reads the cache
    assert main(["train", "stage1", "--phase", "preferences", "--out", str(a), *common]) == 0
    _launch(cpu_yaml, LAUNCH, ["--phase", "train", "--out", str(a), *common])
    # B: the run as it stood after step 2's checkpoint, then resumed
    shutil.copytree(a, b, ignore=shutil.ignore_patterns("checkpoint-000004", "final"))
    _launch(cpu_yaml, LAUNCH, ["--phase", "train", "--resume", "--out", str(b), *common])
    return a, b


def test_resume_restores_the_8bit_optimizer_and_continues_the_run(runs):
    a, b = runs
    ma, mb = _metrics(a), _metrics(b)
    assert sorted(ma) == sorted(mb) == [1, 2, 3, 4]
    assert ma[1]["loss"] == pytest.approx(math.log(2), abs=1e-3)
    restored = _last_invocation(b)["optimizer_checksum_restored"]
    assert len(restored) == 2 and all(c[0] > 0 for c in restored)    # two ranks, non-empty states
    assert restored == _checksums(a, 2)                                  # saved == loaded, per rank
    assert restored[0] != restored[1]                                    # each rank kept its own shard
    for step in (3, 4):                                                  # the same steps as uninterrupted
        assert mb[step]["loss"] == pytest.approx(ma[step]["loss"], abs=1e-6), step
        assert mb[step]["grad_norm"] == pytest.approx(ma[step]["grad_norm"], rel=1e-5), step
    assert _checksums(b, 4) == _checksums(a, 4)
    state = a / "checkpoint-000002" / "state"
    assert sorted(p.name for p in state.glob("optimizer_rank*.pt")) == ["optimizer_rank0.pt", "optimizer_rank1.pt"]
    assert (state / "pytorch_model_fsdp_0").is_dir()                    # the model: FSDP sharded state dict


def test_rotary_fp32_timeout_schedule_and_sharded_accumulation(runs, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    a, _ = runs
    inv = _last_invocation(a)
    assert inv["process_group_timeout_s"] == 7 * 60
    for when in ("after_prepare", "after_forward"):
        found = inv["rotary_buffer_dtypes"][when]
        assert found and set(found.values()) == {"float32"}, when
    sched = inv["schedule"]
    assert (sched["n_pairs"], sched["global_batch"], sched["steps"]) == (9, 8, 4)
    assert sched["epochs"] == pytest.approx(8 * 4 / 9)
    assert _metrics(a)[3]["epoch"] == pytest.approx(8 * 3 / 9, abs=1e-4)
    acc = inv["accumulation"]
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert acc["no_sync"] is False
    assert acc["grad_numel_after_first_micro"] == acc["local_param_numel"] < 0.6 * n_params   # a shard


def test_bf16_export_of_the_fsdp_run_loads(runs):
    from transformers import AutoModelForCausalLM

    a, b = runs
    for run in (a, b):
        model = AutoModelForCausalLM.from_pretrained(run / "final", dtype="auto")
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


_PROBE = '''
import runpy, sys, json, torch
sys.argv = ["probe"]
runpy.run_path({launch!r}, run_name="probe")   # the CPU FSDP patches, not its main()
from accelerate import Accelerator
from transformers import AutoModelForCausalLM
from training.stage1.trainer import rotary_buffer_dtypes
acc = Accelerator(mixed_precision="bf16")      # accelerate's own FSDP bf16 policy
m = acc.prepare(AutoModelForCausalLM.from_pretrained({model!r}))
m(input_ids=torch.tensor([[1, 2, 3]]))
if acc.is_main_process:
    open({out!r}, "w").write(json.dumps(rotary_buffer_dtypes(m)))
acc.wait_for_everyone()
acc.end_training()   # tear the gloo group down before exit, as the trainer does: without it, rank 0
                     # once aborted at exit ("terminate called without an active exception", CI 2026-12-02)
'''


def test_accelerates_default_bf16_policy_casts_rotary_buffers(cpu_yaml, tiny_model_dir, tmp_path):
    """What the explicit policy fixes: without it, inv_freq is bf16 after the first forward."""
    probe, out = tmp_path / "probe.py", tmp_path / "dtypes.json"
    probe.write_text(_PROBE.format(launch=str(LAUNCH), model=str(tiny_model_dir), out=str(out)))
    _launch(cpu_yaml, probe, [])
    found = json.loads(out.read_text())
    assert found and set(found.values()) == {"bfloat16"}
