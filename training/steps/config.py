"""Step-scored decision training: the run's configuration (configs/steps/*.yaml), read by the one
config layer `aftraj.config.load`. The fields and checks it shares with every-prefix training are
`training.decision.DecisionConfig`'s.

    from training.steps.config import load_steps_config
    cfg = load_steps_config("configs/steps/tiny-cpu.yaml", {"num_epochs": 1})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aftraj.config import ConfigError, load
from training.decision import DecisionConfig

AFTER_KSTAR = ("skip", "alarm")


@dataclass
class StepsConfig(DecisionConfig):
    FINETUNE_RULE = "step-scored training fine-tunes the top layers (or all) fully: 'full'"
    ATTENTION_RULE = "a padded forward needs a mask the attention reads: 'sdpa' or 'eager'"
    POSITIVE = ("logging_steps", "synthetic_trajectories", "max_tokens", "num_epochs", "runs_per_step",
                "process_group_timeout_minutes")
    OPTIONAL_POSITIVE = ("trainable_layers", "max_steps", "max_step_tokens")
    OPTIONAL_COUNTS = ("max_unsafe_runs", "max_safe_runs", "max_heldout_runs", "save_steps", "warmup_steps",
                       "keep_tokens")
    PRECISION_KEYS = ("mixed_precision", "score_precision")

    # --- run (DecisionConfig: seed, logging_steps)
    output_dir: str = "runs/steps"
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

    # --- data (DecisionConfig: data, synthetic_trajectories, max_unsafe_runs, max_safe_runs,
    # max_heldout_runs, alarm_weight): every TRAIN-split run, read as one step-tagged sequence (a
    # run longer than max_tokens as several segments, `aftraj.prompt.StepReading`); unsafe runs:
    # SAFE before k*, ALARM at k*, and after k* `after_kstar` ("skip": no loss, the sequence ends at
    # k*; "alarm": ALARM); safe runs SAFE at every step
    max_tokens: int = 4096
    max_step_tokens: int | None = 512
    # a new segment re-reads the most recent steps that fit in keep_tokens before the new one (0:
    # the new step alone; the auditor's cost of a new segment is then about one event's)
    keep_tokens: int = 0
    after_kstar: str = "skip"
    # heldout_split (DecisionConfig): held-out runs scored after training at every step
    # (OUT/heldout_steps.jsonl); the walk's threshold is chosen on them (`aftraj train steps`
    # calibrates and stores it in final/)
    # the held-out scores' precision ("no": float32; "bf16"/"auto": bf16 autocast); exported with
    # the model (final/steps_reading.json) and the `hf-steps` auditor's default, so the walk reads
    # the scores the threshold was chosen on
    score_precision: str = "no"
    # the twin contrast (DecisionConfig; training/prefixes), on by default here
    twin_weight: float = 2.0

    def check_stage(self) -> None:
        if self.max_step_tokens is not None and self.max_step_tokens * 2 > self.max_tokens:
            raise ConfigError(f"must be at most half of max_tokens ({self.max_tokens}), got {self.max_step_tokens}",
                              key="max_step_tokens")
        if self.keep_tokens * 2 > self.max_tokens:
            raise ConfigError(f"must be at most half of max_tokens ({self.max_tokens}), got {self.keep_tokens}",
                              key="keep_tokens")
        if self.after_kstar not in AFTER_KSTAR:
            raise ConfigError(f"must be one of {', '.join(AFTER_KSTAR)}, got {self.after_kstar!r}", key="after_kstar")

    def reading(self) -> dict:
        """The step-tagged reading's bounds (`aftraj.prompt.StepReading` keywords), which the
        auditor must read with too: exported as final/steps_reading.json."""
        return {"max_tokens": self.max_tokens, "max_step_tokens": self.max_step_tokens,
                "keep_tokens": self.keep_tokens}


def load_steps_config(path: str | Path, overrides: dict | None = None) -> StepsConfig:
    return load(StepsConfig, path, overrides, what="step-scored")
