"""Stage-2 (GRPO) run configuration: one typed, validated dataclass read by both engines (TRL
and verl); the values live in YAML under `configs/stage2/` (one file per scale).

    from training.stage2.config import load_stage2_config
    cfg = load_stage2_config("configs/stage2/tiny-cpu.yaml", overrides={"max_steps": 3})

Read by the one config layer (`aftraj.config.load`); the model fields are `aftraj.config.ModelConfig`'s.
Unknown keys, wrong types and out-of-range values raise `ConfigError` naming the file and key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from aftraj.config import ConfigError, ModelConfig, check_types, load
from training.reward import RewardConfig
from training.stage1.config import SCHEDULERS, TRACKERS

OPTIMIZERS = ("adamw_torch", "adamw_bnb_8bit")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
KL_LOSS_TYPES = ("low_var_kl", "kl", "abs", "mse")   # verl's actor.kl_loss_type values used here


@dataclass
class Stage2Config(ModelConfig):
    # --- run
    seed: int = 0
    output_dir: str = "runs/stage2"
    max_steps: int = 10
    logging_steps: int = 1
    save_steps: int = 5
    save_total_limit: int | None = 2
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])

    # --- model: ModelConfig's fields; `model` is the stage-1 checkpoint (policy and KL reference),
    # --init overrides it

    # --- data: prefixes of TRAIN trajectories (val/test never enter)
    data: str = "builtin:synthetic"
    max_trajectories: int | None = None
    synthetic_trajectories: int = 24
    max_prompts: int = 256               # prompts drawn from all prefixes, seeded
    unsafe_fraction: float = 0.5         # share of prompts whose gold verdict is UNSAFE (t >= k*)
    max_prompt_tokens: int = 4096        # the templated prompt's limit; render() gets aftraj.tokens.prompt_budget(it)
    val_prompts: int = 8                 # verl needs val_files: a monitor slice of the train prompts

    # --- GRPO
    num_generations: int = 4             # the group size G (verl: rollout.n)
    max_completion_length: int = 256     # tokens (verl: data.max_response_length)
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.04                   # KL to the stage-1 model (verl: actor.kl_loss_coef)
    kl_loss_type: str = "low_var_kl"     # verl only; TRL's GRPO KL is the k3 (low-variance) estimator
    loss_type: str = "grpo"
    epsilon: float = 0.2
    prompts_per_step: int = 2            # prompts per optimizer step (x num_generations completions)
    gradient_accumulation_steps: int = 1
    # TRL: completions in one forward/backward (null: prompts_per_step x num_generations, one
    # padded batch). The optimizer step and the generation batch stay the same; 1 runs each
    # completion alone: the padded batch of 4 took SDPA's masked path, 16.9 GiB for SmolLM2 on CPU
    micro_batch_size: int | None = None
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    optimizer: str = "adamw_torch"
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    bf16: bool = False                   # TRL on CPU needs bf16 off

    # --- reward (training/reward.py): flat keys, the defaults RewardConfig's (`reward` builds one)
    w_format: float = RewardConfig.w_format
    w_what: float = RewardConfig.w_what
    w_where: float = RewardConfig.w_where
    w_who: float = RewardConfig.w_who
    sigma: float = RewardConfig.sigma
    malformed_score: float = RewardConfig.malformed_score
    overlong_buffer_len: int = RewardConfig.overlong_buffer_len        # DAPO soft buffer in tokens; 0 = off
    overlong_penalty_factor: float = RewardConfig.overlong_penalty_factor  # < w_format - malformed_score (checked)
    safe_where_who_credit: float = RewardConfig.safe_where_who_credit  # where = who of a right SAFE verdict, in [0, 1]

    # --- verl engine (training/verl/stage2_grpo.yaml holds the rest)
    verl_nnodes: int = 1
    verl_gpus_per_node: int = 8
    verl_tensor_parallel: int = 1        # vLLM rollout tensor parallel size
    verl_gpu_memory_utilization: float = 0.6
    verl_ppo_mini_batch_size: int = 16   # prompts per PPO mini-batch
    verl_micro_batch_size_per_gpu: int = 2

    def __post_init__(self) -> None:
        check_types(self)
        self.check_model()
        for k in ("max_steps", "logging_steps", "save_steps", "max_prompt_tokens", "max_prompts",
                  "num_generations", "max_completion_length", "prompts_per_step",
                  "gradient_accumulation_steps", "synthetic_trajectories",
                  "verl_nnodes", "verl_gpus_per_node", "verl_tensor_parallel",
                  "verl_ppo_mini_batch_size", "verl_micro_batch_size_per_gpu", "val_prompts"):
            if getattr(self, k) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, k)}", key=k)
        if self.num_generations < 2:
            raise ConfigError("must be >= 2: GRPO compares completions within a group", key="num_generations")
        if self.max_prompts < 2:
            raise ConfigError("must be >= 2: the prompts hold both gold verdicts", key="max_prompts")
        for k in ("seed", "warmup_steps"):
            if getattr(self, k) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, k)}", key=k)
        if self.micro_batch_size is not None and (
                self.micro_batch_size < 1 or self.prompts_per_step * self.num_generations % self.micro_batch_size):
            raise ConfigError(f"must divide prompts_per_step x num_generations "
                              f"({self.prompts_per_step * self.num_generations}), got {self.micro_batch_size}",
                              key="micro_batch_size")
        for k in ("save_total_limit", "max_trajectories"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise ConfigError(f"must be >= 1 or null, got {v}", key=k)
        for k, choices in (("optimizer", OPTIMIZERS), ("lr_scheduler", SCHEDULERS),
                           ("loss_type", LOSS_TYPES), ("kl_loss_type", KL_LOSS_TYPES)):
            if getattr(self, k) not in choices:
                raise ConfigError(f"must be one of {', '.join(choices)}; got {getattr(self, k)!r}", key=k)
        for t in self.report_to:
            if t not in TRACKERS:
                raise ConfigError(f"unknown tracker {t!r}; choose from {', '.join(TRACKERS)}", key="report_to")
        if not 0 < self.unsafe_fraction < 1:
            raise ConfigError(f"must be strictly between 0 and 1, got {self.unsafe_fraction}",
                              key="unsafe_fraction")
        if self.beta < 0:
            raise ConfigError(f"must be >= 0, got {self.beta}", key="beta")
        for k in ("learning_rate", "temperature", "epsilon"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"must be > 0, got {getattr(self, k)}", key=k)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.top_p}", key="top_p")
        if not 0 < self.verl_gpu_memory_utilization < 1:
            raise ConfigError(f"must be in (0, 1), got {self.verl_gpu_memory_utilization}",
                              key="verl_gpu_memory_utilization")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"must be > 0 or null, got {self.max_grad_norm}", key="max_grad_norm")
        if self.overlong_buffer_len >= self.max_completion_length:
            raise ConfigError(f"must be below max_completion_length ({self.max_completion_length}), "
                              f"got {self.overlong_buffer_len}", key="overlong_buffer_len")
        if self.warmup_steps >= self.max_steps and self.lr_scheduler != "constant":
            raise ConfigError(f"must be below max_steps ({self.max_steps}), got {self.warmup_steps}",
                              key="warmup_steps")
        try:
            _ = self.reward                     # the property parses and checks the reward spec
        except ValueError as e:
            raise ConfigError(str(e).removeprefix("reward: "), key=str(e).split()[1]) from None

    @property
    def reward(self) -> RewardConfig:
        return RewardConfig(w_format=self.w_format, w_what=self.w_what, w_where=self.w_where,
                            w_who=self.w_who, sigma=self.sigma, malformed_score=self.malformed_score,
                            overlong_buffer_len=self.overlong_buffer_len,
                            overlong_penalty_factor=self.overlong_penalty_factor,
                            safe_where_who_credit=self.safe_where_who_credit)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_stage2_config(path: str | Path, overrides: dict | None = None) -> Stage2Config:
    """Read a YAML config (flat keys), apply `overrides`, validate. Errors name the file and key."""
    return load(Stage2Config, path, overrides, what="stage-2")
