"""Warm-up run configuration (typed, validated; values in configs/warmup/*.yaml), read by the one
config layer `aftraj.config.load`; the model fields are `aftraj.config.ModelConfig`'s (with the
warm-up's own LoRA defaults). The warm-up is NOT in the paper.

    from training.warmup.config import load_warmup_config
    cfg = load_warmup_config("configs/warmup/tiny-cpu.yaml", {"max_steps": 2})
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from aftraj.config import ConfigError, ModelConfig, check_types, load
from training.stage1.config import EXPORT_DTYPES


@dataclass
class WarmupConfig(ModelConfig):
    # --- run
    seed: int = 0
    output_dir: str = "runs/warmup"
    max_steps: int = 10
    logging_steps: int = 1

    # --- model: ModelConfig's fields (same meaning as in stage 1: the stage-1 loader and LoRA
    # wrapper are reused), with the warm-up's defaults: a small LoRA on the attention projections
    finetune: str = "lora"
    lora_r: int = 8
    lora_alpha: int = 16
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    export_dtype: str = "float32"

    # --- data: random prefixes of TRAIN-split runs, content-independent targets
    data: str = "builtin:synthetic"
    synthetic_trajectories: int = 24
    max_prompt_tokens: int = 2048      # the templated prompt's limit; render() gets aftraj.tokens.prompt_budget(it)
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

    # --- what stage 1's accelerate set-up reads (one process). mixed_precision: "no" (float32),
    # "bf16" (autocast: float32 weights and gradients, bf16 matmuls) or "auto" (bf16 where the
    # device computes it natively, e.g. a CPU with AVX512-BF16: x1.5 a 2,000-token example,
    # benchmarks/warmup_step.py; else "no")
    mixed_precision: str = "no"
    process_group_timeout_minutes: int = 30
    report_to: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_types(self)
        self.check_model()
        for k in ("max_steps", "logging_steps", "synthetic_trajectories", "max_prompt_tokens",
                  "max_completion_tokens", "batch_size", "parse_check_max_new_tokens"):
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
        if self.export_dtype not in EXPORT_DTYPES:
            raise ConfigError(f"must be one of {', '.join(EXPORT_DTYPES)}; got {self.export_dtype!r}",
                              key="export_dtype")
        if self.mixed_precision not in ("no", "bf16", "auto"):
            raise ConfigError(f"must be 'no', 'bf16' or 'auto', got {self.mixed_precision!r}",
                              key="mixed_precision")

    def to_dict(self) -> dict:
        return asdict(self)


def load_warmup_config(path: str | Path, overrides: dict | None = None) -> WarmupConfig:
    return load(WarmupConfig, path, overrides, what="warm-up")
