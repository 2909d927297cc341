"""GPU check of the stage-2 TRL path (phase 2 of scripts/gpu_check.sh): a format warm-start, then 2
GRPO steps on one GPU (written for one H200) with a randomly initialised Qwen2 of a few hundred
million parameters (152k-row vocabulary like Qwen2.5's), float32 master weights computed in bf16
by autocast, at the PRODUCTION learning rate (configs/stage2/qwen2.5-7b-8xh200.yaml, 1e-6) with
its 8-bit AdamW (on CPU: torch's AdamW), our reward, KL to the init model, 8 completions per prompt.

A random model is malformed on every completion: every reward in a group is the same and every
GRPO advantage is 0, so nothing would be learnt or tested. The check therefore first runs a few
supervised steps of the format warm-up (training/warmup, content-independent verdicts) and starts
GRPO from that: completions now end at varied lengths, so the reward (its overlong penalty at
least; format and verdict terms where a completion parses) varies within a group, and the check
asserts a non-zero reward spread within groups (hence a non-zero advantage), that the GRPO steps
changed the parameters, and that the update was kept: at least MIN_CHANGED_FRACTION of the decoder
layers' weight elements moved (`kept_update`; bf16 masters at 1e-6 move under 5 %,
tests/training/test_master_precision.py). Where a completion does not parse, the spread is the
length penalty alone (`warmup_parse_rate` says how many did). Figures are printed as `key=value`
lines and written to FIGURES_DIR/gpu_stage2.json:

    steps median_step_s peak_mem_gib params_m completion_tokens warmup_steps warmup_parse_rate
    reward_first reward_std_max frac_reward_zero_std_min kl_last params_changed max_param_change
    learning_rate layer_elements_changed_fraction bf16_master_would_keep_fraction dtype bf16_autocast
    optimizer

    bash scripts/gpu_check.sh [OUT]                        # on a GPU node: phase 2 of the one check
    python -m training.stage2.gpu_check --tiny             # the same code path on CPU, shrunk
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.stage1.gpu_check import build_random_qwen2, write_figures

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "stage2" / "tiny-cpu.yaml"
PRODUCTION = REPO / "configs" / "stage2" / "qwen2.5-7b-8xh200.yaml"
# share of the decoder layers' weight elements an update must have moved (fp32 masters move all
# but those whose gradient is exactly 0; bf16 masters at 1e-6 under 5 %: test_master_precision.py)
MIN_CHANGED_FRACTION = 0.5


def production_learning_rate() -> float:
    """The learning rate of the production stage-2 config (the check trains at it)."""
    from training.stage2.config import load_stage2_config

    return load_stage2_config(PRODUCTION).learning_rate
WARMUP = REPO / "configs" / "warmup" / "tiny-cpu.yaml"


def _n_params(model_dir: Path) -> int:
    """Parameters of a saved checkpoint, counted from its safetensors headers (no weights loaded)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                size = 1
                for d in shape:
                    size *= d
                n += size
    return n


def _tensors(d: Path):
    from safetensors import safe_open

    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                yield k, st.get_tensor(k)


def param_change(a_dir: Path, b_dir: Path) -> tuple[int, int, float]:
    """(tensors that differ, tensors compared, largest absolute difference) between two saved
    checkpoints of the same shapes."""
    b = dict(_tensors(b_dir))
    changed = n = 0
    biggest = 0.0
    for k, ta in _tensors(a_dir):
        if k not in b:
            continue
        n += 1
        d = (ta.float() - b[k].float()).abs().max().item()
        changed += d > 0
        biggest = max(biggest, d)
    return changed, n, biggest


def is_layer_matrix(name: str, t) -> bool:
    """A decoder layer's weight matrix: every element gets a gradient from any token (an embedding
    row only from its own token), so after an Adam step with a non-zero loss gradient each one moved."""
    return t.dim() == 2 and ".layers." in name


