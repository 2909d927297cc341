"""The BPPO trainer in two phases. Phase 1, `sample_preferences` (training/stage1/preferences.py;
one process, never a process group): boundary prompts → base-policy samples (in-process
`generate` on a GPU, or an OpenAI-compatible endpoint such as vLLM) → the preference cache.
Phase 2, `train` (one process, or `accelerate launch` with FSDP, which only reads the cache),
written as its steps, torchtune style: `_check_launch` → `_setup_accelerator` →
`_write_run_record` → `_setup_data` → `_setup_model` → `_reference_logps` → `_restore` (a resume)
→ `_train_step` per step, with checkpoints → `_finish` (final Hugging Face folder, model cards).
Model loading, LoRA, the Accelerator and the export are every stage's (training/common.py).

Why not a TRL `DPOTrainer` subclass: BPPO differs from DPO in three places that TRL 1.16 has no
hook for. (1) The loss weights two subsets per batch; `DPOTrainer._compute_loss` is a ~330-line
method that averages one `per_sequence_loss` per loss type with no per-example weight, so a
subclass would have to copy it whole. (2) Every batch must hold both subsets: that replaces the
trainer's sampler/dataloader (and its batch-skipping resume) as well. (3) Our prompts are rendered
and tokenised once by the shared prompt builder with the served chat template, which TRL's
`_prepare_dataset` would re-tokenise. What remains of Trainer (schedule, accumulation, FSDP,
mixed precision, checkpoint state) is what accelerate gives directly, so the loop below stays
short and every step is visible. `benchmarks/stage1_step.py` keeps its speed honest against a
plain `DPOTrainer` (and tests check the loss equals TRL's sigmoid DPO loss).

Production details (issue 12): the FSDP mixed-precision policy is explicit (parameters bf16,
reductions and buffers fp32; rotary `inv_freq` is asserted fp32 after `prepare` and after the
first forward); the optimizer is saved and restored per rank (8-bit AdamW round-trips; checksums
compared); the schedule is sized from the cached pairs (`num_epochs`); under FSDP gradients stay
sharded between micro-steps; the process-group timeout is set.

Run folder (`output_dir`): config.yaml, run.json (seeds, versions, schedule, per-invocation
checks), preferences.jsonl + preference_stats.json (the phase-1 cache: training never re-samples),
ref_logps.pt (cached reference log-probs), metrics.jsonl (one line per logged step, with its
epoch), tb/ (TensorBoard), checkpoint-NNNNNN/ (state/: accelerate's model, scheduler and RNG
state, plus optimizer_rank<R>.pt per rank; trainer_state.json with the optimizer checksums),
final/ (a plain transformers folder in `export_dtype`; with LoRA the merged model, plus
final/adapter/).

    aftraj train stage1 --config configs/stage1/tiny-cpu.yaml --out runs/stage1-tiny
    aftraj train stage1 --phase preferences --config configs/stage1/qwen2.5-7b-2xh200.yaml --data runs/corpus
    accelerate launch --config_file configs/accelerate/fsdp-2xh200.yaml -m training.stage1 --phase train \
        --config configs/stage1/qwen2.5-7b-2xh200.yaml --data runs/corpus
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from aftraj.scoring import SharedPrompts, pair_features, pair_token_logps, release_freed_memory, top_layers_only
from training.common import (launched_distributed, library_versions, load_model, load_tokenizer, make_accelerator,
                             save_final, wrap_trainable)
from training.stage1.config import Stage1Config
from training.stage1.data import TokenizedPair, collate, micro_batch_indices, tokenize_records
from training.stage1.loss import bppo_loss, completion_logps, sequence_logps
from training.stage1.preferences import sample_preferences
from training.stage1.run_folder import CKPT, cache_paths, check_run_folder, latest_checkpoint, read_preferences, record

# the feature capture gives the heap's free pages back every this many pairs (`release_freed_memory`)
TRIM_EVERY = 8


def nbytes(features) -> int:
    """Bytes held by the frozen-layer feature cache (a list of each pair's tensors)."""
    return sum(t.numel() * t.element_size() for pair in features for t in pair)


@dataclass
class RunResult:
    output_dir: Path
    last_step: int
    final_dir: Path | None
    history: list[dict] = field(default_factory=list)   # metrics logged by this invocation


# --------------------------------------------------------------------------- FSDP, precision, optimizer state

def rotary_buffer_dtypes(model) -> dict[str, str]:
    """{buffer name: dtype} of every rotary-frequency buffer (`...inv_freq`)."""
    return {n: str(b.dtype).removeprefix("torch.") for n, b in model.named_buffers() if n.endswith("inv_freq")}


def assert_rotary_fp32(model, when: str) -> dict[str, str]:
    found = rotary_buffer_dtypes(model)
    bad = {n: d for n, d in found.items() if d != "float32"}
    if bad:
        raise RuntimeError(f"rotary buffers are not float32 {when}: {bad}; RoPE phases drift at long "
                           f"positions (the FSDP mixed-precision policy must keep buffer_dtype float32)")
    return found


def _process_group_timeout_s(acc) -> float | None:
    """The default process group's collective timeout, as torch holds it (None: no group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device(acc.device.type))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def _grad_sync(acc, model, last_micro: bool):
    """The gradient-sync context of one micro-step. DDP: `no_sync` on all but the last (one
    all-reduce a step). FSDP1: never `no_sync`, which would keep every rank's *unsharded* bf16
    gradients (+2 bytes × all parameters, ≈ 14 GiB a GPU for 7B) and accumulate them in bf16;
    instead each micro-step reduce-scatters (in float32) and the float32 gradient shard
    accumulates. The cost is one reduce-scatter per micro-step, small beside an 8k-token
    forward/backward on NVLink."""
    from accelerate.utils import DistributedType

    if last_micro or acc.distributed_type == DistributedType.FSDP:
        return nullcontext()
    return acc.no_sync(model)


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
def precompute_reference(model, pairs: list[TokenizedPair], pad_id: int, batch_size: int, acc, *,
                         margin_tokens: int | None = None, per_pair: bool = False,
                         features_below: int | None = None, features: list | None = None) -> torch.Tensor:
    """(N, 2) reference log-probs (chosen, rejected) with the model as it is now (the base), summed
    as the loss sums them (`margin_tokens`). Ranks score equal shards (FSDP needs every rank in
    every forward) and gather. `per_pair`: one unpadded forward per pair (`pair_token_logps`).
    `features_below` (per_pair, one process): also append each pair's input of the top
    `features_below` layers to `features` (`aftraj.scoring.pair_features`)."""
    n, world, rank = len(pairs), acc.num_processes, acc.process_index
    per = math.ceil(n / world)
    order = list(range(n)) + [n - 1] * (per * world - n)
    mine = order[rank * per:(rank + 1) * per]
    was_training = model.training
    model.eval()
    out = []
    # the accelerator's autocast (bf16 under mixed_precision bf16): the reference and the features
    # come from the same precision as the steps' forwards, and the capture of an unwrapped model
    # (feature_cache) is not left in float32, slower than bf16 on a CPU that computes bf16 natively
    if per_pair:
        # feature_cache (one process): a run's pairs (pre, post, twin) come in turn, and each prompt
        # runs from where it leaves the last; the wrapped model (FSDP, DDP) runs each whole
        shared = SharedPrompts(acc.unwrap_model(model)) if features_below else None
        for i in mine:
            comps = [pairs[i].chosen_ids, pairs[i].rejected_ids]
            with acc.autocast():
                if features_below:
                    feats, (c, r) = pair_features(acc.unwrap_model(model), pairs[i].prompt_ids, comps, features_below,
                                                  shared=shared)
                    features.append(tuple(f.float() for f in feats))
                    if len(features) % TRIM_EVERY == 0:
                        release_freed_memory()
                else:
                    c, r = pair_token_logps(model, pairs[i].prompt_ids, comps)
            lim = slice(0, margin_tokens)
            out.append(torch.stack([c[lim].sum(), r[lim].sum()]).float()[None].to(acc.device))
    else:
        for s in range(0, len(mine), batch_size):
            chunk = [pairs[i] for i in mine[s:s + batch_size]]
            batch = _to(collate(chunk, pad_id), acc.device)
            _, tok = completion_logps(model, batch, return_per_token=True)
            lp = sequence_logps(tok, batch["completion_mask"], margin_tokens).float()
            out.append(torch.stack(lp.chunk(2), dim=1))
    model.train(was_training)
    gathered = acc.gather(torch.cat(out)).cpu()
    ref = torch.empty(n, 2)
    ref[torch.tensor(order[:n])] = gathered[:n]
    return ref


def optimizer_checksum(optimizer) -> list[float]:
    """This rank's optimizer state as [tensors, sum, sum of |x|] (float64, parameter order): equal
    before a save and after the load, or the state did not round-trip."""
    n, total, total_abs = 0, 0.0, 0.0
    for group in optimizer.param_groups:
        for p in group["params"]:
            for _, v in sorted(optimizer.state.get(p, {}).items()):
                if torch.is_tensor(v):
                    t = v.detach().double()
                    n += 1
                    total += float(t.sum())
                    total_abs += float(t.abs().sum())
                elif isinstance(v, (int, float)):
                    total += float(v)
    return [float(n), total, total_abs]


def _param_shapes(optimizer) -> list[list[int]]:
    return [list(p.shape) for g in optimizer.param_groups for p in g["params"]]


def _gather_checksums(acc, checksum: list[float]) -> list[list[float]]:
    t = torch.tensor([checksum], dtype=torch.float64, device=acc.device)
    return acc.gather(t).cpu().tolist()


def _save_optimizer(acc, optimizer, state_dir: Path) -> list[float]:
    """Each rank saves its own optimizer state (its flat FSDP shards' moments, 8-bit or not) with
    `optimizer.state_dict()`: no FSDP optimizer-state conversion, which takes bitsandbytes' nested
    quantisation state for replicated and keeps one rank's (issue 12). Resuming needs the same
    world size and wrapping, which `_load_optimizer` checks."""
    checksum = optimizer_checksum(optimizer)
    torch.save({"state_dict": optimizer.state_dict(), "checksum": checksum, "world_size": acc.num_processes,
                "shapes": _param_shapes(optimizer)}, state_dir / f"optimizer_rank{acc.process_index}.pt")
    return checksum


def _load_optimizer(acc, optimizer, state_dir: Path) -> list[float]:
    path = state_dir / f"optimizer_rank{acc.process_index}.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path}: the checkpoint holds no optimizer state for rank {acc.process_index}; "
                                f"resuming without it would restart Adam's moments")
    saved = torch.load(path, map_location=acc.device, weights_only=False)
    if saved["world_size"] != acc.num_processes or saved["shapes"] != _param_shapes(optimizer):
        raise ValueError(f"{path}: saved by {saved['world_size']} rank(s) over other parameter shards; "
                         f"resume with the launch config of the run ({acc.num_processes} rank(s) now)")
    if saved["checksum"][0] == 0:
        raise ValueError(f"{path}: holds an empty optimizer state; a resume would restore nothing")
    optimizer.load_state_dict(saved["state_dict"])
    got = optimizer_checksum(optimizer)
    if got != saved["checksum"]:
        raise RuntimeError(f"{path}: optimizer state checksum after load {got} differs from the saved "
                           f"{saved['checksum']}: the state did not round-trip")
    return got


def _flat_hparams(cfg: Stage1Config) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) else json.dumps(v)) for k, v in cfg.to_dict().items()}


def _versions() -> dict:
    return library_versions("accelerate", "peft")


# --------------------------------------------------------------------------- the phases of train()

@dataclass
class _Data:
    """The training phase's data: the tokenised cached pairs and their schedule."""

    pairs: list[TokenizedPair]
    pre: list[int]
    post: list[int]
    twin: list[int]
    sched: object            # Stage1Config.schedule(...)
    tok_stats: dict
    pref_stats: dict


@dataclass
class _Model:
    """The prepared policy, its reference (a frozen copy for a live full fine-tune, else None),
    optimizer and schedule."""

    model: object
    ref_model: object | None
    optimizer: object
    scheduler: object
    rotary: dict


def _check_launch(cfg: Stage1Config, out: Path, *, resume: bool, phase: str, progress: bool):
    """The run folder fits this run; the preference cache is there (phase "all" in one process
    samples it first). Returns the latest complete checkpoint (or None)."""
    if "wandb" in cfg.report_to and importlib.util.find_spec("wandb") is None:
        raise ImportError("report_to holds 'wandb' but wandb is not installed (pip install wandb)")
    latest = latest_checkpoint(out) if out.exists() else None
    check_run_folder(cfg, out, resume=resume, latest=latest)
    rec_path, _ = cache_paths(out)
    if not rec_path.exists():
        if phase == "train" or launched_distributed():
            raise FileNotFoundError(f"{rec_path}: no cached preferences, and the training launch never samples; "
                                    f"run the preferences phase first, in one process: aftraj train stage1 "
                                    f"--phase preferences --config CFG --out {out}")
        sample_preferences(cfg, progress)
    return latest


def _setup_accelerator(cfg: Stage1Config, out: Path):
    """The Accelerator (`training.common.make_accelerator`) and whether it runs FSDP; seeds set."""
    from accelerate.utils import DistributedType, set_seed

    if not cfg.sdpa_math_kernel and torch.cuda.is_available():
        torch.backends.cuda.enable_math_sdp(False)   # a fallback to the O(n²)-memory kernel fails loudly
    acc = make_accelerator(cfg, out)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if world_env != acc.num_processes:
        raise RuntimeError(f"launched with WORLD_SIZE={world_env} but accelerate sees {acc.num_processes} "
                           f"process(es); on CPU set ACCELERATE_USE_CPU=1 (torchrun) so ranks form one group")
    fsdp = acc.distributed_type == DistributedType.FSDP
    if cfg.finetune == "lora" and fsdp:
        raise ValueError("LoRA under FSDP is not supported by this trainer; use finetune: full with "
                         "FSDP, or LoRA on one device / DDP")
    out.mkdir(parents=True, exist_ok=True)
    set_seed(cfg.seed)
    return acc, fsdp


def _write_run_record(cfg: Stage1Config, acc, out: Path, latest) -> None:
    """config.yaml (a new run) and run.json: seeds, versions, world size, this invocation."""
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
             "resume_from_step": latest[0] if latest else 0,
             "process_group_timeout_s": _process_group_timeout_s(acc)})
        (out / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")
    acc.wait_for_everyone()


def _setup_data(cfg: Stage1Config, acc, out: Path, tok) -> _Data:
    """The preference cache tokenised (this phase never samples) and the schedule sized from it."""
    records, pref_stats = read_preferences(out)
    pairs, tok_stats = tokenize_records(records, tok, max_prompt_tokens=cfg.max_prompt_tokens,
                                        max_completion_tokens=cfg.max_completion_tokens)
    sched = cfg.schedule(len(pairs), acc.num_processes)
    if acc.is_main_process:
        print(sched.describe(), flush=True)
    record(acc, out, schedule=vars(sched))
    return _Data(pairs, pre=[p.index for p in pairs if p.subset == "pre"],
                 post=[p.index for p in pairs if p.subset == "post"],
                 twin=[p.index for p in pairs if p.subset == "twin"],
                 sched=sched, tok_stats=tok_stats, pref_stats=pref_stats)


def _setup_model(cfg: Stage1Config, acc, model, sched) -> _Model:
    """Reference copy, trainable wrapping, `prepare`, optimizer and LR schedule."""
    from transformers import get_scheduler

    ref_model = None
    if cfg.reference == "live" and cfg.finetune == "full":
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    model = wrap_trainable(cfg, model)
    model.train()

    # The optimizer is built over the *prepared* model's parameters: FSDP1 (the production launch
    # config) replaces them with flat shards when it wraps the model, and accelerate does not remap
    # an optimizer built before (it does so for FSDP2 only). It is not handed to accelerate: its
    # state is saved and restored per rank by _save_optimizer / _load_optimizer.
    model = acc.prepare(model)
    rotary = {"after_prepare": assert_rotary_fp32(model, "after prepare")}
    if cfg.weight_decay > 0 and any(n.endswith("_flat_param") for n, _ in model.named_parameters()):
        raise ValueError("weight_decay > 0 under FSDP with flat parameters (fsdp_use_orig_params: false): "
                         "1-D flat shards cannot be split into decay / no-decay groups; set weight_decay: 0")
    optimizer = _optimizer(cfg, model)
    scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=sched.warmup_steps,
                              num_training_steps=sched.steps)
    if ref_model is not None:
        ref_model = acc.prepare_model(ref_model, evaluation_mode=True)
    acc.register_for_checkpointing(scheduler)
    return _Model(model, ref_model, optimizer, scheduler, rotary)


