"""GPU check of the stage-2 TRL path: 2 GRPO steps on one GPU (written for one H200) with a
randomly initialised Qwen2 of a few hundred million parameters (152k-row vocabulary like
Qwen2.5's) in bf16, our reward, KL to the init model, 8 completions per prompt. A random model
writes until `max_completion_length`, so this is the worst case of generation length. Reports
per-step time and peak GPU memory; last line:

    gpu_stage2: steps=2 median_step_s=… peak_mem_gib=… params_m=… completion_tokens=… reward_first=… kl_last=…

    bash scripts/gpu_stage2_check.sh                 # on a GPU node (not run yet: no GPU was lent)
    python -m training.stage2.gpu_check --tiny       # the same code path on CPU, shrunk (tests)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from training.stage1.gpu_check import build_random_qwen2

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "stage2" / "tiny-cpu.yaml"


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="shrunk model; CPU-safe settings without CUDA")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--out", help="keep the run folder here (default: a temporary folder)")
    a = ap.parse_args(argv)

    import torch

    from training.stage2.config import load_stage2_config
    from training.stage2.trl_engine import train

    cuda = torch.cuda.is_available()
    if not cuda and not a.tiny:
        raise SystemExit("gpu_check: no CUDA device; run on a GPU node (or --tiny for the CPU code path)")
    hidden, layers, vocab = (64, 2, 1024) if a.tiny else (a.hidden, a.layers, a.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out) if a.out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        dtype = "bfloat16" if cuda else "float32"
        heads = max(2, hidden // 64)        # a Qwen2.5-like shape, saved in bf16 by the stage-1 builder
        shape = {"vocab": vocab, "hidden": hidden, "intermediate": int(hidden * 5.25) // 64 * 64,
                 "layers": layers, "heads": heads, "kv_heads": max(1, heads // 4)}
        model_dir = build_random_qwen2(root / "model", shape)
        n_params = _n_params(model_dir)
        over = {"model": str(model_dir), "output_dir": str(root / "run"), "max_steps": a.steps,
                "save_steps": a.steps, "report_to": [], "dtype": dtype, "bf16": cuda,
                "num_generations": 4 if a.tiny else a.generations,
                "max_completion_length": 16 if a.tiny else a.completion,
                "overlong_buffer_len": 4 if a.tiny else a.completion // 4,
                "prompts_per_step": 2 if a.tiny else 4, "max_prompt_tokens": 4096,
                "learning_rate": 1e-5}
        cfg = load_stage2_config(TINY, over)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        res = train(cfg, progress=False)
    rows = res.history
    for r in rows:
        print(json.dumps({k: r[k] for k in ("step", "reward", "kl", "loss", "step_time", "completions/mean_length")
                          if k in r}))
    assert len(rows) == a.steps and all(math.isfinite(r["loss"]) for r in rows), "missing steps or non-finite loss"
    times = [r["step_time"] for r in rows[1:]] or [rows[0]["step_time"]]
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan")
    print(f"settings: dtype={cfg.dtype} bf16={cfg.bf16} generations={cfg.num_generations} "
          f"prompts_per_step={cfg.prompts_per_step} max_completion_length={cfg.max_completion_length} "
          f"device={'cuda:' + torch.cuda.get_device_name() if cuda else 'cpu'}")
    print(f"gpu_stage2: steps={len(rows)} median_step_s={statistics.median(times):.3f} peak_mem_gib={peak:.2f} "
          f"params_m={n_params / 1e6:.0f} completion_tokens={cfg.max_completion_length} "
          f"reward_first={rows[0]['reward']:.4f} kl_last={rows[-1]['kl']:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