def kept_update(before: dict, after: dict) -> dict:
    """How much of an update the weights kept, over the decoder layers' weight matrices of two
    states ({name: tensor}): `changed_fraction`, the share of elements that differ; and
    `bf16_kept_fraction`, the share that would still differ had both been rounded to bfloat16
    (what bf16 master weights could have held of the same update)."""
    import torch

    n = changed = kept16 = 0
    for k, a in before.items():
        b = after.get(k)
        if b is None or not is_layer_matrix(k, a):
            continue
        a32, b32 = a.float(), b.float()
        n += a.numel()
        changed += (a32 != b32).sum().item()
        kept16 += (a32.to(torch.bfloat16) != b32.to(torch.bfloat16)).sum().item()
    if not n:
        raise ValueError("no decoder-layer weight matrix to compare")
    return {"changed_fraction": changed / n, "bf16_kept_fraction": kept16 / n, "elements": n}


def saved_kept_update(a_dir: Path, b_dir: Path) -> dict:
    """`kept_update` between two saved checkpoints."""
    return kept_update(dict(_tensors(a_dir)), dict(_tensors(b_dir)))


def warm_start(model_dir: Path, out: Path, *, steps: int, dtype: str, cuda: bool, tiny: bool) -> dict:
    """A few supervised format steps on the random model (the format warm-up's own trainer);
    returns its stats (loss, parse rate). The warmed model is `out/final`."""
    from training.warmup.config import load_warmup_config
    from training.warmup.trainer import warmup

    over = {"model": str(model_dir), "output_dir": str(out), "max_steps": steps, "finetune": "full",
            "dtype": dtype, "export_dtype": dtype, "learning_rate": 2e-3 if tiny else 5e-4,
            "batch_size": 2 if tiny else 4, "synthetic_trajectories": 8 if tiny else 16,
            "max_prompt_tokens": 2048, "max_completion_tokens": 96 if tiny else 192,
            "parse_check_prompts": 2 if tiny else 8, "parse_check_max_new_tokens": 96 if tiny else 192,
            "mixed_precision": "bf16" if cuda else "no", "report_to": []}
    cfg = load_warmup_config(WARMUP, over)
    return warmup(cfg, progress=False)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="shrunk model; CPU-safe settings without CUDA")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup-steps", type=int, default=None, help="format warm-start steps (default 40, tiny 24)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--learning-rate", type=float, default=None,
                    help=f"default: the production config's ({PRODUCTION.relative_to(REPO)})")
    ap.add_argument("--out", help="keep the run folder here (default: a temporary folder)")
    ap.add_argument("--figures-dir", help="write gpu_stage2.json (the figures) into this folder")
    return ap


def _grpo_overrides(a: argparse.Namespace, init: Path, root: Path, *, dtype: str, lr: float, cuda: bool) -> dict:
    """The tiny stage-2 config's overrides: the warmed model, the check's shapes, the production
    learning rate and (on the GPU) optimizer."""
    completion = 96 if a.tiny else a.completion
    return {"model": str(init), "output_dir": str(root / "run"), "max_steps": a.steps,
            "save_steps": a.steps, "save_total_limit": 1, "report_to": [], "dtype": dtype, "bf16": cuda,
            "num_generations": 4 if a.tiny else a.generations, "max_completion_length": completion,
            "overlong_buffer_len": completion // 2, "prompts_per_step": 2 if a.tiny else 4,
            "max_prompt_tokens": 4096, "learning_rate": lr,
            # the production optimizer on the GPU (bitsandbytes has no CPU 8-bit Adam here)
            "optimizer": "adamw_bnb_8bit" if cuda else "adamw_torch"}


@dataclass
class _Run:
    """What the check's run leaves for the figures and the assertions."""
    cfg: Any                    # the stage-2 config it trained with
    rows: list[dict]            # the GRPO steps' history
    n_params: int
    warm_steps: int
    warm: dict                  # the warm-start's stats
    changed: int                # param_change(init, final)
    compared: int
    biggest: float
    kept: dict                  # saved_kept_update(init, final)


