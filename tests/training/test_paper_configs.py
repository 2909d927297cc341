"""The production configs hold the paper's settings (DESIGN §5): stage 1 warms up 50 steps, and
stage 2 has a 2×H200 config (the paper's machine) beside the 8×H200 one, the same run otherwise.

    pytest tests/training/test_paper_configs.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
STAGE1 = REPO / "configs" / "stage1" / "qwen2.5-7b-2xh200.yaml"
STAGE2_2X = REPO / "configs" / "stage2" / "qwen2.5-7b-2xh200.yaml"
STAGE2_8X = REPO / "configs" / "stage2" / "qwen2.5-7b-8xh200.yaml"


def test_stage1_warms_up_the_papers_50_steps():
    from training.stage1.config import load_stage1_config

    cfg = load_stage1_config(STAGE1)
    sched = cfg.schedule(1100, world_size=2)
    assert sched.warmup_steps == 50 and sched.steps == 69


def test_warmup_steps_and_ratio_are_exclusive(tmp_path):
    from aftraj.config import ConfigError
    from training.stage1.config import load_stage1_config

    with pytest.raises(ConfigError, match="warmup_steps"):
        load_stage1_config(STAGE1, {"warmup_ratio": 0.1})
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_stage1_config(STAGE1, {"warmup_steps": -1})
    assert load_stage1_config(STAGE1, {"warmup_steps": None, "warmup_ratio": 0.1}).schedule(1100, 2).warmup_steps == 7


def test_stage2_on_2xh200_is_the_8xh200_run_on_two_gpus():
    from training.stage2.config import load_stage2_config

    two, eight = load_stage2_config(STAGE2_2X), load_stage2_config(STAGE2_8X)
    assert two.verl_nnodes == 1 and two.verl_gpus_per_node == 2
    assert eight.verl_nnodes == 1 and eight.verl_gpus_per_node == 8
    assert two.verl_gpus_per_node % two.verl_tensor_parallel == 0
    a, b = yaml.safe_load(STAGE2_2X.read_text()), yaml.safe_load(STAGE2_8X.read_text())
    engine = {"verl_gpus_per_node", "verl_tensor_parallel", "verl_gpu_memory_utilization"}
    assert {k: v for k, v in a.items() if k not in engine} == {k: v for k, v in b.items() if k not in engine}
    # verl's batch rules (validate_config): the prompt batch and the mini-batch split over the GPUs
    n_gpus = two.verl_gpus_per_node * two.verl_nnodes
    assert two.prompts_per_step * two.num_generations % n_gpus == 0
    assert two.prompts_per_step % two.verl_ppo_mini_batch_size == 0
    assert two.verl_ppo_mini_batch_size * two.num_generations // n_gpus % two.verl_micro_batch_size_per_gpu == 0


def test_five_epochs_whose_last_step_runs_over_are_allowed_and_six_are_not():
    # 617 pairs in batches of 3: 5 epochs is 1,029 steps (5.003 epochs); the 2k CPU ablation hit it
    from aftraj.config import ConfigError
    from training.stage1.config import load_stage1_config

    cpu = REPO / "configs" / "stage1" / "smollm2-135m-cpu.yaml"
    cfg = load_stage1_config(cpu, {"max_steps": None, "num_epochs": 5})
    assert cfg.schedule(617, world_size=1).steps == 1029
    with pytest.raises(ConfigError, match="num_epochs"):
        load_stage1_config(cpu, {"max_steps": None, "num_epochs": 6})
    with pytest.raises(ConfigError, match="max_steps"):
        load_stage1_config(cpu, {"max_steps": 1029}).schedule(617, world_size=1)
