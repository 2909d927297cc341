"""The verl recipe against the installed verl (marker `verl`: runs in verl's own environment,
`bash scripts/test_verl.sh`, not in the default suite). On a CPU machine it checks what needs no
GPU: Hydra composes training/verl/stage2_grpo.yaml with the overrides `aftraj train stage2
--engine verl` prints, and verl's own validate_config and config dataclasses accept it; verl's
dataset class loads our parquet; verl's DAPO reward manager, loaded from the composed config
(custom_reward_function path/name/reward_kwargs), scores a batch through our compute_score with
the soft overlong penalty included. Rollouts and FSDP training need GPUs and are not run here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.verl


@pytest.fixture(autouse=True, scope="module")
def _verl_env():
    """In the verl environment verl imports; elsewhere the `verl` marker deselects these tests
    before this runs (a module-level import guard counted as a skip in the default suite)."""
    assert importlib.util.find_spec("verl") is not None, "the verl tests run in .venv-verl (bash scripts/test_verl.sh)"

REPO = Path(__file__).resolve().parents[2]
PROD = REPO / "configs" / "stage2" / "qwen2.5-7b-8xh200.yaml"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def stage2(tmp_path_factory, tiny_model_dir, tok):
    """The production stage-2 config on the tiny model, its data built, and the composed recipe."""
    from hydra import compose, initialize_config_dir

    from training.stage2.config import load_stage2_config
    from training.stage2.data import build_stage2_data
    from training.stage2.verl_engine import RECIPE_DIR, RECIPE_NAME, verl_overrides

    out = tmp_path_factory.mktemp("stage2-verl")
    cfg = load_stage2_config(PROD, {"model": str(tiny_model_dir), "data": "builtin:synthetic",
                                    "synthetic_trajectories": 16, "max_prompts": 16,
                                    "output_dir": str(out)})
    stats = build_stage2_data(cfg, tok, out / "data")
    overrides = verl_overrides(cfg, tiny_model_dir, out / "data", out)
    with initialize_config_dir(config_dir=str(RECIPE_DIR), version_base=None):
        composed = compose(config_name=RECIPE_NAME, overrides=overrides)
    return {"cfg": cfg, "out": out, "stats": stats, "overrides": overrides, "composed": composed}


def test_recipe_composes_against_verls_config_and_validates(stage2, tiny_model_dir):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    c, cfg = stage2["composed"], stage2["cfg"]
    assert c.algorithm.adv_estimator == "grpo" and not c.algorithm.use_kl_in_reward
    a = c.actor_rollout_ref
    assert a.rollout.n == cfg.num_generations == 8
    assert a.actor.use_kl_loss and a.actor.kl_loss_coef == cfg.beta and a.actor.kl_loss_type == "low_var_kl"
    assert (a.actor.optim.optimizer, a.actor.optim.optimizer_impl) == ("AdamW8bit", "bitsandbytes.optim")
    assert a.actor.strategy == "fsdp" and a.rollout.name == "vllm"
    assert c.reward.reward_manager.name == "dapo"
    assert c.reward.reward_kwargs.max_resp_len == c.data.max_response_length == cfg.max_completion_length
    assert c.reward.reward_kwargs.overlong_buffer_cfg.len == cfg.overlong_buffer_len > 0
    assert c.reward.custom_reward_function.path == "pkg://training.reward"
    assert c.reward.custom_reward_function.reward_kwargs.sigma == cfg.sigma
    assert Path(a.model.path) == Path(tiny_model_dir).resolve()     # actor, ref and rollout: the init model
    # verl's own checks: batch sizes against GPUs, the actor and critic config dataclasses
    validate_config(c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
    assert need_reference_policy(c) and not need_critic(c)
    # (verl 0.9.1's RewardManagerConfig cannot be instantiated on its own: its __post_init__ calls a
    # super().__post_init__ that does not exist; verl itself reads that node as a DictConfig)
    for node in (c.algorithm, c.actor_rollout_ref.rollout, c.actor_rollout_ref.actor):
        omega_conf_to_dataclass(node)


def test_actor_and_reference_attention_loads_in_this_verl_environment(stage2, tiny_model_dir):
    """verl 0.9.1 loads with `override_config.attn_implementation` (default flash_attention_2): the
    composed recipe must name one that this environment's transformers can build a model with."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    m = stage2["composed"].actor_rollout_ref.model
    impl = m.override_config.get("attn_implementation", "flash_attention_2")
    if impl.startswith("flash_attention"):
        assert importlib.util.find_spec("flash_attn") is not None, f"{impl} needs flash-attn in this environment"
    assert not m.use_remove_padding or importlib.util.find_spec("flash_attn") is not None
    hf = AutoConfig.from_pretrained(tiny_model_dir, attn_implementation=impl)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation=impl)
    assert model.config._attn_implementation == impl


def test_a_misspelt_key_is_refused_by_verls_schema(stage2):
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from training.stage2.verl_engine import RECIPE_DIR, RECIPE_NAME

    with initialize_config_dir(config_dir=str(RECIPE_DIR), version_base=None):
        with pytest.raises(ConfigCompositionException):
            compose(config_name=RECIPE_NAME,
                    overrides=[*stage2["overrides"], "actor_rollout_ref.actor.kl_los_coef=0.1"])


