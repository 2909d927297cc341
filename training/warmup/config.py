"""Warm-up run configuration (typed, validated; values in configs/warmup/*.yaml), read by the one
flat-YAML reader `training.stage1.config.load_flat_config`. The warm-up is NOT in the paper.

    from training.warmup.config import load_warmup_config
    cfg = load_warmup_config("configs/warmup/tiny-cpu.yaml", {"max_steps": 2})
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from training.stage1.config import DTYPES, EXPORT_DTYPES, FINETUNES, ConfigError, load_flat_config


@dataclass
class WarmupConfig:
    # --- run
    seed: int = 0
    output_dir: str = "runs/warmup"
    max_steps: int = 10
    logging_steps: int = 1

    # --- model (same meaning as in stage 1: the stage-1 loader and LoRA wrapper are reused)
    model: str = "builtin:tiny-qwen2"
    dtype: str = "float32"
    export_dtype: str = "float32"
    attn_implementation: str = "sdpa"
    finetune: str = "lora"
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    gradient_checkpointing: bool = False

    # --- data: random prefixes of TRAIN-split runs, content-independent targets
    data: str = "builtin:synthetic"
    synthetic_trajectories: int = 24
    max_prompt_tokens: int = 2048      # render() budget, counted with the model's tokenizer
    max_completion_tokens: int = 192
    alarm_fraction: float = 0.3        # share of targets that are an ALARM at the last shown step

    # --- optimisation (plain AdamW, constant lr)
    batch_size: int = 4
    learning_rate: float = 5e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0

    # --- parse check after training (greedy, on seeded VAL-split prefixes)
    parse_check_prompts: int = 32
    parse_check_max_new_tokens: int = 128

    # --- what stage 1's accelerate set-up reads (one process, no mixed precision)
    mixed_precision: str = "no"
    process_group_timeout_minutes: int = 30
    report_to: list = field(default_factory=list)

    def __post_init__(self) -> None:
        for k in ("max_steps", "logging_steps", "synthetic_trajectories", "max_prompt_tokens",
                  "max_completion_tokens", "batch_size", "parse_check_max_new_tokens", "lora_r"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"must be an integer >= 1, got {v!r}", key=k)
        if not isinstance(self.parse_check_prompts, int) or self.parse_check_prompts < 0:
            raise ConfigError(f"must be an integer >= 0, got {self.parse_check_prompts!r}",
                              key="parse_check_prompts")
        if not (isinstance(self.alarm_fraction, (int, float)) and 0.0 <= self.alarm_fraction <= 1.0):
            raise ConfigError(f"must be in [0, 1], got {self.alarm_fraction!r}", key="alarm_fraction")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0):
            raise ConfigError(f"must be > 0, got {self.learning_rate!r}", key="learning_rate")
        for k, allowed in (("finetune", FINETUNES), ("dtype", DTYPES), ("export_dtype", EXPORT_DTYPES)):
            if getattr(self, k) not in allowed:
                raise ConfigError(f"must be one of {', '.join(allowed)}, got {getattr(self, k)!r}", key=k)
        if self.mixed_precision != "no":
            raise ConfigError("the warm-up runs in one process without mixed precision: 'no'",
                              key="mixed_precision")

    def to_dict(self) -> dict:
        return asdict(self)


def load_warmup_config(path: str | Path, overrides: dict | None = None) -> WarmupConfig:
    return load_flat_config(WarmupConfig, path, overrides, what="warm-up")
