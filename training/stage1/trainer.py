"""The BPPO trainer in two phases. Phase 1, `sample_preferences` (one process, never a process
group): boundary prompts → base-policy samples (in-process `generate` on a GPU, or an
OpenAI-compatible endpoint such as vLLM) → the preference cache. Phase 2, `train` (one process,
or `accelerate launch` with FSDP, which only reads the cache): reference log-probs → optimise →
checkpoint → final Hugging Face folder.

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
from datetime import timedelta
from pathlib import Path

import torch
import yaml

from aftraj.errors import UsageError
from aftraj.tokens import prompt_budget
from training.stage1.config import Stage1Config, resolve_mixed_precision
from training.stage1.data import (TokenizedPair, collate, load_training_trajectories, micro_batch_indices,
                                  tokenize_records)
from training.stage1.loss import bppo_loss, completion_logps, pair_token_logps, sequence_logps
from training.stage1.pairs import boundary_prompts
from training.stage1.preferences import build_preferences, cap_pairs, make_sampler

_CKPT = re.compile(r"^checkpoint-(\d+)$")
# settings a resumed run may change: they do not touch the data, the model or the optimisation
_RESUMABLE = frozenset({"output_dir", "logging_steps", "save_steps", "save_total_limit", "report_to",
                        "wandb_project", "process_group_timeout_minutes", "sdpa_math_kernel", "export_dtype"})


@dataclass
class RunResult:
    output_dir: Path
    last_step: int
    final_dir: Path | None
    history: list[dict] = field(default_factory=list)   # metrics logged by this invocation


# --------------------------------------------------------------------------- phase 1: preferences

def _load_model(cfg: Stage1Config, path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.dtype),
                                                 attn_implementation=cfg.attn_implementation)
    model.config.use_cache = False
    return model


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _cache_paths(out: Path) -> tuple[Path, Path]:
    return out / "preferences.jsonl", out / "preference_stats.json"


def _launched_distributed() -> bool:
    """True inside `accelerate launch` / `torchrun` with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def sample_preferences(cfg: Stage1Config, progress: bool = True) -> dict:
    """Phase 1, one process and never a process group: sample the base policy on every boundary
    prompt and cache `preferences.jsonl` + `preference_stats.json` in the run folder (kept if
    there). The model is loaded (and moved to the GPU) only for in-process `hf` sampling; an
    `openai` endpoint (vLLM) needs the tokenizer alone. Returns the stats.

        aftraj train stage1 --phase preferences --config CFG --out DIR
    """
    import torch.distributed as dist

    from training.models import resolve_model_spec

    if _launched_distributed() or dist.is_initialized():
        raise UsageError(f"the preferences phase runs in one process (WORLD_SIZE="
                           f"{os.environ.get('WORLD_SIZE')}): run `aftraj train stage1 --phase preferences` "
                           f"without accelerate launch / torchrun, then launch --phase train")
    out = Path(cfg.output_dir)
    rec_path, stats_path = _cache_paths(out)
    if rec_path.exists() and stats_path.exists():
        return json.loads(stats_path.read_text())
    _check_run_folder(cfg, out, resume=False, latest=None)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "config.yaml").exists():
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    model_path = resolve_model_spec(cfg.model)
    tok = _load_tokenizer(model_path)
    trajs, src = load_training_trajectories(cfg.data, max_trajectories=cfg.max_trajectories,
                                            synthetic_n=cfg.synthetic_trajectories, seed=cfg.seed)
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    prompts, bstats = boundary_prompts(trajs, budget=prompt_budget(cfg.max_prompt_tokens), count_tokens=count,
                                       twins=cfg.weight_twin > 0, max_post_tokens=cfg.max_post_tokens)
    if not prompts:
        raise UsageError(f"{src}: no unsafe trajectory, so no boundary pair to train on")
    n_all = len({p.traj_id for p in prompts})
    prompts = cap_pairs(prompts, cfg.max_pairs, cfg.seed)   # sample only what is trained on
    model = None
    if cfg.samples_per_prompt > 0 and cfg.sampler == "hf":
        model = _load_model(cfg, model_path)
        if torch.cuda.is_available():          # only in-process generation needs the weights on a GPU
            model = model.to("cuda")
    sampler = make_sampler(cfg, model, tok)
    t0 = time.perf_counter()
    records, pstats = build_preferences(prompts, sampler, cfg.samples_per_prompt, progress=progress,
                                       rejected_parse_failures=cfg.rejected_parse_failures)
    stats = {"data": src, "boundary": vars(bstats), **pstats.to_dict(),
             "pairs": {"available": n_all, "used": len({p.traj_id for p in prompts}),
                       "max_pairs": cfg.max_pairs},
             "sampling_seconds": round(time.perf_counter() - t0, 2)}
    tmp = rec_path.with_suffix(".partial")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tmp.rename(rec_path)
    stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    del model, sampler
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return stats


