"""Stage 2 on GPU nodes: the verl command line built from a stage-2 config.

`verl_command(cfg, data_dir, out)` turns `configs/stage2/*.yaml` into overrides of the recipe
`training/verl/stage2_grpo.yaml` (which composes verl's own `ppo_trainer` config), so one config
drives both engines. `run_verl` builds the parquet data with the shared prompt builder, prints
the command, and (without --dry-run) runs it with verl's environment (`.venv-verl`, made by
`scripts/setup_verl.sh`; verl pinned in `training/verl/requirements.txt`). The repository goes
on PYTHONPATH so verl's reward workers import `training/reward.py` and `aftraj.verdict`.

    aftraj train stage2 --engine verl --config configs/stage2/qwen2.5-7b-8xh200.yaml \
        --init runs/stage1/final --out runs/stage2 --dry-run
    bash scripts/train_stage2_verl.sh --config configs/stage2/qwen2.5-7b-8xh200.yaml --init runs/stage1/final
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from training.stage2.config import Stage2Config

REPO = Path(__file__).resolve().parents[2]
RECIPE_DIR = REPO / "training" / "verl"
RECIPE_NAME = "stage2_grpo"
# verl imports the reward as a package module (pkg://), so it is `training.reward` itself, with
# its imports (aftraj.verdict) resolved from the repository on PYTHONPATH.
REWARD_MODULE = "pkg://training.reward"
DEFAULT_VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"
_OPTIMIZERS = {"adamw_bnb_8bit": ("AdamW8bit", "bitsandbytes.optim"), "adamw_torch": ("AdamW", "torch.optim")}
# stage-2 dtype -> verl's precision names (verl.utils.torch_dtypes.PrecisionType)
VERL_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _v(x) -> str:
    """A Hydra override value."""
    if isinstance(x, bool):
        return "true" if x else "false"
    if x is None:
        return "null"
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(_v(i) for i in x) + "]"
    return str(x)


def verl_overrides(cfg: Stage2Config, model_path: str | Path, data_dir: str | Path, out: str | Path,
                   *, resume: bool = False) -> list[str]:
    """The recipe's `???` fields and every value our config owns, as Hydra overrides."""
    data_dir, out = Path(data_dir).resolve(), Path(out).resolve()
    opt, impl = _OPTIMIZERS[cfg.optimizer]
    rk = cfg.reward.score_kwargs()
    o = {
        "data.train_files": data_dir / "train.parquet",
        "data.val_files": data_dir / "val.parquet",
        "data.max_prompt_length": cfg.max_prompt_tokens,
        "data.max_response_length": cfg.max_completion_length,
        "data.train_batch_size": cfg.prompts_per_step,
        "data.seed": cfg.seed,
        "actor_rollout_ref.model.path": Path(model_path).resolve(),
        "actor_rollout_ref.model.enable_gradient_checkpointing": cfg.gradient_checkpointing,
        "actor_rollout_ref.actor.kl_loss_coef": cfg.beta,
        "actor_rollout_ref.actor.use_kl_loss": cfg.beta > 0,
        "actor_rollout_ref.actor.kl_loss_type": cfg.kl_loss_type,
        "actor_rollout_ref.actor.clip_ratio": cfg.epsilon,
        "actor_rollout_ref.actor.ppo_mini_batch_size": cfg.verl_ppo_mini_batch_size,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": cfg.verl_micro_batch_size_per_gpu,
        # the actor's master weights (verl's FSDP engine: model_dtype; compute is bf16 either way)
        "actor_rollout_ref.actor.fsdp_config.model_dtype": VERL_DTYPES[cfg.dtype],
        "actor_rollout_ref.actor.optim.optimizer": opt,
        "actor_rollout_ref.actor.optim.optimizer_impl": impl,
        "actor_rollout_ref.actor.optim.lr": cfg.learning_rate,
        "actor_rollout_ref.actor.optim.weight_decay": cfg.weight_decay,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": cfg.warmup_steps,
        "actor_rollout_ref.actor.optim.lr_scheduler_type": cfg.lr_scheduler,
        "actor_rollout_ref.actor.optim.clip_grad": cfg.max_grad_norm if cfg.max_grad_norm is not None else 0.0,
        "actor_rollout_ref.rollout.n": cfg.num_generations,
        "actor_rollout_ref.rollout.temperature": cfg.temperature,
        "actor_rollout_ref.rollout.top_p": cfg.top_p,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": cfg.verl_tensor_parallel,
        "actor_rollout_ref.rollout.gpu_memory_utilization": cfg.verl_gpu_memory_utilization,
        "reward.reward_kwargs.overlong_buffer_cfg.enable": cfg.overlong_buffer_len > 0,
        "reward.reward_kwargs.overlong_buffer_cfg.len": cfg.overlong_buffer_len,
        "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": cfg.overlong_penalty_factor,
        "reward.custom_reward_function.path": REWARD_MODULE,
        "reward.custom_reward_function.name": "compute_score",
        **{f"reward.custom_reward_function.reward_kwargs.{k}": v for k, v in rk.items()},
        "trainer.nnodes": cfg.verl_nnodes,
        "trainer.n_gpus_per_node": cfg.verl_gpus_per_node,
        "trainer.total_training_steps": cfg.max_steps,
        "trainer.save_freq": cfg.save_steps,
        "trainer.max_actor_ckpt_to_keep": cfg.save_total_limit,
        "trainer.default_local_dir": out / "verl",
        "trainer.experiment_name": out.name,
        "trainer.logger": ["console", *cfg.report_to],
        "trainer.resume_mode": "auto" if resume else "disable",
    }
    if cfg.finetune == "lora":
        o.update({"actor_rollout_ref.model.lora_rank": cfg.lora_r,
                  "actor_rollout_ref.model.lora_alpha": cfg.lora_alpha,
                  "actor_rollout_ref.model.target_modules": cfg.lora_target_modules})
    return [f"{k}={_v(v)}" for k, v in o.items()]


def verl_command(cfg: Stage2Config, model_path, data_dir, out, *, python: str | Path | None = None,
                 resume: bool = False) -> list[str]:
    return [str(python or DEFAULT_VERL_PYTHON), "-m", "verl.trainer.main_ppo",
            f"--config-path={RECIPE_DIR}", f"--config-name={RECIPE_NAME}",
            *verl_overrides(cfg, model_path, data_dir, out, resume=resume)]


def run_verl(cfg: Stage2Config, *, dry_run: bool = False, resume: bool = False, python: str | None = None) -> int:
    """Build the data, print the verl command line, run it unless `dry_run`. Returns its exit code."""
    from training.common import load_tokenizer
    from aftraj.models import resolve_model_spec
    from training.stage2.data import build_stage2_data

    out = Path(cfg.output_dir)
    model_path = resolve_model_spec(cfg.model)
    tok = load_tokenizer(model_path)
    stats = build_stage2_data(cfg, tok, out / "data")
    print(f"[stage2/verl] data: {stats['n_prompts']} prompts ({stats['n_unsafe_gold']} UNSAFE gold) in "
          f"{out / 'data'}", file=sys.stderr)
    cmd = verl_command(cfg, model_path, out / "data", out, python=python, resume=resume)
    env_line = f"PYTHONPATH={shlex.quote(str(REPO))}"
    print(env_line + " " + shlex.join(cmd))
    if dry_run:
        return 0
    if not Path(cmd[0]).exists():
        print(f"stage2: verl's Python {cmd[0]} does not exist; run `bash scripts/setup_verl.sh --gpu` "
              f"(or pass --verl-python)", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.call(cmd, env=env)