def _reference_logps(cfg: Stage1Config, acc, out: Path, m: _Model, data: _Data, pad_id: int):
    """`reference: precomputed`: the base's log-probs of every pair (ref_logps.pt, kept); else None.
    With `feature_cache` also the frozen layers' features, one pass for both (kept in RAM only; a
    resume computes them again: they depend on the frozen layers alone); else None."""
    if cfg.reference != "precomputed":
        return None, None
    ref_path = out / "ref_logps.pt"
    features = None
    if cfg.feature_cache:
        if acc.num_processes > 1:
            raise ValueError("feature_cache: true runs in one process (the features are not sharded)")
        t0, features = time.perf_counter(), []
        fresh = precompute_reference(m.model, data.pairs, pad_id, cfg.per_device_batch_size, acc,
                                     margin_tokens=cfg.margin_tokens, per_pair=True,
                                     features_below=cfg.trainable_layers, features=features)
        record(acc, out, feature_cache={"pairs": len(features), "bytes": nbytes(features),
                                        "seconds": round(time.perf_counter() - t0, 1)})
    if ref_path.exists():
        ref_logps = torch.load(ref_path)
    else:
        ref_logps = fresh if cfg.feature_cache else precompute_reference(
            m.model, data.pairs, pad_id, cfg.per_device_batch_size, acc, margin_tokens=cfg.margin_tokens,
            per_pair=cfg.batching == "per_pair")
        if acc.is_main_process:
            torch.save(ref_logps, ref_path)
    if ref_logps.shape != (len(data.pairs), 2):
        raise ValueError(f"{ref_path} holds {tuple(ref_logps.shape)} reference log-probs for "
                         f"{len(data.pairs)} pairs; it belongs to another run")
    return ref_logps, features


