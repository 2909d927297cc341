"""Every-prefix decision training: the run's configuration (configs/prefixes/*.yaml), read by the
one config layer `aftraj.config.load`. The fields and checks it shares with step-scored training
are `training.decision.DecisionConfig`'s.

    from training.prefixes.config import load_prefixes_config
    cfg = load_prefixes_config("configs/prefixes/tiny-cpu.yaml", {"num_epochs": 1})
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aftraj.config import ConfigError, load
from aftraj.tokens import TEMPLATE_MARGIN
from training.decision import DecisionConfig


@dataclass
class PrefixesConfig(DecisionConfig):
    FINETUNE_RULE = "every-prefix training fine-tunes the top layers fully: 'full'"
    ATTENTION_RULE = "a packed forward needs a mask the attention reads: 'sdpa' or 'eager'"
    POSITIVE = ("logging_steps", "trainable_layers", "synthetic_trajectories", "max_prompt_tokens",
                "num_epochs", "runs_per_step")
    OPTIONAL_POSITIVE = ("max_safe_prompt_tokens",)

    # --- run (DecisionConfig: seed, logging_steps)
    output_dir: str = "runs/prefixes"

    # --- model: the top `trainable_layers` decoder layers (and the final norm) train, from the
    # input of the first of them, computed once for every token (frozen below)
    trainable_layers: int = 2

    # --- data (DecisionConfig: data, synthetic_trajectories, max_unsafe_runs, max_safe_runs,
    # max_heldout_runs, alarm_weight): unsafe runs give prefixes 0..k* (k* ALARM, the rest SAFE),
    # safe runs every prefix (SAFE); a prefix is rendered within aftraj.tokens.prompt_budget(
    # max_prompt_tokens), the one budget rule; prefixes it would show as a bounded view are left
    # out (full renders only), and so is an unsafe run whose k* prompt does not fit
    max_prompt_tokens: int = 1100
    # the cap for SAFE runs' prefixes (null: max_prompt_tokens). A walk reads a safe run to its
    # last step (median ~2,000 SmolLM2 tokens on the 2k scripted build, where only 7 of 805 train
    # safe runs end within 1,100): a safe run cut at the unsafe runs' cap never trains the late
    # prefixes a walk reads last
    max_safe_prompt_tokens: int | None = None
    # heldout_split (DecisionConfig): the held-out rows scored before and after training (the
    # decision log-odds of every prefix, OUT/heldout.jsonl, and the ALARM-vs-SAFE AUC in data.json)
    # twin_weight (DecisionConfig; 0: off): the cross-entropy alone is met by position and step
    # kind; this term only by step k*'s content

    # --- optimisation (DecisionConfig's keys)
    num_epochs: int = 3
    # mixed_precision covers the training capture and the steps ("auto" as stage 1's resolver
    # says); the held-out rows are scored in float32 whatever it says (a measurement: bf16 moves
    # the decision log-odds by more than the post-vs-twin gap)

    def check_stage(self) -> None:
        for k in ("max_prompt_tokens", "max_safe_prompt_tokens"):
            v = getattr(self, k)
            if v is not None and v <= TEMPLATE_MARGIN:
                raise ConfigError(f"must be > {TEMPLATE_MARGIN} (aftraj.tokens.TEMPLATE_MARGIN: the budget rule "
                                  f"keeps that room for the chat template), got {v!r}", key=k)

    def prompt_cap(self, unsafe: bool) -> int:
        """The prompt cap of an unsafe run's prefixes, or of a safe run's."""
        if unsafe or self.max_safe_prompt_tokens is None:
            return self.max_prompt_tokens
        return self.max_safe_prompt_tokens


def load_prefixes_config(path: str | Path, overrides: dict | None = None) -> PrefixesConfig:
    return load(PrefixesConfig, path, overrides, what="every-prefix")