def _read_preferences(out: Path) -> tuple[list[dict], dict]:
    rec_path, stats_path = _cache_paths(out)
    records = [json.loads(line) for line in rec_path.read_text(encoding="utf-8").splitlines()]
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    return records, stats


def _check_run_folder(cfg: Stage1Config, out: Path, *, resume: bool, latest) -> None:
    """The run folder holds this config's run (or nothing); --resume needs a checkpoint."""
    if resume and latest is None:
        raise FileNotFoundError(f"--resume: {out} holds no complete checkpoint-*; a resume that restores "
                                f"nothing would silently restart the run")
    if out.exists() and any(out.glob("checkpoint-*")) and not resume:
        raise FileExistsError(f"{out} already holds checkpoints; pass --resume to continue the run, "
                              f"or choose another --out")
    if not (out / "config.yaml").exists():
        return
    was, now = yaml.safe_load((out / "config.yaml").read_text()), cfg.to_dict()
    if not resume and was != now and not (latest is None and _same_but_resumable(was, now)):
        raise FileExistsError(f"{out} holds a run with another config (see {out / 'config.yaml'}); "
                              f"choose another --out, or delete it")
    if resume:
        changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k) and k not in _RESUMABLE)
        if changed:   # the cached preferences, reference log-probs and schedule belong to the old config
            raise UsageError(f"{out}: --resume with settings that differ from the run's "
                             f"{out / 'config.yaml'}: {', '.join(changed)}; resume with the same config")


def _same_but_resumable(was: dict, now: dict) -> bool:
    return all(was.get(k) == now.get(k) or k in _RESUMABLE for k in set(was) | set(now))


# --------------------------------------------------------------------------- phase 2: FSDP / precision

