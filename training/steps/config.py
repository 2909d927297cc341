"""Step-scored decision training: the run's configuration (configs/steps/*.yaml), read by the one
config layer `aftraj.config.load`.

    from training.steps.config import load_steps_config
    cfg = load_steps_config("configs/steps/tiny-cpu.yaml", {"num_epochs": 1})
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from aftraj.config import ConfigError, ModelConfig, check_types, load
from training.stage1.config import EXPORT_DTYPES

AFTER_KSTAR = ("skip", "alarm")


@dataclass
class StepsConfig(ModelConfig):
    # --- run
    seed: int = 0
    output_dir: str = "runs/steps"
    logging_steps: int = 1
    # a checkpoint (trainable weights, optimizer, schedule, step) every N optimizer steps in
    # OUT/checkpoint/ (0: none); `--resume` continues from it, equal to an uninterrupted run
    save_steps: int = 0
    # stop after N optimizer steps (null: the whole plan); the schedule is the whole plan's
    max_steps: int | None = None
    report_to: list[str] = field(default_factory=list)
    process_group_timeout_minutes: int = 60

    # --- model: the top `trainable_layers` decoder layers and the final norm train (null: every
    # parameter); frozen layers run without autograd
    trainable_layers: int | None = 2
    export_dtype: str = "float32"

    # --- data: every TRAIN-split run, read as one step-tagged sequence (a run longer than
    # max_tokens as several segments, `aftraj.prompt.StepReading`); unsafe runs: SAFE before k*,
    # ALARM at k*, and after k* `after_kstar` ("skip": no loss, the sequence ends at k*; "alarm":
    # ALARM); safe runs SAFE at every step
    data: str = "builtin:synthetic"
    synthetic_trajectories: int = 12
    max_tokens: int = 4096
    max_step_tokens: int | None = 512
    # a new segment re-reads the most recent steps that fit in keep_tokens before the new one (0:
    # the new step alone; the auditor's cost of a new segment is then about one event's)
    keep_tokens: int = 0
    after_kstar: str = "skip"
    max_unsafe_runs: int | None = None
    max_safe_runs: int | None = None
    # held-out runs scored after training at every step (OUT/heldout_steps.jsonl); the walk's
    # threshold is chosen on them (`aftraj train steps` calibrates and stores it in final/)
    heldout_split: str | None = None
    max_heldout_runs: int | None = None
    # the held-out scores' precision ("no": float32; "bf16"/"auto": bf16 autocast, ~2.7x faster on an
    # AMX CPU); exported with the model (final/steps_reading.json) and the `hf-steps` auditor's
    # default, so the walk reads the scores the threshold was chosen on
    score_precision: str = "no"
    # ALARM rows weigh `alarm_weight` each, SAFE rows 1 ("balanced": SAFE rows / ALARM rows)
    alarm_weight: float | str = "balanced"
    # the twin contrast (training/prefixes): -log sigmoid(log-odds(run, k*) - log-odds(twin, k*))
    twin_weight: float = 2.0

    # --- optimisation (AdamW, cosine to 0 after `warmup_steps` linear steps)
    num_epochs: int = 1
    runs_per_step: int = 4
    learning_rate: float = 5e-5
    warmup_steps: int = 0
    # bf16 autocast ("auto": where the device computes bf16 natively); weights stay `dtype`
    mixed_precision: str = "no"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        check_types(self)
        self.check_model()
        if self.finetune != "full":
            raise ConfigError("step-scored training fine-tunes the top layers (or all) fully: 'full'", key="finetune")
        for k in ("logging_steps", "synthetic_trajectories", "max_tokens", "num_epochs", "runs_per_step",
                  "process_group_timeout_minutes"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"must be an integer >= 1, got {v!r}", key=k)
        for k in ("trainable_layers", "max_steps", "max_step_tokens"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"must be null or an integer >= 1, got {v!r}", key=k)
        for k in ("max_unsafe_runs", "max_safe_runs", "max_heldout_runs", "save_steps", "warmup_steps",
                  "keep_tokens"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"must be null or an integer >= 0, got {v!r}", key=k)
        if self.max_step_tokens is not None and self.max_step_tokens * 2 > self.max_tokens:
            raise ConfigError(f"must be at most half of max_tokens ({self.max_tokens}), got {self.max_step_tokens}",
                              key="max_step_tokens")
        if self.keep_tokens * 2 > self.max_tokens:
            raise ConfigError(f"must be at most half of max_tokens ({self.max_tokens}), got {self.keep_tokens}",
                              key="keep_tokens")
        if self.after_kstar not in AFTER_KSTAR:
            raise ConfigError(f"must be one of {', '.join(AFTER_KSTAR)}, got {self.after_kstar!r}", key="after_kstar")
        if not (self.alarm_weight == "balanced" or (isinstance(self.alarm_weight, (int, float))
                                                    and not isinstance(self.alarm_weight, bool)
                                                    and self.alarm_weight > 0)):
            raise ConfigError(f"must be 'balanced' or a number > 0, got {self.alarm_weight!r}", key="alarm_weight")
        for k in ("mixed_precision", "score_precision"):
            if getattr(self, k) not in ("no", "bf16", "auto"):
                raise ConfigError(f"must be 'no', 'bf16' or 'auto', got {getattr(self, k)!r}", key=k)
        if self.twin_weight < 0:
            raise ConfigError(f"must be a number >= 0, got {self.twin_weight!r}", key="twin_weight")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0):
            raise ConfigError(f"must be > 0, got {self.learning_rate!r}", key="learning_rate")
        if self.export_dtype not in EXPORT_DTYPES:
            raise ConfigError(f"must be one of {', '.join(EXPORT_DTYPES)}; got {self.export_dtype!r}",
                              key="export_dtype")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError("a padded forward needs a mask the attention reads: 'sdpa' or 'eager'",
                              key="attn_implementation")

    def reading(self) -> dict:
        """The step-tagged reading's bounds (`aftraj.prompt.StepReading` keywords), which the
        auditor must read with too: exported as final/steps_reading.json."""
        return {"max_tokens": self.max_tokens, "max_step_tokens": self.max_step_tokens,
                "keep_tokens": self.keep_tokens}

    def to_dict(self) -> dict:
        return asdict(self)


def load_steps_config(path: str | Path, overrides: dict | None = None) -> StepsConfig:
    return load(StepsConfig, path, overrides, what="step-scored")
