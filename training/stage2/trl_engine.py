"""Stage 2 on one machine (CPU or one GPU): TRL's `GRPOTrainer` with our reward.

What we take from TRL 1.16 unchanged: group sampling (`num_generations` completions per
prompt, `max_completion_length`), group-normalised advantages, the clipped policy loss, the KL
term to a frozen reference (`beta`; the reference is the `--init` stage-1 model: TRL rebuilds it
from the policy's own folder, or, with LoRA, disables the adapter), checkpoints with optimizer
and RNG state (`checkpoint-N/`, `--resume`), TensorBoard (`runs/` in the run folder) and the
progress bar. What is ours: the prompts (`training.stage2.data`, the shared prompt builder), the
reward (`training.reward.compute_score` plus DAPO's soft overlong penalty, the formula verl's
`dapo` reward manager applies), the run record, and a final plain transformers folder that
`aftraj eval --auditor hf --model OUT/final` loads (LoRA: merged weights, adapter in final/adapter).

Run folder: config.yaml, run.json (seeds, versions, init model), data/ (records.jsonl, the verl
parquet files, the `datasets` dataset trl/, stats.json; built once, reused on --resume), metrics.jsonl (one line per logged
step: reward, its components, kl, loss, ...), runs/ (TensorBoard), checkpoint-N/, final/.

    aftraj train stage2 --engine trl --config configs/stage2/tiny-cpu.yaml --out runs/stage2-tiny
    aftraj train stage2 --engine trl --config configs/stage2/smollm2-135m-cpu.yaml \
        --init runs/stage1-smollm2/final --out runs/stage2-smollm2
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from training.common import export_folder, library_versions, load_tokenizer, lora_config
from training.reward import COMPONENTS, RewardConfig, compute_score, overlong_penalty
from training.stage2.config import Stage2Config
from training.stage2.data import DATA_SOURCE, build_stage2_data

_CKPT = re.compile(r"^checkpoint-(\d+)$")
# settings a resumed run may change: they touch neither data, model nor optimisation
_RESUMABLE = frozenset({"output_dir", "logging_steps", "save_steps", "save_total_limit", "report_to",
                        "max_steps"})


@dataclass
class RunResult:
    output_dir: Path
    last_step: int
    final_dir: Path | None
    history: list[dict] = field(default_factory=list)


# --------------------------------------------------------------------------- reward for TRL

def make_reward_func(rcfg: RewardConfig, max_completion_length: int):
    """TRL reward function: `compute_score` per completion plus DAPO's overlong penalty on its
    token count; logs the mean of each component (reward/format, …) through TRL's `log_metric`."""
    kw = rcfg.score_kwargs()

    def aftraj_reward(prompts, completions, completion_ids, ground_truth, t, agents, log_metric=None, **_):
        scores, parts, penalties = [], {c: [] for c in COMPONENTS}, []
        for text, ids, gt, tt, ag in zip(completions, completion_ids, ground_truth, t, agents, strict=True):
            if isinstance(text, list):              # conversational: [{"role": "assistant", ...}]
                text = text[-1]["content"] if text else ""
            r = compute_score(DATA_SOURCE, text, gt, {"t": tt, "agents": ag}, **kw)
            pen = overlong_penalty(len(ids), max_completion_length, rcfg.overlong_buffer_len,
                                   rcfg.overlong_penalty_factor)
            scores.append(r["score"] + pen)
            penalties.append(pen)
            for c in COMPONENTS:
                parts[c].append(r[c])
        if log_metric is not None:
            for c in COMPONENTS:
                log_metric(f"reward/{c}", sum(parts[c]) / len(parts[c]))
            log_metric("reward/overlong_penalty", sum(penalties) / len(penalties))
        return scores

    return aftraj_reward


# --------------------------------------------------------------------------- phases

def _latest_checkpoint(out: Path) -> tuple[int, Path] | None:
    found = sorted((int(m.group(1)), p) for p in out.glob("checkpoint-*") if (m := _CKPT.match(p.name)))
    return found[-1] if found else None


def _check_run_folder(cfg: Stage2Config, out: Path, resume: bool) -> None:
    latest = _latest_checkpoint(out) if out.exists() else None
    if latest and not resume:
        raise FileExistsError(f"{out} already holds checkpoints; pass --resume to continue the run, "
                              f"or choose another --out")
    if resume and latest is None:
        raise FileNotFoundError(f"{out}: --resume needs a checkpoint-N folder there; none found")
    cfg_path = out / "config.yaml"
    if cfg_path.exists():
        was, now = yaml.safe_load(cfg_path.read_text()), cfg.to_dict()
        changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k) and k not in _RESUMABLE)
        if changed:
            raise ValueError(f"{out}: settings differ from the run's {cfg_path}: {', '.join(changed)}; "
                             f"use the same config, or another --out")


