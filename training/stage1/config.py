"""Stage-1 (BPPO) run configuration: one typed, validated dataclass; the values live in YAML
under `configs/stage1/` (one file per scale).

    from training.stage1.config import load_stage1_config
    cfg = load_stage1_config("configs/stage1/tiny-cpu.yaml", overrides={"max_steps": 3})

Read by the one config layer (`aftraj.config.load`); the model fields are `aftraj.config.ModelConfig`'s.
Unknown keys, wrong types and out-of-range values raise `ConfigError` naming the file and key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from aftraj.config import ConfigError, ModelConfig, check_types, load

MIXED_PRECISIONS = ("no", "bf16", "auto")   # auto: bf16 where the device computes it natively (a
                                            # CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else no   # fp16 would need a grad scaler whose state must round-trip too
EXPORT_DTYPES = ("float32", "bfloat16")
MAX_EPOCHS = 5                        # more needs allow_many_epochs: true (issue 12: 87 epochs went unnoticed)
OPTIMIZERS = ("adamw_torch", "adamw_bnb_8bit")
SCHEDULERS = ("cosine", "linear", "constant")
REFERENCES = ("precomputed", "live")
BATCHINGS = ("padded", "per_pair")
SAMPLERS = ("hf", "openai")
TRACKERS = ("tensorboard", "wandb")


@dataclass
class Stage1Config(ModelConfig):
    # --- run
    seed: int = 0
    output_dir: str = "runs/stage1"
    # The schedule: exactly one of num_epochs (steps = ceil(epochs × pairs ÷ global batch), derived
    # from the data at launch) or max_steps (a fixed count; the log still states its epochs).
    num_epochs: float | None = None
    max_steps: int | None = None
    allow_many_epochs: bool = False    # permit a schedule above MAX_EPOCHS epochs
    logging_steps: int = 1
    save_steps: int = 5
    save_total_limit: int | None = 2
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    wandb_project: str | None = None
    process_group_timeout_minutes: int = 60   # NCCL/gloo collective timeout (torch's default is 10)

    # --- model: ModelConfig's fields (model, dtype, attn_implementation, finetune, lora_*,
    # gradient_checkpointing), then stage 1's own
    trainable_layers: int | None = None  # full fine-tune of the top N decoder layers and the final
                                         # norm only (the rest frozen: its backward is never run);
                                         # null = every parameter
    sdpa_math_kernel: bool = True      # false: disable SDPA's math fallback on CUDA, so a fallback fails loudly
    export_dtype: str = "float32"      # dtype of final/ (bfloat16 for the production run)

    # --- data
    # A corpus folder (train.jsonl, else corpus.jsonl), a JSONL file, or `builtin:synthetic`.
    data: str = "builtin:synthetic"
    max_trajectories: int | None = None   # read only the first N trajectories (safe ones included)
    synthetic_trajectories: int = 24   # size of `builtin:synthetic`
    max_prompt_tokens: int = 8192      # the templated prompt's limit; render() gets aftraj.tokens.prompt_budget(it)
    max_completion_tokens: int = 512   # longer completions are cut at the end (counted in stats)
    max_post_tokens: int | None = None # skip unsafe runs whose full post-boundary prompt is longer
                                       # (no bounded view: the evidence stays in the prompt); counted

    # --- preferences (base-policy samples, classified against the gold verdict)
    samples_per_prompt: int = 0        # K; 0 = canonical stand-ins only
    max_pairs: int | None = None       # boundary pairs (unsafe runs) to sample and train on, seeded
                                       # choice; null = every pair of the data
    sampler: str = "hf"
    sample_temperature: float = 1.0
    sample_top_p: float = 1.0
    sample_max_new_tokens: int = 256   # must hold a canonical ALARM (85 SmolLM2 tokens at most on the
                                       # demo corpus): tests/training/test_token_limits.py checks the CPU config
    sample_batch_size: int = 4
    rejected_parse_failures: bool = False   # a parse failure may be the rejected sample (after
                                            # every well-formed wrong one); off: the canonical
                                            # boundary error stands in (pairs contrast verdicts)
    openai_base_url: str | None = None
    openai_model: str | None = None
    openai_api_key_env: str = "OPENAI_API_KEY"
    openai_concurrency: int = 8

    # --- loss (DESIGN §5)
    beta: float = 0.1
    weight_pre: float = 0.5            # per-subset weights w_s of DESIGN §5, not normalised: summing
    weight_post: float = 0.5           # to 1 keeps the loss on DPO's scale (ln 2 at the start)
    nll_coef: float = 0.0              # optional NLL on the chosen completion
    # --- amended DESIGN §5 (2026-12-01), beyond the paper: off by default
    weight_twin: float = 0.0           # > 0: the twin subset (a verified-safe twin's prefix 0..k*,
                                       # chosen SAFE, rejected ALARM(k*, a*)) is built and trained on
    twin_per_batch: int = 1            # twin pairs per micro-batch when weight_twin > 0
    decision_coef: float = 0.0         # CE on the decision token (first token where chosen and
                                       # rejected diverge, SAFE vs ALARM)
    decision_balance: bool = False     # the decision CE averaged per class (SAFE-chosen pre + twin,
                                       # ALARM-chosen post: one half each), not per pair (2:1 SAFE)
    margin_tokens: int | None = None   # DPO log-probs over the first N completion tokens only
    reference: str = "precomputed"     # ref log-probs computed once before step 1, or live each step

    # --- optimisation
    per_device_batch_size: int = 2     # preference pairs per micro-batch, both subsets in each
    batching: str = "padded"           # padded: one padded forward per micro-batch; per_pair: one
                                       # unpadded forward + backward per pair (prompt once, its KV
                                       # cache shared by both completions), no padding mask
    feature_cache: bool = False        # with trainable_layers + per_pair + a precomputed reference:
                                       # the frozen layers' output computed once (with the
                                       # reference), each step runs the top layers only
                                       # (`aftraj.scoring.pair_features`); one process only
    pre_fraction: float = 0.5          # share of each micro-batch drawn from the pre subset
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optimizer: str = "adamw_torch"
    lr_scheduler: str = "cosine"
    warmup_ratio: float = 0.0          # warm-up steps = round(ratio × total steps)
    warmup_steps: int | None = None    # a fixed number of warm-up steps instead (the paper: 50)
    max_grad_norm: float | None = 1.0
    mixed_precision: str = "no"

    def __post_init__(self) -> None:
        check_types(self)
        self.check_model()
        self._check_counts_and_choices()
        self._check_loss_and_batches()
        self._check_optimiser_and_sampler()
        self._check_schedule()

    def _check_counts_and_choices(self) -> None:
        pos = ("process_group_timeout_minutes", "logging_steps", "save_steps",
               "max_prompt_tokens", "max_completion_tokens",
               "sample_max_new_tokens", "sample_batch_size", "per_device_batch_size",
               "gradient_accumulation_steps", "openai_concurrency",
               "synthetic_trajectories")
        for k in pos:
            if getattr(self, k) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, k)}", key=k)
        for k in ("samples_per_prompt", "seed"):
            if getattr(self, k) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, k)}", key=k)
        for k in ("save_total_limit", "max_trajectories", "max_pairs"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise ConfigError(f"must be >= 1 or null, got {v}", key=k)
        for k, choices in (("mixed_precision", MIXED_PRECISIONS),
                           ("optimizer", OPTIMIZERS), ("lr_scheduler", SCHEDULERS),
                           ("reference", REFERENCES), ("sampler", SAMPLERS),
                           ("export_dtype", EXPORT_DTYPES), ("batching", BATCHINGS)):
            if getattr(self, k) not in choices:
                raise ConfigError(f"must be one of {', '.join(choices)}; got {getattr(self, k)!r}", key=k)
        for t in self.report_to:
            if t not in TRACKERS:
                raise ConfigError(f"unknown tracker {t!r}; choose from {', '.join(TRACKERS)}", key="report_to")

    def _check_loss_and_batches(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"must be > 0, got {self.beta}", key="beta")
        for k in ("weight_pre", "weight_post", "weight_twin", "nll_coef", "decision_coef", "weight_decay"):
            if getattr(self, k) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, k)}", key=k)
        if self.weight_pre + self.weight_post <= 0:
            raise ConfigError("weight_pre + weight_post must be > 0", key="weight_post")
        if not 0 < self.pre_fraction < 1:
            raise ConfigError(f"must be strictly between 0 and 1, got {self.pre_fraction}", key="pre_fraction")
        if self.per_device_batch_size < 2 + (self.twin_per_batch if self.weight_twin > 0 else 0):
            raise ConfigError("must be >= 2 (+ twin_per_batch with the twin subset on): every micro-batch "
                              "holds every subset", key="per_device_batch_size")
        if self.trainable_layers is not None and self.finetune != "full":
            raise ConfigError("applies to finetune: full only (LoRA chooses its modules with "
                              "lora_target_modules)", key="trainable_layers")
        for k in ("twin_per_batch", "margin_tokens", "max_post_tokens", "trainable_layers"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise ConfigError(f"must be >= 1{' or null' if k != 'twin_per_batch' else ''}, got {v}", key=k)
        if self.batching == "per_pair" and self.gradient_checkpointing:
            raise ConfigError("per_pair batching shares the prompt's KV cache between the two completions, "
                              "which gradient checkpointing disables; use batching: padded", key="batching")
        if self.feature_cache:
            for k, ok, need in (("trainable_layers", self.trainable_layers is not None, "a number (the top layers train)"),
                                ("batching", self.batching == "per_pair", "per_pair"),
                                ("reference", self.reference == "precomputed", "precomputed")):
                if not ok:
                    raise ConfigError(f"feature_cache: true needs {k}: {need}", key=k)

    def _check_optimiser_and_sampler(self) -> None:
        if self.learning_rate <= 0:
            raise ConfigError(f"must be > 0, got {self.learning_rate}", key="learning_rate")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"must be > 0 or null, got {self.max_grad_norm}", key="max_grad_norm")
        if not 0 < self.sample_top_p <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.sample_top_p}", key="sample_top_p")
        if self.sample_temperature <= 0:
            raise ConfigError(f"must be > 0, got {self.sample_temperature}", key="sample_temperature")
        if self.sampler == "openai" and self.samples_per_prompt > 0:
            for k in ("openai_base_url", "openai_model"):
                if not getattr(self, k):
                    raise ConfigError("is required when sampler is 'openai'", key=k)
        if "wandb" in self.report_to and not self.wandb_project:
            raise ConfigError("is required when report_to holds 'wandb'", key="wandb_project")

    def _check_schedule(self) -> None:
        if (self.num_epochs is None) == (self.max_steps is None):
            raise ConfigError("set exactly one of num_epochs and max_steps (the other null); got "
                              f"num_epochs={self.num_epochs}, max_steps={self.max_steps}", key="num_epochs")
        if self.num_epochs is not None:
            if self.num_epochs <= 0:
                raise ConfigError(f"must be > 0, got {self.num_epochs}", key="num_epochs")
            if self.num_epochs > MAX_EPOCHS and not self.allow_many_epochs:
                raise ConfigError(f"{self.num_epochs} epochs is above {MAX_EPOCHS}: DPO-style training "
                                  f"overfits a small preference set; set allow_many_epochs: true to force it",
                                  key="num_epochs")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"must be >= 1 or null, got {self.max_steps}", key="max_steps")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"must be in [0, 1), got {self.warmup_ratio}", key="warmup_ratio")
        if self.warmup_steps is not None:
            if self.warmup_steps < 0:
                raise ConfigError(f"must be >= 0 or null, got {self.warmup_steps}", key="warmup_steps")
            if self.warmup_ratio:
                raise ConfigError("give warmup_steps or warmup_ratio, not both", key="warmup_steps")

    @property
    def batch_split(self) -> tuple[int, ...]:
        """(pre, post) pairs per micro-batch, both at least 1; (pre, post, twin) with the twin
        subset on (twin_per_batch of the batch, the rest split by pre_fraction)."""
        n_twin = self.twin_per_batch if self.weight_twin > 0 else 0
        rest = self.per_device_batch_size - n_twin
        n_pre = min(max(1, round(rest * self.pre_fraction)), rest - 1)
        return (n_pre, rest - n_pre, n_twin) if n_twin else (n_pre, rest - n_pre)

    def schedule(self, n_pairs: int, world_size: int) -> "Schedule":
        """Steps, warm-up and epochs for `n_pairs` preference pairs on `world_size` ranks.
        Raises ConfigError when the schedule is above MAX_EPOCHS epochs and not forced."""
        global_batch = self.per_device_batch_size * world_size * self.gradient_accumulation_steps
        if n_pairs < 1:
            raise ConfigError("no preference pair to train on", key="data")
        if self.num_epochs is not None:
            steps = max(1, math.ceil(self.num_epochs * n_pairs / global_batch))
        else:
            steps = self.max_steps
        epochs = steps * global_batch / n_pairs
        # num_epochs was checked in validation; its last step may run into the next epoch
        if self.num_epochs is None and epochs > MAX_EPOCHS + 1e-9 and not self.allow_many_epochs:
            raise ConfigError(f"{steps} steps × {global_batch} pairs = {epochs:.1f} epochs of {n_pairs} pairs, "
                              f"above {MAX_EPOCHS}; lower max_steps, use num_epochs, or set "
                              f"allow_many_epochs: true", key="max_steps")
        warmup = self.warmup_steps if self.warmup_steps is not None else round(self.warmup_ratio * steps)
        return Schedule(n_pairs=n_pairs, global_batch=global_batch, steps=steps,
                        warmup_steps=min(warmup, steps - 1) if self.lr_scheduler != "constant" else warmup,
                        epochs=epochs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Schedule:
    n_pairs: int          # preference pairs in the cache (one epoch)
    global_batch: int     # pairs per optimizer step: per-device batch × ranks × accumulation
    steps: int
    warmup_steps: int
    epochs: float         # steps × global batch ÷ pairs

    def describe(self) -> str:
        return (f"schedule: {self.n_pairs} pairs, global batch {self.global_batch}, {self.steps} steps "
                f"= {self.epochs:.2f} epochs, warm-up {self.warmup_steps} steps")


def load_stage1_config(path: str | Path, overrides: dict | None = None) -> Stage1Config:
    """Read a YAML config (flat keys), apply `overrides`, validate. Errors name the file and key."""
    return load(Stage1Config, path, overrides, what="stage-1")
