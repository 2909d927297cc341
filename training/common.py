"""What every training stage shares (stage 1, stage 2, the warm-up): where training trajectories
come from, model and tokenizer loading, LoRA wrapping (and freezing below the top layers), the
accelerate set-up, the final-folder export, the library versions a run records.

- `load_training_trajectories(spec)`: a corpus folder (train.jsonl if present, else
  corpus.jsonl), a JSONL file, or `builtin:synthetic` (seeded hand-made unsafe runs with known
  k*, a*, for the CPU demo until a corpus is built), read with `aftraj.readers`. Records whose
  `meta.split` is val or test (corpus.jsonl holds every split) are left out, and counted; runs
  imported by an adapter (no gold label) and Who&When are refused (`aftraj.boundary`).
- `load_model` / `load_tokenizer` / `wrap_trainable` / `make_accelerator` / `save_final`: a
  config with the model fields (`dtype`, `attn_implementation`, `finetune`, the LoRA fields,
  `gradient_checkpointing`, `mixed_precision`, `export_dtype`) is all they read.

    from training.common import load_training_trajectories
    trajs, src = load_training_trajectories("builtin:synthetic", synthetic_n=8)
"""

from __future__ import annotations

import json
import os
import platform
import random
from datetime import timedelta
from pathlib import Path

from aftraj.boundary import refuse_unlabeled
from aftraj.readers import load_trajectories
from aftraj.schema import Label, Step, Trajectory

# --------------------------------------------------------------------------- trajectories


def resolve_data_path(spec: str | Path) -> Path:
    """A corpus folder (train.jsonl, else corpus.jsonl) or a JSONL file."""
    p = Path(spec).expanduser()
    if p.is_dir():
        for name in ("train.jsonl", "corpus.jsonl"):
            if (p / name).is_file():
                return p / name
        raise FileNotFoundError(f"{p}: a corpus folder needs train.jsonl or corpus.jsonl")
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such data file or corpus folder")
    return p


def load_training_trajectories(spec: str, *, max_trajectories: int | None = None,
                               synthetic_n: int = 24, seed: int = 0) -> tuple[list[Trajectory], str]:
    """(trajectories, description of the source). Refuses runs imported by an adapter (placeholder
    label, meta.unlabeled), naming the first: their SAFE is not gold."""
    if spec == "builtin:synthetic":
        trajs, src = synthetic_trajectories(synthetic_n, seed=seed), f"builtin:synthetic(n={synthetic_n}, seed={seed})"
    else:
        path = resolve_data_path(spec)
        trajs, src = load_trajectories(path, "jsonl"), str(path)
        held_out = [t for t in trajs if t.meta.get("split") in ("val", "test")]
        if held_out:   # corpus.jsonl holds every split: train on the train families only
            trajs = [t for t in trajs if t.meta.get("split") not in ("val", "test")]
            src += f" (excluded {len(held_out)} val/test trajectories by meta.split)"
    refuse_unlabeled(trajs, src)
    if max_trajectories is not None:
        trajs = trajs[:max_trajectories]
    return trajs, src


_SLIPS = ("computation slip", "verdict misread", "wrong entity", "premature termination")