def _versions() -> dict:
    return library_versions("trl")


def grpo_args(cfg: Stage2Config, out: Path, *, progress: bool):
    """TRL's GRPOConfig from ours (one place for the mapping)."""
    from trl import GRPOConfig

    # a step's completions (prompts_per_step x G, times gradient_accumulation_steps) are generated
    # at once; `micro_batch_size` of them go through each forward/backward (TRL accumulates)
    group = cfg.prompts_per_step * cfg.num_generations
    micro = cfg.micro_batch_size or group
    accumulate = cfg.gradient_accumulation_steps * (group // micro)
    return GRPOConfig(
        output_dir=str(out), seed=cfg.seed, data_seed=cfg.seed, max_steps=cfg.max_steps,
        logging_steps=cfg.logging_steps, save_strategy="steps", save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit, report_to=list(cfg.report_to) or "none",
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulate,
        steps_per_generation=accumulate,
        num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature, top_p=cfg.top_p, beta=cfg.beta, epsilon=cfg.epsilon,
        loss_type=cfg.loss_type, learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
        optim="adamw_bnb_8bit" if cfg.optimizer == "adamw_bnb_8bit" else "adamw_torch",
        lr_scheduler_type=cfg.lr_scheduler, warmup_steps=cfg.warmup_steps,
        max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm is not None else 0.0,
        bf16=cfg.bf16, gradient_checkpointing=cfg.gradient_checkpointing,
        model_init_kwargs={"dtype": cfg.dtype, "attn_implementation": cfg.attn_implementation},
        disable_tqdm=not progress, shuffle_dataset=True, log_completions=False,
        remove_unused_columns=False)


def _peft_config(cfg: Stage2Config):
    if cfg.finetune != "lora":
        return None
    return lora_config(cfg)


def _metrics_callback(path: Path):
    """A TrainerCallback appending each logged step (reward, components, kl, loss, ...) to metrics.jsonl."""
    from transformers import TrainerCallback

    class MetricsFile(TrainerCallback):
        def __init__(self):
            self.rows: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or not state.is_world_process_zero or "loss" not in logs:
                return
            row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            self.rows.append(row)
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    return MetricsFile()


def train(cfg: Stage2Config, *, resume: bool = False, progress: bool = True) -> RunResult:
    """Run (or resume) stage 2 with TRL as configured."""
    from datasets import load_from_disk
    from trl import GRPOTrainer

    from aftraj.models import resolve_model_spec

    out = Path(cfg.output_dir)
    _check_run_folder(cfg, out, resume)
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_spec(cfg.model)
    if not (out / "config.yaml").exists():
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    latest = _latest_checkpoint(out)
    run_info = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    run_info.setdefault("seeds", {"seed": cfg.seed, "data": cfg.seed, "sampling": cfg.seed})
    run_info.setdefault("init_model", str(model_path))
    run_info["versions"] = _versions()
    run_info.setdefault("invocations", []).append(
        {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "resume_from_step": latest[0] if latest else 0})
    (out / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")

    tok = load_tokenizer(model_path)
    build_stage2_data(cfg, tok, out / "data")
    dataset = load_from_disk(str(out / "data" / "trl"))

    metrics = _metrics_callback(out / "metrics.jsonl")
    trainer = GRPOTrainer(model=str(model_path), reward_funcs=[make_reward_func(cfg.reward, cfg.max_completion_length)],
                          args=grpo_args(cfg, out, progress=progress), train_dataset=dataset,
                          processing_class=tok, peft_config=_peft_config(cfg), callbacks=[metrics])
    trainer.train(resume_from_checkpoint=str(latest[1]) if resume and latest else None)
    final = _save_final(cfg, trainer, tok, out / "final")
    return RunResult(out, trainer.state.global_step, final, metrics.rows)


def _save_final(cfg: Stage2Config, trainer, tok, final: Path) -> Path:
    """A folder `AutoModelForCausalLM.from_pretrained(final)` loads (LoRA: merged weights)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return export_folder(model, tok, final, lora=cfg.finetune == "lora")