def _restore(acc, optimizer, out: Path, latest) -> int:
    """Load the latest checkpoint's state (model, scheduler, RNG, this rank's optimizer) and cut
    metrics.jsonl back to it; returns the first step to run."""
    state_dir = latest[1] / "state"
    acc.load_state(str(state_dir))
    restored = _gather_checksums(acc, _load_optimizer(acc, optimizer, state_dir))
    record(acc, out, optimizer_checksum_restored=restored)
    if acc.is_main_process and (out / "metrics.jsonl").exists():
        kept = [ln for ln in (out / "metrics.jsonl").read_text().splitlines()
                if json.loads(ln)["step"] <= latest[0]]
        (out / "metrics.jsonl").write_text("".join(ln + "\n" for ln in kept))
    return latest[0] + 1


def _start_logging(cfg: Stage1Config, acc, out: Path, data: _Data) -> None:
    """data_stats.json and the trackers (TensorBoard / wandb) when asked."""
    if acc.is_main_process:
        (out / "data_stats.json").write_text(json.dumps({**data.tok_stats, "n_pre": len(data.pre),
                                                         "n_post": len(data.post), "n_twin": len(data.twin),
                                                         "schedule": vars(data.sched),
                                                         "preferences": data.pref_stats},
                                                        indent=2) + "\n")
    if cfg.report_to:
        acc.init_trackers(cfg.wandb_project or "stage1", config=_flat_hparams(cfg),
                          init_kwargs={"wandb": {"name": out.name, "dir": str(out)}})