def fsdp_mixed_precision(cfg: Stage1Config):
    """FSDP1's policy, explicit: parameters in the compute dtype, gradient reductions and buffers
    in float32. accelerate's own bf16 policy casts buffers too, and Qwen2's rotary `inv_freq` in
    bf16 puts RoPE phases off by up to 9.5 rad at position 8,192 (issue 12)."""
    from torch.distributed.fsdp import MixedPrecision

    compute = torch.bfloat16 if resolve_mixed_precision(cfg.mixed_precision) == "bf16" else torch.float32
    return MixedPrecision(param_dtype=compute, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


def make_accelerator(cfg: Stage1Config, out: Path):
    """The Accelerator: explicit process-group timeout, and under `accelerate launch` with FSDP the
    launch config's plugin (read from the environment) with `fsdp_mixed_precision`."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from training.accelerate_config import fsdp_plugin

    kw = {}
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":   # the rank's device first
        kw["fsdp_plugin"] = fsdp_plugin(mixed_precision_policy=fsdp_mixed_precision(cfg))
    pg = InitProcessGroupKwargs(timeout=timedelta(minutes=cfg.process_group_timeout_minutes))
    if not _launched_distributed():
        # accelerate keeps one AcceleratorState per process and refuses a second Accelerator with
        # another precision: a second run in the same process (warm-up then stage 1, a notebook,
        # the tests) would fail. One process, no process group: nothing to lose by starting anew.
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()
    return Accelerator(mixed_precision=resolve_mixed_precision(cfg.mixed_precision), log_with=cfg.report_to or None,
                       project_dir=str(out / "tb"), kwargs_handlers=[pg], **kw)


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


def freeze_below(model, n_layers: int) -> int:
    """Train only the top `n_layers` decoder layers and the final norm; returns the trainable
    parameter count. Frozen lower layers run forward without autograd, so their backward (most of
    a step's cost on a CPU) is never computed."""
    inner = getattr(model, "model", None)
    layers, norm = getattr(inner, "layers", None), getattr(inner, "norm", None)
    if layers is None or norm is None:
        raise ValueError(f"trainable_layers needs a decoder with model.layers and model.norm; "
                         f"{type(model).__name__} has none")
    if n_layers > len(layers):
        raise ValueError(f"trainable_layers={n_layers}, but the model has {len(layers)} decoder layers")
    model.requires_grad_(False)
    for mod in (*layers[len(layers) - n_layers:], norm):
        mod.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _wrap_trainable(cfg: Stage1Config, model):
    if cfg.finetune == "full" and getattr(cfg, "trainable_layers", None):
        freeze_below(model, cfg.trainable_layers)
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
def precompute_reference(model, pairs: list[TokenizedPair], pad_id: int, batch_size: int, acc, *,
                         margin_tokens: int | None = None, per_pair: bool = False) -> torch.Tensor:
    """(N, 2) reference log-probs (chosen, rejected) with the model as it is now (the base), summed
    as the loss sums them (`margin_tokens`). Ranks score equal shards (FSDP needs every rank in
    every forward) and gather. `per_pair`: one unpadded forward per pair (`pair_token_logps`)."""
    n, world, rank = len(pairs), acc.num_processes, acc.process_index
    per = math.ceil(n / world)
    order = list(range(n)) + [n - 1] * (per * world - n)
    mine = order[rank * per:(rank + 1) * per]
    was_training = model.training
    model.eval()
    out = []
    if per_pair:
        for i in mine:
            c, r = pair_token_logps(model, pairs[i].prompt_ids, [pairs[i].chosen_ids, pairs[i].rejected_ids])
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


def _latest_checkpoint(out: Path) -> tuple[int, Path] | None:
    found = [(int(m.group(1)), p) for p in out.glob("checkpoint-*") if (m := _CKPT.match(p.name))
             and (p / "trainer_state.json").exists()]
    return max(found) if found else None


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


def _record(acc, out: Path, **fields) -> None:
    """Add fields to this invocation's entry in run.json (main process)."""
    if acc.is_main_process:
        info = json.loads((out / "run.json").read_text())
        info["invocations"][-1].update(fields)
        (out / "run.json").write_text(json.dumps(info, indent=2) + "\n")


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
          progress: bool = True, on_step_end: Callable[[dict], None] | None = None,
          phase: str = "all") -> RunResult:
    """Run (or resume) stage 1 as configured. Phase "train" (and any multi-process launch) only
    reads the run folder's preference cache, and fails without it; phase "all" in one process
    runs `sample_preferences` first when the cache is missing. `stop_at_step` saves a checkpoint
    at that step and returns, as an interrupted run would (the schedule is unchanged).
    `on_step_end` gets each step's metrics row (the benchmark times steps with it)."""
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
    latest = _latest_checkpoint(out) if out.exists() else None
    _check_run_folder(cfg, out, resume=resume, latest=latest)
    rec_path, _ = _cache_paths(out)
    if not rec_path.exists():
        if phase == "train" or _launched_distributed():
            raise FileNotFoundError(f"{rec_path}: no cached preferences, and the training launch never samples; "
                                    f"run the preferences phase first, in one process: aftraj train stage1 "
                                    f"--phase preferences --config CFG --out {out}")
        sample_preferences(cfg, progress)
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
             "resume_from_step": latest[0] if latest else 0,
             "process_group_timeout_s": _process_group_timeout_s(acc)})
        (out / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")
    acc.wait_for_everyone()

    # --- model and data (the preference cache only: this phase never samples)
    model_path = resolve_model_spec(cfg.model)
    tok = _load_tokenizer(model_path)
    model = _load_model(cfg, model_path)
    records, pref_stats = _read_preferences(out)
    pairs, tok_stats = tokenize_records(records, tok, max_prompt_tokens=cfg.max_prompt_tokens,
                                        max_completion_tokens=cfg.max_completion_tokens)
    sched = cfg.schedule(len(pairs), acc.num_processes)
    total = sched.steps
    if acc.is_main_process:
        print(sched.describe(), flush=True)
    _record(acc, out, schedule=vars(sched))
    pre = [p.index for p in pairs if p.subset == "pre"]
    post = [p.index for p in pairs if p.subset == "post"]
    twin = [p.index for p in pairs if p.subset == "twin"]
    pad_id = tok.pad_token_id
    ref_model = None
    if cfg.reference == "live" and cfg.finetune == "full":
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    model = _wrap_trainable(cfg, model)
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
                              num_training_steps=total)
    if ref_model is not None:
        ref_model = acc.prepare_model(ref_model, evaluation_mode=True)
    acc.register_for_checkpointing(scheduler)

    ref_logps = None
    if cfg.reference == "precomputed":
        ref_path = out / "ref_logps.pt"
        if ref_path.exists():
            ref_logps = torch.load(ref_path)
        else:
            ref_logps = precompute_reference(model, pairs, pad_id, cfg.per_device_batch_size, acc,
                                             margin_tokens=cfg.margin_tokens,
                                             per_pair=cfg.batching == "per_pair")
            if acc.is_main_process:
                torch.save(ref_logps, ref_path)
        if ref_logps.shape != (len(pairs), 2):
            raise ValueError(f"{ref_path} holds {tuple(ref_logps.shape)} reference log-probs for "
                             f"{len(pairs)} pairs; it belongs to another run")

    # --- resume
    start = 1
    if resume:
        state_dir = latest[1] / "state"
        acc.load_state(str(state_dir))
        restored = _gather_checksums(acc, _load_optimizer(acc, optimizer, state_dir))
        _record(acc, out, optimizer_checksum_restored=restored)
        start = latest[0] + 1
        if acc.is_main_process and (out / "metrics.jsonl").exists():
            kept = [ln for ln in (out / "metrics.jsonl").read_text().splitlines()
                    if json.loads(ln)["step"] <= latest[0]]
            (out / "metrics.jsonl").write_text("".join(ln + "\n" for ln in kept))
    if acc.is_main_process:
        (out / "data_stats.json").write_text(json.dumps({**tok_stats, "n_pre": len(pre), "n_post": len(post),
                                                         "n_twin": len(twin),
                                                         "schedule": vars(sched), "preferences": pref_stats},
                                                        indent=2) + "\n")
    if cfg.report_to:
        acc.init_trackers(cfg.wandb_project or "stage1", config=_flat_hparams(cfg),
                          init_kwargs={"wandb": {"name": out.name, "dir": str(out)}})

    # --- optimise
    history: list[dict] = []
    bar = tqdm(total=total, initial=start - 1, desc="stage1 BPPO", unit="step",
               disable=not (progress and acc.is_local_main_process))
    unwrapped = acc.unwrap_model(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    split, accum = cfg.batch_split, cfg.gradient_accumulation_steps
    cuda = torch.cuda.is_available()
    last = start - 1
    for step in range(start, total + 1):
        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        n_tokens = 0
        for micro in range(accum):
            idx = micro_batch_indices(step=step, micro=micro, rank=acc.process_index,
                                      world=acc.num_processes, accum=accum, pre=pre, post=post,
                                      split=split, seed=cfg.seed, twin=twin)
            batch = _to(collate([pairs[i] for i in idx], pad_id, ref_logps), acc.device)
            n_tokens += int(batch["attention_mask"].sum())
            with _grad_sync(acc, model, micro == accum - 1):
                if cfg.batching == "per_pair":
                    loss, metrics = _per_pair_step(cfg, model, unwrapped, ref_model, [pairs[i] for i in idx],
                                                   batch, lambda x: acc.backward(x / accum))
                else:
                    loss, metrics = _micro_step(cfg, model, unwrapped, ref_model, batch)
                    acc.backward(loss / accum)
            if step == start and micro == 0:
                rotary["after_forward"] = assert_rotary_fp32(model, "after the first forward")
                if accum > 1:   # the gradient each rank holds between micro-steps (FSDP: its shard)
                    _record(acc, out, rotary_buffer_dtypes=rotary, accumulation={
                        "no_sync": not (fsdp or acc.num_processes == 1),
                        "grad_numel_after_first_micro": sum(p.grad.numel() for p in trainable
                                                            if p.grad is not None),
                        "local_param_numel": sum(p.numel() for p in trainable)})
                else:
                    _record(acc, out, rotary_buffer_dtypes=rotary)
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
        row = {"step": step, "epoch": round(step * sched.global_batch / sched.n_pairs, 4),
               **{k: round(v, 8) for k, v in sums.items()},
               "grad_norm": float(grad_norm), "lr": lr, "step_seconds": dt,
               "micro_step_seconds": dt / accum, "tokens": n_tokens}
        if cuda:
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2 ** 30
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
            _save_checkpoint(acc, optimizer, out, step, cfg.save_total_limit)
            if cfg.finetune == "lora":
                _save_adapter(acc, model, tok, out / f"checkpoint-{step:06d}" / "adapter")
        if step == stop_at_step:
            break
    bar.close()

    final = None
    if last == total:
        final = _save_final(cfg, acc, model, tok, out / "final")
    if acc.is_main_process and last:   # model cards (training/model_card.py)
        from training.model_card import write_model_card

        for folder in [p for p in (final, out / f"checkpoint-{last:06d}") if p is not None and p.exists()]:
            write_model_card(folder, stage="stage 1 (BPPO)", base_model=str(cfg.model),
                             base_model_path=model_path, data=str(cfg.data), config=cfg.to_dict(),
                             steps=last)
    acc.end_training()
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
                   backward: Callable[[torch.Tensor], None]):
    """The micro-batch's loss with one unpadded forward and backward per pair (no padding mask;
    `pair_token_logps`). The loss is a sum of per-pair terms with fixed normalisers (subset sizes,
    token and decision counts of the micro-batch), so the gradient of the whole is the sum of the
    gradients of each pair's row with the others held constant: each pair is back-propagated alone
    and freed before the next (peak memory of one pair). Returns the loss and metrics computed on
    the detached rows, equal to the padded path's (tests/training/test_stage1_loss.py)."""
    width = batch["completion_ids"].shape[1]
    n = len(pairs)
    ref_c, ref_r = _reference(cfg, model, unwrapped, ref_model, batch)

    def padded(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[0])) for r in rows])

    done_c, done_r = [None] * n, [None] * n
    zero = torch.zeros(width, device=batch["completion_ids"].device)
    mask = batch["completion_mask"]
    for i, p in enumerate(pairs):
        c, r = pair_token_logps(model, p.prompt_ids, [p.chosen_ids, p.rejected_ids])
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
                           if (m := _CKPT.match(p.name)))
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


def _save_final(cfg: Stage1Config, acc, model, tok, final: Path) -> Path:
    """A folder `AutoModelForCausalLM.from_pretrained(final)` loads (LoRA: merged weights)."""
    dtype = getattr(torch, cfg.export_dtype)
    state = acc.get_state_dict(model)
    unwrapped = acc.unwrap_model(model)
    if acc.is_main_process:
        final.mkdir(parents=True, exist_ok=True)
        if cfg.finetune == "lora":
            unwrapped.save_pretrained(final / "adapter")
            tok.save_pretrained(final / "adapter")
            merged = unwrapped.merge_and_unload().to(dtype)
            merged.save_pretrained(final, safe_serialization=True)
        else:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            unwrapped.save_pretrained(final, state_dict=state, safe_serialization=True)
        tok.save_pretrained(final)
        cfg_final = json.loads((final / "config.json").read_text())
        cfg_final["use_cache"] = True
        for key in ("dtype", "torch_dtype"):     # transformers 5 writes `dtype`, 4.x `torch_dtype`
            if key in cfg_final:
                cfg_final[key] = cfg.export_dtype
        (final / "config.json").write_text(json.dumps(cfg_final, indent=2) + "\n")
    acc.wait_for_everyone()
    return final