def _run(a: argparse.Namespace, root: Path, *, cuda: bool) -> _Run:
    """Build the random model, warm it up, take the GRPO steps; what the figures are made of."""
    import torch

    from training.stage2.config import load_stage2_config
    from training.stage2.trl_engine import train

    hidden, layers, vocab = (64, 2, 1024) if a.tiny else (a.hidden, a.layers, a.vocab)
    warm_steps = a.warmup_steps if a.warmup_steps is not None else (24 if a.tiny else 40)
    dtype = "float32"                   # master weights; bf16 compute by autocast on CUDA
    lr = a.learning_rate if a.learning_rate is not None else production_learning_rate()
    heads = max(2, hidden // 64)        # a Qwen2.5-like shape, saved in bf16 by the stage-1 builder
    shape = {"vocab": vocab, "hidden": hidden, "intermediate": int(hidden * 5.25) // 64 * 64,
             "layers": layers, "heads": heads, "kv_heads": max(1, heads // 4)}
    model_dir = build_random_qwen2(root / "model", shape)
    n_params = _n_params(model_dir)
    warm = warm_start(model_dir, root / "warmup", steps=warm_steps, dtype=dtype, cuda=cuda, tiny=a.tiny)
    init = root / "warmup" / "final"
    cfg = load_stage2_config(TINY, _grpo_overrides(a, init, root, dtype=dtype, lr=lr, cuda=cuda))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    res = train(cfg, progress=False)
    changed, compared, biggest = param_change(init, res.final_dir)
    return _Run(cfg, res.history, n_params, warm_steps, warm, changed, compared, biggest,
                saved_kept_update(init, res.final_dir))


def _figures(run: _Run, *, cuda: bool) -> dict:
    import torch

    cfg, rows, warm, kept = run.cfg, run.rows, run.warm, run.kept
    times = [r["step_time"] for r in rows[1:]] or [rows[0]["step_time"]]
    return {"steps": len(rows), "median_step_s": round(statistics.median(times), 3),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if cuda else None,
            "params_m": round(run.n_params / 1e6, 3), "completion_tokens": cfg.max_completion_length,
            "generations": cfg.num_generations, "prompts_per_step": cfg.prompts_per_step,
            "warmup_steps": run.warm_steps, "warmup_loss_first": round(warm["loss_first"], 4),
            "warmup_loss_last": round(warm["loss_last"], 4), "warmup_parse_rate": warm.get("parse_rate"),
            "reward_first": round(rows[0]["reward"], 4),
            "reward_std_max": round(max(r.get("reward_std", 0.0) for r in rows), 4),
            "frac_reward_zero_std_min": min((r["frac_reward_zero_std"] for r in rows if "frac_reward_zero_std" in r),
                                            default=None),
            "kl_last": round(rows[-1]["kl"], 6), "params_changed": run.changed, "params_compared": run.compared,
            "max_param_change": run.biggest, "learning_rate": cfg.learning_rate,
            "layer_elements_changed_fraction": round(kept["changed_fraction"], 6),
            "bf16_master_would_keep_fraction": round(kept["bf16_kept_fraction"], 6),
            "dtype": cfg.dtype, "bf16_autocast": cfg.bf16, "optimizer": cfg.optimizer,
            "device": f"cuda:{torch.cuda.get_device_name()}" if cuda else "cpu"}


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not a.tiny:
        raise SystemExit("gpu_check: no CUDA device; run on a GPU node (or --tiny for the CPU code path)")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out) if a.out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        run = _run(a, root, cuda=cuda)
    rows, cfg, kept = run.rows, run.cfg, run.kept
    for r in rows:
        print(json.dumps({k: r[k] for k in ("step", "reward", "reward_std", "frac_reward_zero_std", "kl", "loss",
                                            "step_time", "completions/mean_length") if k in r}))
    assert len(rows) == a.steps and all(math.isfinite(r["loss"]) for r in rows), "missing steps or non-finite loss"
    fig = _figures(run, cuda=cuda)
    write_figures(fig, "gpu_stage2", a.figures_dir)
    assert fig["reward_std_max"] > 0, ("every group's rewards were equal: every GRPO advantage was 0 "
                                       "(the warm-start did not give the reward a spread)")
    assert run.changed > 0 and run.biggest > 0, "the GRPO steps changed no parameter"
    assert kept["changed_fraction"] >= MIN_CHANGED_FRACTION, (
        f"only {kept['changed_fraction']:.2%} of the decoder layers' weights moved at learning rate "
        f"{cfg.learning_rate:g} (dtype {cfg.dtype}): the update was lost")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
