"""Every-prefix decision training: the run's configuration (configs/prefixes/*.yaml), read by the
one config layer `aftraj.config.load`.

    from training.prefixes.config import load_prefixes_config
    cfg = load_prefixes_config("configs/prefixes/tiny-cpu.yaml", {"num_epochs": 1})
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from aftraj.config import ConfigError, ModelConfig, check_types, load
from aftraj.tokens import TEMPLATE_MARGIN
from training.stage1.config import EXPORT_DTYPES


@dataclass
class PrefixesConfig(ModelConfig):
    # --- run
    seed: int = 0
    output_dir: str = "runs/prefixes"
    logging_steps: int = 1

    # --- model: the top `trainable_layers` decoder layers (and the final norm) train, from the
    # input of the first of them, computed once for every token (frozen below)
    trainable_layers: int = 2
    export_dtype: str = "float32"

    # --- data: TRAIN-split runs; unsafe runs give prefixes 0..k* (k* ALARM, the rest SAFE), safe
    # runs every prefix (SAFE); a prefix is rendered within aftraj.tokens.prompt_budget(
    # max_prompt_tokens), the one budget rule; prefixes it would show as a bounded view are left
    # out (full renders only), and so is an unsafe run whose k* prompt does not fit
    data: str = "builtin:synthetic"
    synthetic_trajectories: int = 12
    max_prompt_tokens: int = 1100
    # the cap for SAFE runs' prefixes (null: max_prompt_tokens). A walk reads a safe run to its
    # last step (median ~2,000 SmolLM2 tokens on the 2k scripted build, where only 7 of 805 train
    # safe runs end within 1,100): a safe run cut at the unsafe runs' cap never trains the late
    # prefixes a walk reads last
    max_safe_prompt_tokens: int | None = None
    max_unsafe_runs: int | None = None     # the first N eligible unsafe runs of the split (None: all)
    max_safe_runs: int | None = None       # likewise for safe runs
    # held-out rows scored before and after training (the decision log-odds of every prefix,
    # OUT/heldout.jsonl, and the ALARM-vs-SAFE AUC in data.json): a split of the corpus folder
    # (`val`), or null
    heldout_split: str | None = None
    max_heldout_runs: int | None = None    # per kind (unsafe, safe), like max_unsafe_runs
    # ALARM rows weigh `alarm_weight` each, SAFE rows 1 ("balanced": total SAFE rows / ALARM rows)
    alarm_weight: float | str = "balanced"
    # the twin contrast (NOT in the paper; issue 21): for each unsafe train run whose verified-safe
    # twin (identical up to k*-1, the same agent at k*) is among the train runs, the pairwise term
    # -log sigmoid(log-odds(run, k*) - log-odds(twin, k*)) weighted `twin_weight` (0: off); a run
    # and its twin share a step. The cross-entropy alone is met by position and step kind (post
    # beats twin 0.50 on 54 val pairs, 2026-12-02); this term only by step k*'s content
    twin_weight: float = 0.0

    # --- optimisation (AdamW, cosine to 0 after `warmup_steps` linear steps)
    num_epochs: int = 3
    runs_per_step: int = 4
    learning_rate: float = 5e-5
    warmup_steps: int = 0
    # bf16 autocast of the training capture and the steps ("auto": where the device computes bf16
    # natively, a CUDA GPU or a CPU with AVX512-BF16/AMX, as stage 1's resolver says; weights stay
    # float32). The held-out rows are scored in float32 whatever this says (a measurement: bf16 moves
    # the decision log-odds by more than the post-vs-twin gap). "no": float32 throughout.
    mixed_precision: str = "no"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        check_types(self)
        self.check_model()
        if self.finetune != "full":
            raise ConfigError("every-prefix training fine-tunes the top layers fully: 'full'", key="finetune")
        for k in ("logging_steps", "trainable_layers", "synthetic_trajectories", "max_prompt_tokens",
                  "num_epochs", "runs_per_step"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"must be an integer >= 1, got {v!r}", key=k)
        if self.max_safe_prompt_tokens is not None and (not isinstance(self.max_safe_prompt_tokens, int)
                                                        or isinstance(self.max_safe_prompt_tokens, bool)
                                                        or self.max_safe_prompt_tokens < 1):
            raise ConfigError(f"must be null or an integer >= 1, got {self.max_safe_prompt_tokens!r}",
                              key="max_safe_prompt_tokens")
        for k in ("max_prompt_tokens", "max_safe_prompt_tokens"):
            v = getattr(self, k)
            if v is not None and v <= TEMPLATE_MARGIN:
                raise ConfigError(f"must be > {TEMPLATE_MARGIN} (aftraj.tokens.TEMPLATE_MARGIN: the budget rule "
                                  f"keeps that room for the chat template), got {v!r}", key=k)
        for k in ("max_unsafe_runs", "max_safe_runs", "max_heldout_runs"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"must be null or an integer >= 0, got {v!r}", key=k)
        if not (self.alarm_weight == "balanced" or (isinstance(self.alarm_weight, (int, float))
                                                    and not isinstance(self.alarm_weight, bool)
                                                    and self.alarm_weight > 0)):
            raise ConfigError(f"must be 'balanced' or a number > 0, got {self.alarm_weight!r}", key="alarm_weight")
        if self.mixed_precision not in ("no", "bf16", "auto"):
            raise ConfigError(f"must be 'no', 'bf16' or 'auto', got {self.mixed_precision!r}",
                              key="mixed_precision")
        if self.twin_weight < 0:
            raise ConfigError(f"must be a number >= 0, got {self.twin_weight!r}", key="twin_weight")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0):
            raise ConfigError(f"must be > 0, got {self.learning_rate!r}", key="learning_rate")
        if self.export_dtype not in EXPORT_DTYPES:
            raise ConfigError(f"must be one of {', '.join(EXPORT_DTYPES)}; got {self.export_dtype!r}",
                              key="export_dtype")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError("a packed forward needs a mask the attention reads: 'sdpa' or 'eager'",
                              key="attn_implementation")

    def prompt_cap(self, unsafe: bool) -> int:
        """The prompt cap of an unsafe run's prefixes, or of a safe run's."""
        if unsafe or self.max_safe_prompt_tokens is None:
            return self.max_prompt_tokens
        return self.max_safe_prompt_tokens

    def to_dict(self) -> dict:
        return asdict(self)


def load_prefixes_config(path: str | Path, overrides: dict | None = None) -> PrefixesConfig:
    return load(PrefixesConfig, path, overrides, what="every-prefix")