def synthetic_trajectories(n: int, *, seed: int = 0) -> list[Trajectory]:
    """Seeded MathSolver+Verifier runs; every fourth one is safe, the rest unsafe with a known
    k* and a* (k* = 0 for one in eight unsafe runs, to exercise that case)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(2, 9)
        truth = (a + b) * c
        task = f"Compute ({a} + {b}) * {c}. Answer with the number only."
        n_steps = rng.randint(4, 7)
        safe = i % 4 == 3
        k = None if safe else (0 if i % 8 == 0 else rng.randint(1, n_steps - 2))
        steps = []
        for j in range(n_steps):
            agent = ("user" if j == 0 else ("MathSolver" if j % 2 else "Verifier"))
            if j == 0:
                content = task
            elif k is not None and j >= k:
                wrong = truth + rng.choice((-10, -1, 1, 10)) * c
                content = (f"{a} + {b} = {a + b + (1 if j == k else 0)}; times {c} gives {wrong}."
                           if agent == "MathSolver" else f"I agree that the result is {wrong}.")
            else:
                content = (f"First {a} + {b} = {a + b}." if agent == "MathSolver"
                           else f"Checked: {a} + {b} = {a + b}, correct so far.")
            kind = "final_answer" if j == n_steps - 1 else "message"
            steps.append(Step(index=j, agent=agent, kind=kind, content=content))
        if k == 0:  # the request itself is corrupted: it asks for the wrong operation
            steps[0] = Step(index=0, agent="user", kind="message",
                            content=task.replace(f"* {c}", f"- {c}"))
        # the generator's name is kept as written before the move (training.stage1.data), so
        # synthetic runs stay byte for byte what earlier runs trained on
        label = (Label(verdict="SAFE", label_source="verified_safe") if safe else
                 Label(verdict="UNSAFE", label_source="injected", decisive_step=k,
                       decisive_agent=steps[k].agent,
                       reason=f"{rng.choice(_SLIPS)} at step {k}: the sum or product is wrong.",
                       provenance={"generator": "training.stage1.data.synthetic_trajectories"}))
        out.append(Trajectory(id=f"synthetic-{seed}-{i}", family_id=f"synthetic-{seed}-{i}",
                              domain="math", source="synthetic-stage1", task=task, steps=steps,
                              label=label, final_answer=steps[-1].content,
                              outcome="success" if safe else "failure", reference_answer=str(truth)))
    return out


# --------------------------------------------------------------------------- model and tokenizer

def load_model(cfg, path: str | Path):
    """The causal LM of `path` (a local folder or `builtin:NAME`: `aftraj.models.load_model`, the
    one loader the auditors use too) in `cfg.dtype` with `cfg.attn_implementation`, KV cache off."""
    from aftraj.models import load_model as load_local_model

    model = load_local_model(path, dtype=cfg.dtype, attn_implementation=cfg.attn_implementation)
    model.config.use_cache = False
    return model


def load_tokenizer(path: Path):
    """The tokenizer at `path`, its pad token the EOS token when it has none."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def lora_config(cfg):
    """peft's LoraConfig from the config's LoRA fields."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM")


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


def wrap_trainable(cfg, model):
    """Freeze below `trainable_layers` (full fine-tune), or add the LoRA adapter; gradient
    checkpointing when asked."""
    if cfg.finetune == "full" and getattr(cfg, "trainable_layers", None):
        freeze_below(model, cfg.trainable_layers)
    if cfg.finetune == "lora":
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(cfg))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


# --------------------------------------------------------------------------- accelerate

def launched_distributed() -> bool:
    """True inside `accelerate launch` / `torchrun` with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def fsdp_mixed_precision(cfg):
    """FSDP1's policy, explicit: parameters in the compute dtype, gradient reductions and buffers
    in float32. accelerate's own bf16 policy casts buffers too, and Qwen2's rotary `inv_freq` in
    bf16 puts RoPE phases off by up to 9.5 rad at position 8,192 (issue 12)."""
    import torch
    from torch.distributed.fsdp import MixedPrecision

    from aftraj.scoring import resolve_mixed_precision

    compute = torch.bfloat16 if resolve_mixed_precision(cfg.mixed_precision) == "bf16" else torch.float32
    return MixedPrecision(param_dtype=compute, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


def make_accelerator(cfg, out: Path):
    """The Accelerator: explicit process-group timeout, and under `accelerate launch` with FSDP the
    launch config's plugin (read from the environment) with `fsdp_mixed_precision`."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from training.accelerate_config import fsdp_plugin
    from aftraj.scoring import resolve_mixed_precision

    kw = {}
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":   # the rank's device first
        kw["fsdp_plugin"] = fsdp_plugin(mixed_precision_policy=fsdp_mixed_precision(cfg))
    pg = InitProcessGroupKwargs(timeout=timedelta(minutes=cfg.process_group_timeout_minutes))
    if not launched_distributed():
        # accelerate keeps one AcceleratorState per process and refuses a second Accelerator with
        # another precision: a second run in the same process (warm-up then stage 1, a notebook,
        # the tests) would fail. One process, no process group: nothing to lose by starting anew.
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()
    return Accelerator(mixed_precision=resolve_mixed_precision(cfg.mixed_precision), log_with=cfg.report_to or None,
                       project_dir=str(out / "tb"), kwargs_handlers=[pg], **kw)


# --------------------------------------------------------------------------- export

def export_folder(model, tok, final: Path, *, lora: bool, state_dict: dict | None = None,
                  dtype: str | None = None) -> Path:
    """Write `final` as a folder `AutoModelForCausalLM.from_pretrained(final)` loads: with LoRA the
    adapter (final/adapter/, with the tokenizer) and the merged weights; else the weights
    (`state_dict` when given, e.g. gathered from FSDP). `dtype` (a torch dtype name) casts the
    exported floating weights and is written to config.json; config.json gets use_cache: true."""
    import torch

    final.mkdir(parents=True, exist_ok=True)
    cast = getattr(torch, dtype) if dtype else None
    if lora:
        model.save_pretrained(final / "adapter")
        tok.save_pretrained(final / "adapter")
        merged = model.merge_and_unload()
        if cast is not None:
            merged = merged.to(cast)
        merged.save_pretrained(final, safe_serialization=True)
    else:
        if state_dict is not None and cast is not None:
            state_dict = {k: v.to(cast) if v.is_floating_point() else v for k, v in state_dict.items()}
        kw = {} if state_dict is None else {"state_dict": state_dict}
        model.save_pretrained(final, safe_serialization=True, **kw)
    tok.save_pretrained(final)
    cfg_final = json.loads((final / "config.json").read_text())
    cfg_final["use_cache"] = True
    if dtype:
        for key in ("dtype", "torch_dtype"):     # transformers 5 writes `dtype`, 4.x `torch_dtype`
            if key in cfg_final:
                cfg_final[key] = dtype
    (final / "config.json").write_text(json.dumps(cfg_final, indent=2) + "\n")
    return final


def save_final(cfg, acc, model, tok, final: Path) -> Path:
    """The accelerate-trained model as `export_folder` writes it, in `cfg.export_dtype` (LoRA:
    merged weights); every rank takes part in gathering the state dict, the main process writes."""
    state = acc.get_state_dict(model)
    unwrapped = acc.unwrap_model(model)
    if acc.is_main_process:
        export_folder(unwrapped, tok, final, lora=cfg.finetune == "lora",
                      state_dict=None if cfg.finetune == "lora" else state, dtype=cfg.export_dtype)
    acc.wait_for_everyone()
    return final


def library_versions(*extra: str) -> dict:
    """python, torch, transformers and the named extra packages' versions (absent ones left out)."""
    import importlib

    v = {"python": platform.python_version()}
    for name in ("torch", "transformers", *extra):
        try:
            v[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return v