def _train_step(cfg: Stage1Config, acc, out: Path, m: _Model, data: _Data, step: int, *, start: int,
                unwrapped, trainable: list, pad_id: int, ref_logps, fsdp: bool, features=None) -> dict:
    """One optimizer step over `gradient_accumulation_steps` micro-batches; its metrics row."""
    t0 = time.perf_counter()
    split, accum = cfg.batch_split, cfg.gradient_accumulation_steps
    model, pairs = m.model, data.pairs
    sums: dict[str, float] = {}
    n_tokens = 0
    for micro in range(accum):
        idx = micro_batch_indices(step=step, micro=micro, rank=acc.process_index,
                                  world=acc.num_processes, accum=accum, pre=data.pre, post=data.post,
                                  split=split, seed=cfg.seed, twin=data.twin)
        batch = _to(collate([pairs[i] for i in idx], pad_id, ref_logps), acc.device)
        n_tokens += int(batch["attention_mask"].sum())
        with _grad_sync(acc, model, micro == accum - 1):
            if cfg.batching == "per_pair":
                loss, metrics = _per_pair_step(cfg, model, unwrapped, m.ref_model, [pairs[i] for i in idx],
                                               batch, lambda x: acc.backward(x / accum),
                                               features=None if features is None else [features[i] for i in idx])
            else:
                loss, metrics = _micro_step(cfg, model, unwrapped, m.ref_model, batch)
                acc.backward(loss / accum)
        if step == start and micro == 0:
            m.rotary["after_forward"] = assert_rotary_fp32(model, "after the first forward")
            if accum > 1:   # the gradient each rank holds between micro-steps (FSDP: its shard)
                record(acc, out, rotary_buffer_dtypes=m.rotary, accumulation={
                    "no_sync": not (fsdp or acc.num_processes == 1),
                    "grad_numel_after_first_micro": sum(p.grad.numel() for p in trainable
                                                        if p.grad is not None),
                    "local_param_numel": sum(p.numel() for p in trainable)})
            else:
                record(acc, out, rotary_buffer_dtypes=m.rotary)
        for k, v in {"loss": loss.detach(), **metrics}.items():
            sums[k] = sums.get(k, 0.0) + float(acc.reduce(v.detach().float().reshape(()), "mean")) / accum
    grad_norm = (acc.clip_grad_norm_(trainable, cfg.max_grad_norm) if cfg.max_grad_norm
                 else torch.zeros(()))
    lr = m.scheduler.get_last_lr()[0]      # the rate this step used
    m.optimizer.step()
    m.scheduler.step()
    m.optimizer.zero_grad(set_to_none=True)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    row = {"step": step, "epoch": round(step * data.sched.global_batch / data.sched.n_pairs, 4),
           **{k: round(v, 8) for k, v in sums.items()},
           "grad_norm": float(grad_norm), "lr": lr, "step_seconds": dt,
           "micro_step_seconds": dt / accum, "tokens": n_tokens}
    if cuda:
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2 ** 30
    return row


