"""verl's actor and reference must load with an attention implementation that verl's GPU
environment can import (default suite; no verl needed).

verl 0.9.1 (`verl/workers/config/model.py`, HFModelConfig.__post_init__) loads the model with
`override_config.get("attn_implementation", "flash_attention_2")`, and its `use_remove_padding`
path (default true in `trainer/config/model/hf_model.yaml`) packs sequences for flash-attn's varlen
kernel (`verl/utils/attention_utils.py`, `models/transformers/monkey_patch.py`). `.venv-verl` on a
GPU node holds `verl[vllm]` (no flash-attn) plus training/verl/requirements-gpu.txt. The recipe as
composed with the overrides `aftraj train stage2 --engine verl` passes is read here; the verl
marked test in test_verl_recipe.py checks the same against the installed verl.

    pytest tests/training/test_verl_attention.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "training" / "verl" / "stage2_grpo.yaml"
GPU_REQ = REPO / "training" / "verl" / "requirements-gpu.txt"
PROD = REPO / "configs" / "stage2" / "qwen2.5-7b-8xh200.yaml"
VERL_DEFAULT_ATTN, VERL_DEFAULT_REMOVE_PADDING = "flash_attention_2", True     # verl 0.9.1
# the package an implementation needs beyond torch/transformers (None: torch's own kernels)
NEEDS = {"flash_attention_2": "flash-attn", "flash_attention_3": "flash-attn-3", "sdpa": None, "eager": None}
# verl 0.9.1's `vllm` extra (its METADATA): none of these is flash-attn
VERL_VLLM_EXTRA = {"vllm", "torch", "torchvision", "torchaudio", "mbridge", "transformers"}


def _gpu_packages() -> set[str]:
    names = set(VERL_VLLM_EXTRA)
    for line in GPU_REQ.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[=<>!~\[ ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def _model_setting(overrides: list[str], key: str, default):
    """actor_rollout_ref.model.<key> after the recipe and the command line's overrides."""
    node = yaml.safe_load(RECIPE.read_text())["actor_rollout_ref"]["model"]
    val = node
    for part in key.split("."):
        val = val.get(part) if isinstance(val, dict) else None
    val = default if val is None else val
    for o in overrides:
        name, _, v = o.lstrip("+").partition("=")
        if name == f"actor_rollout_ref.model.{key}":
            val = yaml.safe_load(v)
    return val


def _overrides(tmp_path) -> list[str]:
    from training.stage2.config import load_stage2_config
    from training.stage2.verl_engine import verl_overrides

    cfg = load_stage2_config(PROD, {"output_dir": str(tmp_path)})
    return verl_overrides(cfg, tmp_path / "model", tmp_path / "data", tmp_path)


def test_actor_and_reference_attention_is_importable_in_the_verl_environment(tmp_path):
    over = _overrides(tmp_path)
    impl = _model_setting(over, "override_config.attn_implementation", VERL_DEFAULT_ATTN)
    assert impl in NEEDS, f"unknown attention implementation {impl!r}"
    pkgs = _gpu_packages()
    assert NEEDS[impl] is None or NEEDS[impl] in pkgs, \
        f"the recipe loads actor and reference with {impl}, which needs {NEEDS[impl]}; .venv-verl has {sorted(pkgs)}"


def test_remove_padding_only_with_flash_attn(tmp_path):
    over = _overrides(tmp_path)
    if _model_setting(over, "use_remove_padding", VERL_DEFAULT_REMOVE_PADDING):
        assert "flash-attn" in _gpu_packages(), "use_remove_padding packs sequences for flash-attn's varlen kernel"
