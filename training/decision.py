"""What the two decision-training stages share (every-prefix, training/prefixes; step-scored,
training/steps): the config fields and checks both have (`DecisionConfig`), and their command
lines' common arguments, config loading and summary line. Each stage keeps its own keys, defaults
and messages in its subclass and its cli.py.

    @dataclass
    class PrefixesConfig(DecisionConfig):
        FINETUNE_RULE = "every-prefix training fine-tunes the top layers fully: 'full'"
        ...
    cfg = config_from_args(args, load_prefixes_config)      # None after --print-config
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from aftraj.config import ConfigError, ModelConfig, check_types
from training.stage1.config import EXPORT_DTYPES, MIXED_PRECISIONS


def need_counts(cfg, keys: tuple[str, ...], *, minimum: int, optional: bool) -> None:
    """Each of `keys` an integer >= `minimum` (or null when `optional`), else a ConfigError naming it."""
    for k in keys:
        v = getattr(cfg, k)
        if optional and v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise ConfigError(f"must be {'null or ' if optional else ''}an integer >= {minimum}, got {v!r}", key=k)


@dataclass
class DecisionConfig(ModelConfig):
    """The fields of a decision-training run that both stages have; a subclass adds its own and
    says, in class attributes (not keys), what it checks that differs."""

    FINETUNE_RULE = "fine-tunes the top layers fully: 'full'"     # the message when finetune is not 'full'
    ATTENTION_RULE = "needs a mask the attention reads: 'sdpa' or 'eager'"
    POSITIVE = ("logging_steps", "synthetic_trajectories", "num_epochs", "runs_per_step")   # integers >= 1
    OPTIONAL_POSITIVE = ()                                   # null or an integer >= 1
    OPTIONAL_COUNTS = ("max_unsafe_runs", "max_safe_runs", "max_heldout_runs")            # null or >= 0
    PRECISION_KEYS = ("mixed_precision",)

    # --- run
    seed: int = 0
    output_dir: str = "runs/decision"
    logging_steps: int = 1

    # --- data: TRAIN-split runs of a corpus folder (or a JSONL file, or `builtin:synthetic` of
    # `synthetic_trajectories` runs)
    data: str = "builtin:synthetic"
    synthetic_trajectories: int = 12
    max_unsafe_runs: int | None = None     # the first N eligible unsafe runs of the split (None: all)
    max_safe_runs: int | None = None       # likewise for safe runs
    # held-out runs scored after training (what the stage writes: its trainer's docstring): a
    # split of the corpus folder (`val`), or null
    heldout_split: str | None = None
    max_heldout_runs: int | None = None    # per kind (unsafe, safe), like max_unsafe_runs
    # ALARM rows weigh `alarm_weight` each, SAFE rows 1 ("balanced": total SAFE rows / ALARM rows)
    alarm_weight: float | str = "balanced"
    # the twin contrast (NOT in the paper; issue 21): for each unsafe train run whose verified-safe
    # twin (identical up to k*-1, the same agent at k*) is among the train runs, the pairwise term
    # -log sigmoid(log-odds(run, k*) - log-odds(twin, k*)) weighted `twin_weight` (0: off); a run
    # and its twin share a step
    twin_weight: float = 0.0

    # --- optimisation (AdamW, cosine to 0 after `warmup_steps` linear steps)
    num_epochs: int = 1
    runs_per_step: int = 4
    learning_rate: float = 5e-5
    warmup_steps: int = 0
    # bf16 autocast ("auto": where the device computes bf16 natively, a CUDA GPU or a CPU with
    # AVX512-BF16/AMX); weights stay float32. "no": float32 throughout
    mixed_precision: str = "no"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    export_dtype: str = "float32"          # dtype of final/

    def __post_init__(self) -> None:
        check_types(self)
        self.check_model()
        if self.finetune != "full":
            raise ConfigError(self.FINETUNE_RULE, key="finetune")
        need_counts(self, self.POSITIVE, minimum=1, optional=False)
        need_counts(self, self.OPTIONAL_POSITIVE, minimum=1, optional=True)
        need_counts(self, self.OPTIONAL_COUNTS, minimum=0, optional=True)
        self.check_stage()
        if not (self.alarm_weight == "balanced" or (isinstance(self.alarm_weight, (int, float))
                                                    and not isinstance(self.alarm_weight, bool)
                                                    and self.alarm_weight > 0)):
            raise ConfigError(f"must be 'balanced' or a number > 0, got {self.alarm_weight!r}", key="alarm_weight")
        for k in self.PRECISION_KEYS:
            if getattr(self, k) not in MIXED_PRECISIONS:
                raise ConfigError(f"must be 'no', 'bf16' or 'auto', got {getattr(self, k)!r}", key=k)
        if self.twin_weight < 0:
            raise ConfigError(f"must be a number >= 0, got {self.twin_weight!r}", key="twin_weight")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0):
            raise ConfigError(f"must be > 0, got {self.learning_rate!r}", key="learning_rate")
        if self.export_dtype not in EXPORT_DTYPES:
            raise ConfigError(f"must be one of {', '.join(EXPORT_DTYPES)}; got {self.export_dtype!r}",
                              key="export_dtype")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError(self.ATTENTION_RULE, key="attn_implementation")

    def check_stage(self) -> None:
        """The stage's own checks (after the shared counts, before the shared value checks)."""

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- command line

def add_arguments(p: argparse.ArgumentParser, *, configs: str, data: str, model: str) -> None:
    """The arguments both stages take; `configs`, `data`, `model` complete their help lines."""
    p.add_argument("--config", required=True, help=f"YAML ({configs})")
    p.add_argument("--data", help=f"corpus folder ({data}) or JSONL file; overrides `data`")
    p.add_argument("--out", help="run folder; overrides `output_dir`")
    p.add_argument("--model", help=f"local model folder or builtin:NAME{model}; overrides `model`")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key (VALUE parsed as YAML), repeatable")


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no per-step lines")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")


def config_from_args(args, load) -> tuple:
    """(the config `load(path, overrides)` gives for the command line, whether to stop there):
    with --print-config the config is printed as JSON and the run stops."""
    from aftraj.config import cli_overrides

    cfg = load(args.config, cli_overrides(args, {"data": "data", "output_dir": "out", "model": "model"}))
    if args.print_config:
        print(json.dumps(cfg.to_dict()))
    return cfg, args.print_config


def summary(res, steps: int | None, **more) -> dict:
    """The line a finished run prints: its folders, steps, first and last loss, rows."""
    h = res.history
    return {"output_dir": str(res.output_dir), "final": str(res.final_dir) if res.final_dir else None,
            "steps": steps, "loss_first": h[0]["loss"] if h else None, "loss_last": h[-1]["loss"] if h else None,
            "rows": res.data["rows"], "alarm_rows": res.data["alarm_rows"], **more}
