"""Every YAML under configs/, recursively, loads and validates with its family's loader.
A YAML in a folder with no known loader fails: a config nobody checks is a config that rots."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

# family (first folder under configs/) -> (module, function) that loads and validates one file
LOADERS = {
    "stage1": ("training.stage1.config", "load_stage1_config"),
    "stage2": ("training.stage2.config", "load_stage2_config"),
    "warmup": ("training.warmup.config", "load_warmup_config"),
    "prefixes": ("training.prefixes.config", "load_prefixes_config"),
    "steps": ("training.steps.config", "load_steps_config"),
    "ablation": ("aftraj.drivers.ablation", "load_config"),
    "accelerate": ("training.accelerate_config", "check_accelerate_config"),
    "policies": ("aftraj.detectors", "load_policy"),
    "corpus": ("aftraj.corpus.config", "load_corpus_config"),
    "structural": ("aftraj.structural.config", "load_structural_config"),
    "serve": ("serve.config", "load_serve_config"),
}

ALL_YAML = sorted(p for ext in ("*.yaml", "*.yml") for p in CONFIGS.rglob(ext))


def test_configs_exist_and_the_search_is_recursive():
    assert ALL_YAML, "configs/ holds no YAML"
    walked = {Path(d) / f for d, _, files in os.walk(CONFIGS) for f in files if f.endswith((".yaml", ".yml"))}
    assert set(ALL_YAML) == walked, sorted(map(str, walked ^ set(ALL_YAML)))   # an independent walk
    assert len(ALL_YAML) == len(set(ALL_YAML))
    assert {p.relative_to(CONFIGS).parts[0] for p in ALL_YAML} == set(LOADERS)    # one folder per loader
    for must in ("stage1/tiny-cpu.yaml", "stage1/smollm2-135m-cpu.yaml", "stage1/qwen2.5-7b-2xh200.yaml",
                 "accelerate/fsdp-2xh200.yaml"):
        assert (CONFIGS / must).is_file(), must


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_validates(path: Path):
    rel = path.relative_to(CONFIGS)
    family = rel.parts[0] if len(rel.parts) > 1 else "<top level>"
    assert family in LOADERS, (f"configs/{rel}: no loader is known for configs/{family}/; add one "
                               f"to LOADERS in tests/test_configs.py")
    module, func = LOADERS[family]
    loader = getattr(importlib.import_module(module), func)
    assert loader(path) is not None


def test_production_stage1_config_holds_the_issue_settings():
    from training.stage1.config import load_stage1_config

    cfg = load_stage1_config(CONFIGS / "stage1" / "qwen2.5-7b-2xh200.yaml")
    assert (cfg.finetune, cfg.max_prompt_tokens, cfg.mixed_precision) == ("full", 8192, "bf16")
    assert (cfg.gradient_checkpointing, cfg.optimizer, cfg.lr_scheduler, cfg.warmup_steps) == \
        (True, "adamw_bnb_8bit", "cosine", 50)                # the paper's 50 warm-up steps (issue 22)
    assert 2 <= cfg.num_epochs <= 3 and cfg.max_steps is None and not cfg.allow_many_epochs
    assert cfg.export_dtype == "bfloat16"
    sched = cfg.schedule(1100, world_size=2)           # ≈ the corpus's pairs, on 2×H200
    assert 2 <= sched.epochs <= 3 and sched.steps == 69 and sched.warmup_steps == 50
    assert not cfg.model.startswith("builtin:") and "/" in cfg.model      # a local folder, never a hub id
    smol1 = load_stage1_config(CONFIGS / "stage1" / "smollm2-135m-cpu.yaml")   # issue 21: top layers, full
    assert (smol1.finetune, smol1.trainable_layers, smol1.batching) == ("full", 8, "per_pair")


def test_loaders_reject_bad_files(tmp_path):
    from training.accelerate_config import check_accelerate_config
    from aftraj.config import ConfigError
    from training.stage1.config import load_stage1_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("max_step: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: max_step: unknown stage-1 key \(known: .*max_steps"):
        load_stage1_config(bad)
    bad.write_text("per_device_batch_size: 1\n")
    with pytest.raises(ConfigError, match="holds every subset"):
        load_stage1_config(bad)
    bad.write_text("learning_rate: fast\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: learning_rate: must be float, got str 'fast'"):
        load_stage1_config(bad)
    text = (CONFIGS / "accelerate" / "fsdp-2xh200.yaml").read_text()
    bad.write_text(text.replace("fsdp_use_orig_params", "fsdp_use_orig_param"))
    with pytest.raises(ConfigError, match=r"bad\.yaml: fsdp_config\.fsdp_use_orig_param: is not"):
        check_accelerate_config(bad)
    bad.write_text(text.replace("Qwen2DecoderLayer", "Qwen9DecoderLayer"))
    with pytest.raises(ConfigError, match="Qwen9DecoderLayer"):
        check_accelerate_config(bad)
    bad.write_text(text + "num_gpus: 2\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        check_accelerate_config(bad)


def test_stage1_schedule_is_sized_from_epochs_and_capped_at_five():
    from aftraj.config import ConfigError
    from training.stage1.config import load_stage1_config

    prod = CONFIGS / "stage1" / "qwen2.5-7b-2xh200.yaml"
    assert load_stage1_config(prod, {"num_epochs": 5}).num_epochs == 5
    with pytest.raises(ConfigError, match=r"num_epochs: 5\.5 epochs is above 5.*allow_many_epochs"):
        load_stage1_config(prod, {"num_epochs": 5.5})
    assert load_stage1_config(prod, {"num_epochs": 5.5, "allow_many_epochs": True}).num_epochs == 5.5
    with pytest.raises(ConfigError, match="exactly one of num_epochs and max_steps"):
        load_stage1_config(prod, {"max_steps": 100})
    with pytest.raises(ConfigError, match="exactly one of num_epochs and max_steps"):
        load_stage1_config(prod, {"num_epochs": None})
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="warmup_ratio"):
            load_stage1_config(prod, {"warmup_ratio": bad})
    # a fixed step count is held to the same cap once the data is known (the old 1,500 steps)
    fixed = load_stage1_config(prod, {"num_epochs": None, "max_steps": 1500, "gradient_accumulation_steps": 16})
    with pytest.raises(ConfigError, match=r"87\.3 epochs"):
        fixed.schedule(1100, world_size=2)
    assert load_stage1_config(prod, {"num_epochs": None, "max_steps": 1500, "allow_many_epochs": True}
                              ).schedule(1100, world_size=2).steps == 1500
    edge = load_stage1_config(prod, {"num_epochs": None, "max_steps": 10})    # 10 × 32 / 64 = 5.0: allowed
    assert edge.schedule(64, world_size=2).epochs == 5.0
    with pytest.raises(ConfigError):
        load_stage1_config(prod, {"num_epochs": None, "max_steps": 11}).schedule(64, world_size=2)
    one = load_stage1_config(prod, {"num_epochs": 1, "warmup_steps": None, "warmup_ratio": 0.1}
                             ).schedule(33, world_size=2)   # ceil(33 / 32)
    assert (one.steps, one.warmup_steps) == (2, 0)
def test_stage2_configs_hold_the_issue_settings_and_refuse_bad_values(tmp_path):
    from aftraj.config import ConfigError
    from training.stage2.config import load_stage2_config

    tiny = load_stage2_config(CONFIGS / "stage2" / "tiny-cpu.yaml")
    assert tiny.model == "builtin:tiny-qwen2" and not tiny.bf16 and tiny.finetune == "full"
    smol = load_stage2_config(CONFIGS / "stage2" / "smollm2-135m-cpu.yaml")
    assert smol.finetune == "lora" and smol.model == "builtin:smollm2-135m" and not smol.bf16
    prod = load_stage2_config(CONFIGS / "stage2" / "qwen2.5-7b-8xh200.yaml")
    assert (prod.max_completion_length, prod.overlong_buffer_len, prod.optimizer) == (4096, 1024, "adamw_bnb_8bit")
    assert not prod.model.startswith("builtin:") and prod.beta > 0 and prod.num_generations >= 2
    bad = tmp_path / "bad.yaml"
    for text, key in (("num_generations: 1\n", "num_generations"), ("sigma: 0\n", "sigma"),
                      ("unsafe_fraction: 1.0\n", "unsafe_fraction"), ("malformed_score: 0.5\n", "malformed_score"),
                      ("overlong_buffer_len: 256\n", "overlong_buffer_len"), ("beta: -0.1\n", "beta"),
                      ("num_generation: 4\n", "num_generation"), ("kl_loss_type: kl2\n", "kl_loss_type")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=rf"bad\.yaml: {key}: "):
            load_stage2_config(bad)
    bad.write_text("num_generations: 2\n")           # the lower bound itself is accepted
    assert load_stage2_config(bad).num_generations == 2
