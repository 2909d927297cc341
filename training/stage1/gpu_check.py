"""GPU check of the production stage-1 settings: 5 steps of `configs/stage1/qwen2.5-7b-2xh200.yaml`
(bf16 mixed precision over fp32 master weights, gradient checkpointing, adamw_bnb_8bit, cosine, 8192-token prompt budget, precomputed
reference, its batch and accumulation) on a randomly initialised Qwen2 of a few hundred million
parameters (152k-row vocabulary like Qwen2.5's) on one GPU, with long synthetic trajectories.
Reports per-step time and peak GPU memory; last line:

    gpu_stage1: steps=5 median_step_s=… peak_mem_gib=… params_m=… prompt_tokens_max=… loss_first=… loss_last=…

    bash scripts/gpu_stage1_check.sh                 # on a GPU node
    python -m training.stage1.gpu_check --tiny       # the same code path on CPU, shrunk (tests)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
from pathlib import Path

from aftraj.schema import Label, Step, Trajectory, write_jsonl

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = REPO / "configs" / "stage1" / "qwen2.5-7b-2xh200.yaml"


def build_random_qwen2(out: Path, *, hidden: int, layers: int, vocab: int, dtype: str) -> tuple[Path, int]:
    """A random Qwen2ForCausalLM (Qwen2.5-like shape) with the locally trained tiny tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from training.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer(out)
    heads = max(2, hidden // 64)
    cfg = Qwen2Config(vocab_size=max(vocab, len(tok)), hidden_size=hidden, intermediate_size=int(hidden * 5.25) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                      max_position_embeddings=32768, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype=dtype)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    return out, sum(p.numel() for p in model.parameters())


def long_trajectories(n: int, *, steps: int, chars_per_step: int, seed: int = 0) -> list[Trajectory]:
    """Unsafe runs with long steps (prompts of several thousand tokens); k* in the second half."""
    rng = random.Random(seed)
    words = "the agent tool result search value check plan code test pass answer error step".split()
    out = []
    for i in range(n):
        agents = ["user"] + [rng.choice(["Planner", "Coder", "Tester"]) for _ in range(steps - 1)]
        st = [Step(index=j, agent=a, kind="message",
                   content=" ".join(rng.choice(words) for _ in range(chars_per_step // 6)))
              for j, a in enumerate(agents)]
        k = rng.randint(steps // 2, steps - 1)
        out.append(Trajectory(id=f"long-{i}", family_id=f"long-{i}", domain="coding", source="gpu-check",
                              task="Fix the failing test.", steps=st, outcome="failure",
                              label=Label(verdict="UNSAFE", label_source="injected", decisive_step=k,
                                          decisive_agent=agents[k], reason="wrong value")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="shrunk model/data; CPU-safe settings without CUDA")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", help="keep the run folder here (default: a temporary folder)")
    a = ap.parse_args(argv)

    import torch

    from training.stage1.config import load_stage1_config
    from training.stage1.trainer import train

    cuda = torch.cuda.is_available()
    if not cuda and not a.tiny:
        raise SystemExit("gpu_check: no CUDA device; run on a GPU node (or --tiny for the CPU code path)")
    hidden, layers, vocab = (64, 2, 1024) if a.tiny else (a.hidden, a.layers, a.vocab)
    n_traj, n_steps, chars = (6, 5, 120) if a.tiny else (16, 14, 2200)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out) if a.out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        over = {"model": None, "data": str(root / "long.jsonl"), "output_dir": str(root / "run"),
                "max_steps": a.steps, "save_steps": a.steps, "warmup_steps": 1, "samples_per_prompt": 0,
                "report_to": []}
        if a.tiny:
            over.update(gradient_accumulation_steps=2, max_prompt_tokens=4096)
            if not cuda:
                over.update(mixed_precision="no", optimizer="adamw_torch")
        dtype = "float32"   # the production config's master-weight dtype; compute is bf16 on GPU
        model_dir, n_params = build_random_qwen2(root / "model", hidden=hidden, layers=layers, vocab=vocab, dtype=dtype)
        over["model"] = str(model_dir)
        write_jsonl(long_trajectories(n_traj, steps=n_steps, chars_per_step=chars), root / "long.jsonl")
        cfg = load_stage1_config(PRODUCTION, over)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        res = train(cfg, progress=False)
        stats = json.loads((Path(cfg.output_dir) / "data_stats.json").read_text())
    rows = res.history
    times = [r["step_seconds"] for r in rows[1:]] or [rows[0]["step_seconds"]]
    for r in rows:
        print(json.dumps({k: r[k] for k in ("step", "loss", "step_seconds", "tokens", "grad_norm")
                          if k in r} | ({"peak_memory_gib": r["peak_memory_gib"]} if "peak_memory_gib" in r else {})))
    assert all(math.isfinite(r["loss"]) for r in rows), "non-finite loss"
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan")
    print(f"settings: dtype={cfg.dtype} mixed_precision={cfg.mixed_precision} optimizer={cfg.optimizer} "
          f"gradient_checkpointing={cfg.gradient_checkpointing} batch={cfg.per_device_batch_size} "
          f"accum={cfg.gradient_accumulation_steps} device={'cuda:' + torch.cuda.get_device_name() if cuda else 'cpu'}")
    print(f"gpu_stage1: steps={len(rows)} median_step_s={statistics.median(times):.3f} peak_mem_gib={peak:.2f} "
          f"params_m={n_params / 1e6:.0f} prompt_tokens_max={stats['prompt_tokens_max']} "
          f"loss_first={rows[0]['loss']:.4f} loss_last={rows[-1]['loss']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