def _finish(cfg: Stage1Config, acc, out: Path, model, tok, *, last: int, total: int, model_path) -> Path | None:
    """The final folder (when the schedule ran to its end) and the model cards."""
    final = None
    if last == total:
        final = save_final(cfg, acc, model, tok, out / "final")
    if acc.is_main_process and last:   # model cards (training/model_card.py)
        from training.model_card import write_model_card

        for folder in [p for p in (final, out / f"checkpoint-{last:06d}") if p is not None and p.exists()]:
            write_model_card(folder, stage="stage 1 (BPPO)", base_model=str(cfg.model),
                             base_model_path=model_path, data=str(cfg.data), config=cfg.to_dict(),
                             steps=last)
    acc.end_training()
    return final


# --------------------------------------------------------------------------- the loop

def train(cfg: Stage1Config, *, resume: bool = False, stop_at_step: int | None = None,
          progress: bool = True, on_step_end: Callable[[dict], None] | None = None,
          phase: str = "all") -> RunResult:
    """Run (or resume) stage 1 as configured. Phase "train" (and any multi-process launch) only
    reads the run folder's preference cache, and fails without it; phase "all" in one process
    runs `sample_preferences` first when the cache is missing. `stop_at_step` saves a checkpoint
    at that step and returns, as an interrupted run would (the schedule is unchanged).
    `on_step_end` gets each step's metrics row (the benchmark times steps with it)."""
    from tqdm.auto import tqdm

    from aftraj.models import resolve_model_spec

    out = Path(cfg.output_dir)
    latest = _check_launch(cfg, out, resume=resume, phase=phase, progress=progress)
    acc, fsdp = _setup_accelerator(cfg, out)

    # --- run record
    _write_run_record(cfg, acc, out, latest)

    # --- model and data (the preference cache only: this phase never samples)
    model_path = resolve_model_spec(cfg.model)
    tok = load_tokenizer(model_path)
    model = load_model(cfg, model_path)
    data = _setup_data(cfg, acc, out, tok)
    total, pad_id = data.sched.steps, tok.pad_token_id
    m = _setup_model(cfg, acc, model, data.sched)
    ref_logps, features = _reference_logps(cfg, acc, out, m, data, pad_id)

    # --- resume
    start = _restore(acc, m.optimizer, out, latest) if resume else 1
    _start_logging(cfg, acc, out, data)

    # --- optimise
    history: list[dict] = []
    bar = tqdm(total=total, initial=start - 1, desc="stage1 BPPO", unit="step",
               disable=not (progress and acc.is_local_main_process))
    unwrapped = acc.unwrap_model(m.model)
    trainable = [p for p in m.model.parameters() if p.requires_grad]
    last = start - 1
    for step in range(start, total + 1):
        row = _train_step(cfg, acc, out, m, data, step, start=start, unwrapped=unwrapped, trainable=trainable,
                          pad_id=pad_id, ref_logps=ref_logps, fsdp=fsdp, features=features)
        history.append(row)
        if step % cfg.logging_steps == 0 or step == total:
            if acc.is_main_process:
                with (out / "metrics.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
            acc.log({k: v for k, v in row.items() if k != "step"}, step=step)
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.4f}", epoch=f"{row['epoch']:.2f}")
        last = step
        if on_step_end is not None:
            on_step_end(row)
        if step % cfg.save_steps == 0 or step == total or step == stop_at_step:
            _save_checkpoint(acc, m.optimizer, out, step, cfg.save_total_limit)
            if cfg.finetune == "lora":
                _save_adapter(acc, m.model, tok, out / f"checkpoint-{step:06d}" / "adapter")
        if step == stop_at_step:
            break
    bar.close()

    final = _finish(cfg, acc, out, m.model, tok, last=last, total=total, model_path=model_path)
    return RunResult(out, last, final, history)


