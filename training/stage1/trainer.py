"""The BPPO trainer: a compact accelerate loop (load → preferences → reference log-probs →
optimise → checkpoint → final Hugging Face folder).

Why not a TRL `DPOTrainer` subclass: BPPO differs from DPO in three places that TRL 1.16 has no
hook for. (1) The loss weights two subsets per batch; `DPOTrainer._compute_loss` is a ~330-line
method that averages one `per_sequence_loss` per loss type with no per-example weight, so a
subclass would have to copy it whole. (2) Every batch must hold both subsets: that replaces the
trainer's sampler/dataloader (and its batch-skipping resume) as well. (3) Our prompts are rendered
and tokenised once by the shared prompt builder with the served chat template, which TRL's
`_prepare_dataset` would re-tokenise. What remains of Trainer (optimizer, schedule, accumulation,
FSDP, mixed precision, checkpoint state) is what accelerate gives directly, so the loop below
stays ~250 lines and every step is visible. `benchmarks/stage1_step.py` keeps its speed honest
against a plain `DPOTrainer` (and tests check the loss equals TRL's sigmoid DPO loss).

Run folder (`output_dir`): config.yaml, run.json (seeds, versions, data), preferences.jsonl +
preference_stats.json (cached: a resumed run never re-samples), ref_logps.pt (cached reference
log-probs), metrics.jsonl (one line per logged step), tb/ (TensorBoard), checkpoint-NNNNNN/
(accelerate state: model, optimizer, scheduler, RNG), final/ (a plain transformers folder; with
LoRA the merged model, plus final/adapter/).

    aftraj train stage1 --config configs/stage1/tiny-cpu.yaml --out runs/stage1-tiny
    accelerate launch --config_file configs/accelerate/fsdp-2xh200.yaml -m training.stage1 \
        --config configs/stage1/qwen2.5-7b-2xh200.yaml --data runs/corpus
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import re
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from aftraj.errors import UsageError
from training.stage1.config import Stage1Config
from training.stage1.data import (TokenizedPair, collate, load_training_trajectories, micro_batch_indices,
                                  tokenize_records)
from training.stage1.loss import bppo_loss, completion_logps
from training.stage1.pairs import boundary_prompts
from training.stage1.preferences import build_preferences, make_sampler

_CKPT = re.compile(r"^checkpoint-(\d+)$")
# settings a resumed run may change: they do not touch the data, the model or the optimisation
_RESUMABLE = frozenset({"output_dir", "logging_steps", "save_steps", "save_total_limit", "report_to",
                        "wandb_project"})


@dataclass
class RunResult:
    output_dir: Path
    last_step: int
    final_dir: Path | None
    history: list[dict] = field(default_factory=list)   # metrics logged by this invocation


# --------------------------------------------------------------------------- phases

def _load_model(cfg: Stage1Config, path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.dtype),
                                                 attn_implementation=cfg.attn_implementation)
    model.config.use_cache = False
    return model, tok


def _preferences(cfg, out: Path, model, tok, data: str, acc) -> tuple[list[dict], dict]:
    """Build (main process) or reuse the cached preference records."""
    rec_path, stats_path = out / "preferences.jsonl", out / "preference_stats.json"
    if acc.is_main_process and not rec_path.exists():
        trajs, src = load_training_trajectories(data, max_trajectories=cfg.max_trajectories,
                                                synthetic_n=cfg.synthetic_trajectories, seed=cfg.seed)
        count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        prompts, bstats = boundary_prompts(trajs, budget=cfg.max_prompt_tokens - 32, count_tokens=count)
        if not prompts:
            raise UsageError(f"{src}: no unsafe trajectory, so no boundary pair to train on")
        sampler = make_sampler(cfg, model.to(acc.device), tok)
        t0 = time.perf_counter()
        records, pstats = build_preferences(prompts, sampler, cfg.samples_per_prompt)
        stats = {"data": src, "boundary": vars(bstats), **pstats.to_dict(),
                 "sampling_seconds": round(time.perf_counter() - t0, 2)}
        tmp = rec_path.with_suffix(".partial")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        tmp.rename(rec_path)
        stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    acc.wait_for_everyone()
    records = [json.loads(line) for line in rec_path.read_text(encoding="utf-8").splitlines()]
    return records, json.loads(stats_path.read_text())


def _wrap_trainable(cfg: Stage1Config, model):
    if cfg.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                 lora_dropout=cfg.lora_dropout,
                                                 target_modules=cfg.lora_target_modules,
                                                 task_type="CAUSAL_LM"))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _optimizer(cfg: Stage1Config, model):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    if cfg.optimizer == "adamw_bnb_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, **kw)
    return torch.optim.AdamW(groups, **kw)


def _to(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def precompute_reference(model, pairs: list[TokenizedPair], pad_id: int, batch_size: int, acc) -> torch.Tensor:
    """(N, 2) reference log-probs (chosen, rejected) with the model as it is now (the base).
    Ranks score equal shards (FSDP needs every rank in every forward) and gather."""
    n, world, rank = len(pairs), acc.num_processes, acc.process_index
    per = math.ceil(n / world)
    order = list(range(n)) + [n - 1] * (per * world - n)
    mine = order[rank * per:(rank + 1) * per]
    was_training = model.training
    model.eval()
    out = []
    for s in range(0, len(mine), batch_size):
        chunk = [pairs[i] for i in mine[s:s + batch_size]]
        lp = completion_logps(model, _to(collate(chunk, pad_id), acc.device)).float()
        out.append(torch.stack(lp.chunk(2), dim=1))
    model.train(was_training)
    gathered = acc.gather(torch.cat(out)).cpu()
    ref = torch.empty(n, 2)
    ref[torch.tensor(order[:n])] = gathered[:n]
    return ref


def _latest_checkpoint(out: Path) -> tuple[int, Path] | None:
    found = [(int(m.group(1)), p) for p in out.glob("checkpoint-*") if (m := _CKPT.match(p.name))
             and (p / "trainer_state.json").exists()]
    return max(found) if found else None


def _flat_hparams(cfg: Stage1Config) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) else json.dumps(v)) for k, v in cfg.to_dict().items()}


def _versions() -> dict:
    import accelerate
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__,
         "transformers": transformers.__version__, "accelerate": accelerate.__version__}
    try:
        import peft
        v["peft"] = peft.__version__
    except ImportError:
        pass
    return v


# --------------------------------------------------------------------------- the loop

def train(cfg: Stage1Config, *, resume: bool = False, stop_at_step: int | None = None,
          progress: bool = True, on_step_end: Callable[[dict], None] | None = None) -> RunResult:
    """Run (or resume) stage 1 as configured. `stop_at_step` saves a checkpoint at that step and
    returns, as an interrupted run would (the schedule still spans `max_steps`). `on_step_end`
    gets each step's metrics row (the benchmark times steps with it)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    from training.models import resolve_model_spec

    out = Path(cfg.output_dir)
    if "wandb" in cfg.report_to:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ImportError("report_to holds 'wandb' but wandb is not installed (pip install wandb)") from None
    acc = Accelerator(mixed_precision=cfg.mixed_precision, log_with=cfg.report_to or None,
                      project_dir=str(out / "tb"))
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if world_env != acc.num_processes:
        raise RuntimeError(f"launched with WORLD_SIZE={world_env} but accelerate sees {acc.num_processes} "
                           f"process(es); on CPU set ACCELERATE_USE_CPU=1 (torchrun) so ranks form one group")
    if cfg.finetune == "lora" and acc.distributed_type == DistributedType.FSDP:
        raise ValueError("LoRA under FSDP is not supported by this trainer; use finetune: full with "
                         "FSDP, or LoRA on one device / DDP")
    latest = _latest_checkpoint(out) if out.exists() else None
    if out.exists() and any(out.glob("checkpoint-*")) and not resume:
        raise FileExistsError(f"{out} already holds checkpoints; pass --resume to continue the run, "
                              f"or choose another --out")
    if (not resume and (out / "config.yaml").exists()
            and yaml.safe_load((out / "config.yaml").read_text()) != cfg.to_dict()):
        raise FileExistsError(f"{out} holds a run with another config (see {out / 'config.yaml'}); "
                              f"choose another --out, or delete it")
    if resume and latest is not None and (out / "config.yaml").exists():
        was, now = yaml.safe_load((out / "config.yaml").read_text()), cfg.to_dict()
        changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k) and k not in _RESUMABLE)
        if changed:   # the cached preferences, reference log-probs and schedule belong to the old config
            raise UsageError(f"{out}: --resume with settings that differ from the run's "
                             f"{out / 'config.yaml'}: {', '.join(changed)}; resume with the same config")
    out.mkdir(parents=True, exist_ok=True)
    set_seed(cfg.seed)

    # --- run record
    if acc.is_main_process:
        if latest is None:
            (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        run_info = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
        run_info.setdefault("seeds", {"seed": cfg.seed, "python_random": cfg.seed, "numpy": cfg.seed,
                                      "torch": cfg.seed, "batch_schedule": cfg.seed,
                                      "sampling": cfg.seed})
        run_info.setdefault("started", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        run_info["versions"] = _versions()
        run_info["world_size"] = acc.num_processes
        run_info.setdefault("invocations", []).append(
            {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "resume_from_step": latest[0] if latest else 0})
        (out / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")

    # --- model and data
    model_path = resolve_model_spec(cfg.model)
    model, tok = _load_model(cfg, model_path)
    records, pref_stats = _preferences(cfg, out, model, tok, cfg.data, acc)
    pairs, tok_stats = tokenize_records(records, tok, max_prompt_tokens=cfg.max_prompt_tokens,
                                        max_completion_tokens=cfg.max_completion_tokens)
    pre = [p.index for p in pairs if p.is_pre]
    post = [p.index for p in pairs if not p.is_pre]
    pad_id = tok.pad_token_id
    ref_model = None
    if cfg.reference == "live" and cfg.finetune == "full":
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    model = _wrap_trainable(cfg, model)
    model.train()

    # The optimizer is built over the *prepared* model's parameters: FSDP1 (the production launch
    # config) replaces them with flat shards when it wraps the model, and accelerate does not remap
    # an optimizer built before (it does so for FSDP2 only).
    model = acc.prepare(model)
    if cfg.weight_decay > 0 and any(n.endswith("_flat_param") for n, _ in model.named_parameters()):
        raise ValueError("weight_decay > 0 under FSDP with flat parameters (fsdp_use_orig_params: false): "
                         "1-D flat shards cannot be split into decay / no-decay groups; set weight_decay: 0")
    optimizer = _optimizer(cfg, model)
    scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                              num_training_steps=cfg.max_steps)
    optimizer = acc.prepare(optimizer)
    if ref_model is not None:
        ref_model = acc.prepare_model(ref_model, evaluation_mode=True)
    acc.register_for_checkpointing(scheduler)

    ref_logps = None
    if cfg.reference == "precomputed":
        ref_path = out / "ref_logps.pt"
        if ref_path.exists():
            ref_logps = torch.load(ref_path)
        else:
            ref_logps = precompute_reference(model, pairs, pad_id, cfg.per_device_batch_size, acc)
            if acc.is_main_process:
                torch.save(ref_logps, ref_path)
        if ref_logps.shape != (len(pairs), 2):
            raise ValueError(f"{ref_path} holds {tuple(ref_logps.shape)} reference log-probs for "
                             f"{len(pairs)} pairs; it belongs to another run")

    # --- resume
    start = 1
    if resume and latest is not None:
        acc.load_state(str(latest[1] / "state"))
        start = latest[0] + 1
        if acc.is_main_process and (out / "metrics.jsonl").exists():
            kept = [ln for ln in (out / "metrics.jsonl").read_text().splitlines()
                    if json.loads(ln)["step"] <= latest[0]]
            (out / "metrics.jsonl").write_text("".join(ln + "\n" for ln in kept))
    if acc.is_main_process:
        (out / "data_stats.json").write_text(json.dumps({**tok_stats, "n_pre": len(pre), "n_post": len(post),
                                                         "preferences": pref_stats}, indent=2) + "\n")
    if cfg.report_to:
        acc.init_trackers(cfg.wandb_project or "stage1", config=_flat_hparams(cfg),
                          init_kwargs={"wandb": {"name": out.name, "dir": str(out)}})

    # --- optimise
    history: list[dict] = []
    bar = tqdm(total=cfg.max_steps, initial=start - 1, desc="stage1 BPPO", unit="step",
               disable=not (progress and acc.is_local_main_process))
    unwrapped = acc.unwrap_model(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    split, accum = cfg.batch_split, cfg.gradient_accumulation_steps
    cuda = torch.cuda.is_available()
    last = start - 1
    for step in range(start, cfg.max_steps + 1):
        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        n_tokens = 0
        for micro in range(accum):
            idx = micro_batch_indices(step=step, micro=micro, rank=acc.process_index,
                                      world=acc.num_processes, accum=accum, pre=pre, post=post,
                                      split=split, seed=cfg.seed)
            batch = _to(collate([pairs[i] for i in idx], pad_id, ref_logps), acc.device)
            n_tokens += int(batch["attention_mask"].sum())
            sync = nullcontext() if micro == accum - 1 else acc.no_sync(model)
            with sync:
                loss, metrics = _micro_step(cfg, model, unwrapped, ref_model, batch)
                acc.backward(loss / accum)
            for k, v in {"loss": loss.detach(), **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(acc.reduce(v.detach().float().reshape(()), "mean")) / accum
        grad_norm = (acc.clip_grad_norm_(trainable, cfg.max_grad_norm) if cfg.max_grad_norm
                     else torch.zeros(()))
        lr = scheduler.get_last_lr()[0]      # the rate this step used
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        row = {"step": step, **{k: round(v, 8) for k, v in sums.items()},
               "grad_norm": float(grad_norm), "lr": lr, "step_seconds": dt,
               "tokens": n_tokens}
        if cuda:
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        history.append(row)
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            if acc.is_main_process:
                with (out / "metrics.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
            acc.log({k: v for k, v in row.items() if k != "step"}, step=step)
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.4f}")
        last = step
        if on_step_end is not None:
            on_step_end(row)
        if step % cfg.save_steps == 0 or step == cfg.max_steps or step == stop_at_step:
            _save_checkpoint(acc, out, step, cfg.save_total_limit)
        if step == stop_at_step:
            break
    bar.close()

    final = None
    if last == cfg.max_steps:
        final = _save_final(cfg, acc, model, tok, out / "final")
    acc.end_training()
    return RunResult(out, last, final, history)


def _micro_step(cfg: Stage1Config, model, unwrapped, ref_model, batch: dict):
    need_tokens = cfg.nll_coef > 0
    res = completion_logps(model, batch, return_per_token=need_tokens)
    logps, per_token = res if need_tokens else (res, None)
    chosen, rejected = logps.chunk(2)
    if cfg.reference == "precomputed":
        ref_c, ref_r = batch["ref_chosen"], batch["ref_rejected"]
    else:
        with torch.no_grad():
            if ref_model is not None:
                ref = completion_logps(ref_model, batch)
            else:  # LoRA: the base is the model with its adapter switched off
                with unwrapped.disable_adapter():
                    ref = completion_logps(model, batch)
        ref_c, ref_r = ref.chunk(2)
    kw = {}
    if need_tokens:
        kw = dict(chosen_token_logps=per_token.chunk(2)[0], chosen_mask=batch["completion_mask"].chunk(2)[0],
                  nll_coef=cfg.nll_coef)
    return bppo_loss(chosen, rejected, ref_c, ref_r, batch["is_pre"], beta=cfg.beta,
                     weight_pre=cfg.weight_pre, weight_post=cfg.weight_post, **kw)


def _save_checkpoint(acc, out: Path, step: int, limit: int | None) -> None:
    ckpt = out / f"checkpoint-{step:06d}"
    acc.save_state(str(ckpt / "state"))
    if acc.is_main_process:
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}) + "\n")
        if limit is not None:
            found = sorted((int(m.group(1)), p) for p in out.glob("checkpoint-*")
                           if (m := _CKPT.match(p.name)))
            for _, p in found[:-limit]:
                shutil.rmtree(p, ignore_errors=True)
    acc.wait_for_everyone()


def _save_final(cfg: Stage1Config, acc, model, tok, final: Path) -> Path:
    """A folder `AutoModelForCausalLM.from_pretrained(final)` loads (LoRA: merged weights)."""
    state = acc.get_state_dict(model)
    unwrapped = acc.unwrap_model(model)
    if acc.is_main_process:
        final.mkdir(parents=True, exist_ok=True)
        if cfg.finetune == "lora":
            unwrapped.save_pretrained(final / "adapter")
            tok.save_pretrained(final / "adapter")
            merged = unwrapped.merge_and_unload()
            merged.save_pretrained(final, safe_serialization=True)
        else:
            unwrapped.save_pretrained(final, state_dict=state, safe_serialization=True)
        tok.save_pretrained(final)
        cfg_final = json.loads((final / "config.json").read_text())
        cfg_final["use_cache"] = True
        (final / "config.json").write_text(json.dumps(cfg_final, indent=2) + "\n")
    acc.wait_for_everyone()
    return final