def test_verls_dataset_class_loads_our_parquet(stage2, tok):
    from verl.trainer.ppo.utils import create_rl_dataset

    c = stage2["composed"]
    ds = create_rl_dataset(c.data.train_files, c.data, tok, None, is_train=True)
    assert len(ds) == stage2["stats"]["n_prompts"] == 16
    row = ds[0]
    assert [m["role"] for m in row["raw_prompt"]] == ["system", "user"]
    assert row["data_source"] == "aftraj"
    gt = json.loads(row["reward_model"]["ground_truth"])
    assert set(gt) == {"answer", "agent"}
    assert {"t", "agents", "traj_id"} <= set(row["extra_info"])


def _batch(tok, prompt: str, responses: list[str], response_len: int, extra_info: dict, gt: str):
    """A DataProto like verl's rollout hands the reward manager (left-padded prompt, right-padded response)."""
    import numpy as np
    import torch
    from verl import DataProto

    p = tok(prompt, add_special_tokens=False)["input_ids"]
    rows, masks, resp = [], [], []
    for r in responses:
        ids = tok(r, add_special_tokens=False)["input_ids"][:response_len]
        pad = response_len - len(ids)
        resp.append(ids + [tok.pad_token_id] * pad)
        masks.append([1] * len(p) + [1] * len(ids) + [0] * pad)
        rows.append(p + resp[-1])
    n = len(responses)
    return DataProto.from_dict(
        tensors={"prompts": torch.tensor([p] * n), "responses": torch.tensor(resp),
                 "input_ids": torch.tensor(rows), "attention_mask": torch.tensor(masks)},
        non_tensors={"data_source": np.array(["aftraj"] * n, dtype=object),
                     "reward_model": np.array([{"ground_truth": gt}] * n, dtype=object),
                     "extra_info": np.array([dict(extra_info) for _ in range(n)], dtype=object)})


def test_verls_dapo_reward_manager_scores_through_our_function(stage2, tok):
    from verl.trainer.ppo.reward import load_reward_manager

    from aftraj.verdict import Verdict, format_completion
    from training.reward import compute_score, ground_truth_of, overlong_penalty

    c, cfg = stage2["composed"], stage2["cfg"]
    mgr = load_reward_manager(c, tok)
    assert type(mgr).__name__ == "DAPORewardManager"
    info = {"t": 3, "agents": ["user", "Planner", "Coder", "Tester"]}
    gt = ground_truth_of(Verdict("UNSAFE", step=2, agent="Coder"))
    exact = format_completion(Verdict("UNSAFE", step=2, agent="Coder", reason="bug", think="x"))
    off = format_completion(Verdict("UNSAFE", step=3, agent="Tester", reason="bug", think="x"))
    long_ok = format_completion(Verdict("UNSAFE", step=2, agent="Coder", reason="bug", think="y " * 3600))
    R, B = cfg.max_completion_length, cfg.overlong_buffer_len
    cases = [exact, off, "no verdict here", long_ok]
    batch = _batch(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", cases, R, info, gt)

    async def score_all():
        return [await mgr.run_single(batch[i: i + 1]) for i in range(len(cases))]

    results = mgr.loop.run_until_complete(score_all())   # the manager runs on its own event loop
    for text, res in zip(cases, results, strict=True):
        n = len(tok(text, add_special_tokens=False)["input_ids"][:R])
        decoded = tok.decode(tok(text, add_special_tokens=False)["input_ids"][:R], skip_special_tokens=True)
        ours = compute_score("aftraj", decoded, gt, info, **cfg.reward.score_kwargs())
        pen = overlong_penalty(n, R, B, cfg.overlong_penalty_factor)
        assert res["reward_score"] == pytest.approx(ours["score"] + pen), text[:40]
        for k in ("format", "what", "where", "who"):
            assert res["reward_extra_info"][k] == ours[k]
        assert res["reward_extra_info"]["overlong_reward"] == pytest.approx(pen)
    assert results[0]["reward_extra_info"]["format"] == 1.0 and results[0]["reward_extra_info"]["who"] == 1.0
    assert results[2]["reward_score"] == pytest.approx(-1.0)            # malformed: the minimum
    assert results[3]["reward_extra_info"]["overlong_reward"] < 0        # well-formed but inside the buffer
    assert results[3]["reward_extra_info"]["format"] == 1.0


def test_the_2xh200_config_composes_and_validates(tmp_path, tiny_model_dir, tok):
    """configs/stage2/qwen2.5-7b-2xh200.yaml (the paper's 2×H200): verl's batch checks for 2 GPUs."""
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from training.stage2.config import load_stage2_config
    from training.stage2.verl_engine import RECIPE_DIR, RECIPE_NAME, verl_overrides

    cfg = load_stage2_config(REPO / "configs" / "stage2" / "qwen2.5-7b-2xh200.yaml",
                             {"model": str(tiny_model_dir), "output_dir": str(tmp_path)})
    with initialize_config_dir(config_dir=str(RECIPE_DIR), version_base=None):
        c = compose(config_name=RECIPE_NAME, overrides=verl_overrides(cfg, tiny_model_dir, tmp_path / "d", tmp_path))
    assert c.trainer.n_gpus_per_node == 2 and c.actor_rollout_ref.rollout.tensor_model_parallel_size == 1
    validate_config(c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