def _loss_kwargs(cfg: Stage1Config, batch: dict, tok_c: torch.Tensor) -> dict:
    """The loss's subset, NLL and decision-token arguments for per-token chosen log-probs `tok_c`."""
    n = tok_c.shape[0]
    kw = dict(beta=cfg.beta, weight_pre=cfg.weight_pre, weight_post=cfg.weight_post,
              is_twin=batch["is_twin"], weight_twin=cfg.weight_twin)
    if cfg.nll_coef > 0:
        kw.update(chosen_token_logps=tok_c, chosen_mask=batch["completion_mask"][:n], nll_coef=cfg.nll_coef)
    if cfg.decision_coef > 0:
        at = batch["decision_at"]
        has = at >= 0
        kw.update(decision_logps=tok_c.gather(1, at.clamp(min=0)[:, None])[:, 0], has_decision=has,
                  decision_coef=cfg.decision_coef, decision_balance=cfg.decision_balance)
    return kw


def _reference(cfg: Stage1Config, model, unwrapped, ref_model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.reference == "precomputed":
        return batch["ref_chosen"], batch["ref_rejected"]
    with torch.no_grad():
        if ref_model is not None:
            _, tok = completion_logps(ref_model, batch, return_per_token=True)
        else:  # LoRA: the base is the model with its adapter switched off
            with unwrapped.disable_adapter():
                _, tok = completion_logps(model, batch, return_per_token=True)
    return sequence_logps(tok, batch["completion_mask"], cfg.margin_tokens).chunk(2)


def _micro_step(cfg: Stage1Config, model, unwrapped, ref_model, batch: dict):
    _, per_token = completion_logps(model, batch, return_per_token=True)
    chosen, rejected = sequence_logps(per_token, batch["completion_mask"], cfg.margin_tokens).chunk(2)
    ref_c, ref_r = _reference(cfg, model, unwrapped, ref_model, batch)
    return bppo_loss(chosen, rejected, ref_c, ref_r, batch["is_pre"],
                     **_loss_kwargs(cfg, batch, per_token.chunk(2)[0]))


def _per_pair_step(cfg: Stage1Config, model, unwrapped, ref_model, pairs: list[TokenizedPair], batch: dict,
                   backward: Callable[[torch.Tensor], None], features: list | None = None):
    """The micro-batch's loss with one unpadded forward and backward per pair (no padding mask;
    `pair_token_logps`). The loss is a sum of per-pair terms with fixed normalisers (subset sizes,
    token and decision counts of the micro-batch), so the gradient of the whole is the sum of the
    gradients of each pair's row with the others held constant: each pair is back-propagated alone
    and freed before the next (peak memory of one pair). Returns the loss and metrics computed on
    the detached rows, equal to the padded path's (tests/training/test_stage1_loss.py).
    `features`: each pair's frozen-layer features; the forward runs the top layers only."""
    width = batch["completion_ids"].shape[1]
    n = len(pairs)
    ref_c, ref_r = _reference(cfg, model, unwrapped, ref_model, batch)

    def padded(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[0])) for r in rows])

    done_c, done_r = [None] * n, [None] * n
    zero = torch.zeros(width, device=batch["completion_ids"].device)
    mask = batch["completion_mask"]
    for i, p in enumerate(pairs):
        if features is None:
            c, r = pair_token_logps(model, p.prompt_ids, [p.chosen_ids, p.rejected_ids])
        else:
            with top_layers_only(unwrapped, cfg.trainable_layers):
                c, r = pair_token_logps(model, p.prompt_ids, [p.chosen_ids, p.rejected_ids], embeds=features[i])
        rows_c = [c if j == i else (done_c[j] if done_c[j] is not None else zero)[: width] for j in range(n)]
        rows_r = [r if j == i else (done_r[j] if done_r[j] is not None else zero)[: width] for j in range(n)]
        tok_c, tok_r = padded(rows_c), padded(rows_r)
        lc = sequence_logps(tok_c, mask[:n], cfg.margin_tokens)
        lr = sequence_logps(tok_r, mask[n:], cfg.margin_tokens)
        loss_i, _ = bppo_loss(lc, lr, ref_c, ref_r, batch["is_pre"], **_loss_kwargs(cfg, batch, tok_c))
        backward(loss_i)
        done_c[i], done_r[i] = c.detach(), r.detach()
    tok_c, tok_r = padded(done_c), padded(done_r)
    return bppo_loss(sequence_logps(tok_c, mask[:n], cfg.margin_tokens),
                     sequence_logps(tok_r, mask[n:], cfg.margin_tokens), ref_c, ref_r, batch["is_pre"],
                     **_loss_kwargs(cfg, batch, tok_c))


