"""Master weights at small learning rates (issue 46 item 2): bf16 masters lose an Adam update of
1e-6, fp32 masters with bf16 autocast keep it (a tiny Qwen2 on CPU); the config loader refuses a
half-precision master below `aftraj.config.HALF_MASTER_MIN_LR`, naming the file and key; the
production stage-2 configs load float32 masters with bf16 compute on both engines.

    pytest tests/training/test_master_precision.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aftraj.config import HALF_MASTER_MIN_LR, ConfigError

REPO = Path(__file__).resolve().parents[2]
PRODUCTION_STAGE2 = ["configs/stage2/qwen2.5-7b-8xh200.yaml", "configs/stage2/qwen2.5-7b-2xh200.yaml"]


def _one_adam_step(model_dir: Path, dtype, lr: float) -> dict:
    """Load the tiny model with `dtype` master weights, take one AdamW step on a causal-LM loss
    computed under bf16 autocast, and return the update measure of training.stage2.gpu_check."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.stage2.gpu_check import kept_update

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    after = {k: v.detach() for k, v in model.named_parameters()}
    return kept_update(before, after)


def test_bf16_masters_lose_a_1e6_update_and_fp32_masters_keep_it(tiny_model_dir):
    import torch

    bf16 = _one_adam_step(tiny_model_dir, torch.bfloat16, 1e-6)
    fp32 = _one_adam_step(tiny_model_dir, torch.float32, 1e-6)
    assert bf16["changed_fraction"] < 0.05, bf16          # measured 2.0 %: weights within 2^9 × lr of 0
    assert fp32["changed_fraction"] > 0.95, fp32
    # the same update rounded to bf16 afterwards is lost as well: the export is not the problem,
    # the master is (fp32 keeps it while training; the measure of the GPU check says as much)
    assert fp32["bf16_kept_fraction"] < 0.1, fp32         # measured 4.2 %
    # and at a learning rate bf16 can hold, bf16 masters move (the measure is not vacuous)
    assert _one_adam_step(tiny_model_dir, torch.bfloat16, 1e-3)["changed_fraction"] > 0.9


@pytest.mark.parametrize("loader, path", [
    ("training.stage2.config:load_stage2_config", "configs/stage2/qwen2.5-7b-8xh200.yaml"),
    ("training.stage2.config:load_stage2_config", "configs/stage2/qwen2.5-7b-2xh200.yaml"),
    ("training.stage1.config:load_stage1_config", "configs/stage1/qwen2.5-7b-2xh200.yaml"),
])
def test_the_loader_refuses_bf16_masters_with_a_small_learning_rate(loader, path):
    import importlib

    mod, fn = loader.split(":")
    load = getattr(importlib.import_module(mod), fn)
    cfg = load(REPO / path)
    assert cfg.dtype == "float32" and cfg.learning_rate < HALF_MASTER_MIN_LR   # the shipped config loads
    with pytest.raises(ConfigError) as e:
        load(REPO / path, {"dtype": "bfloat16"})
    assert e.value.key == "dtype" and e.value.source == str(REPO / path)
    assert str(e.value).startswith(f"{REPO / path}: dtype: bfloat16 master weights with learning_rate")
    # LoRA keeps float32 adapters, and a learning rate bf16 can hold is accepted
    load(REPO / path, {"dtype": "bfloat16", "finetune": "lora"})
    load(REPO / path, {"dtype": "bfloat16", "learning_rate": HALF_MASTER_MIN_LR})


def test_production_stage2_trains_fp32_masters_with_bf16_compute_on_both_engines(tmp_path):
    from training.stage2.config import load_stage2_config
    from training.stage2.trl_engine import grpo_args
    from training.stage2.verl_engine import verl_overrides

    for path in PRODUCTION_STAGE2:
        cfg = load_stage2_config(REPO / path, {"bf16": False, "optimizer": "adamw_torch"})  # CPU-safe args
        args = grpo_args(cfg, tmp_path / "out", progress=False)
        assert args.model_init_kwargs["dtype"] == "float32", path       # what TRL loads the policy in
        cfg = load_stage2_config(REPO / path)
        assert cfg.bf16 is True, path                                    # compute: bf16 autocast
        o = dict(x.split("=", 1) for x in verl_overrides(cfg, "m", tmp_path / "d", tmp_path / "o"))
        assert o["actor_rollout_ref.actor.fsdp_config.model_dtype"] == "fp32", path