def _save_checkpoint(acc, optimizer, out: Path, step: int, limit: int | None) -> None:
    """accelerate's state (model: FSDP sharded state dict; scheduler; RNG) plus each rank's
    optimizer state; trainer_state.json (written last) marks the checkpoint complete and holds
    every rank's optimizer checksum."""
    ckpt = out / f"checkpoint-{step:06d}"
    acc.save_state(str(ckpt / "state"))
    acc.wait_for_everyone()                 # the state folder exists on every rank
    checksums = _gather_checksums(acc, _save_optimizer(acc, optimizer, ckpt / "state"))
    acc.wait_for_everyone()
    if acc.is_main_process:
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step, "optimizer_checksum": checksums})
                                                 + "\n")
        if limit is not None:
            found = sorted((int(m.group(1)), p) for p in out.glob("checkpoint-*")
                           if (m := CKPT.match(p.name)))
            for _, p in found[:-limit]:
                shutil.rmtree(p, ignore_errors=True)
    acc.wait_for_everyone()


def _save_adapter(acc, model, tok, dest: Path) -> None:
    """A LoRA run's adapter at this checkpoint (+ tokenizer): `aftraj eval --auditor hf --model
    CKPT/adapter` loads it on its base, so a checkpoint can be chosen on the validation split
    (eval/ablation.py) without merging mid-run (merging would change the model being trained)."""
    state = acc.get_state_dict(model)
    if acc.is_main_process:
        acc.unwrap_model(model).save_pretrained(dest, state_dict=state)
        tok.save_pretrained(dest)
    acc.wait_for_everyone()
