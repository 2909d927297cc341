"""The one-H200 check of the production stage-1 run (issue 12), in two halves around the real
entry point, which `scripts/gpu_check.sh` runs under `accelerate launch` with one process:

    prepare  a random Qwen2 of Qwen2.5-7B's width (hidden 3,584, intermediate 18,944, 28 heads,
             4 KV heads, vocab 152,064) with 4 layers (disk: see below); a preference cache (what the
             preferences phase writes) whose prompts are exactly 8,192 tokens after the chat
             template and whose completions are cut to exactly 1,024; the production config with
             a 4-step schedule, checkpoints at step 2, the SDPA math kernel disabled.
    (train)  accelerate launch … --phase train --stop-at-step 2, then --resume to step 4 and the export.
    verify   asserts fp32 rotary buffers, optimizer checksums equal across save/load, metrics
             continuous across the resume, a bf16 export that loads on the GPU; prints peak
             allocated/reserved memory, time per micro-step, and the extrapolation to production
             (per-GPU peak, step time, epoch time). Last line:

    gpu_check: peak_alloc_gib=… peak_reserved_gib=… micro_step_s=… prod_peak_gib≈… prod_step_s≈… prod_epoch_h≈…

    and every figure as a `key=value` line, written as JSON to FIGURES_DIR/gpu_check.json.

Disk: the model folder (bf16), two sharded checkpoints (fp32 weights + 8-bit Adam, ~6 bytes a
parameter each, `save_total_limit: 2`) and the bf16 export: ~32 GiB with 4 layers. (14 layers,
which matched one production GPU's share of the weights, needed ~65 GiB of checkpoints; the
memory extrapolation adds the missing layers' fixed bytes and checkpointed activations instead.)

    bash scripts/gpu_check.sh [FIGURES_DIR]                           # on a GPU node
    python -m training.stage1.gpu_check prepare --root DIR [--tiny]   # --tiny: the CPU test's shapes
    python -m training.stage1.gpu_check verify --root DIR [--figures-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = REPO / "configs" / "stage1" / "qwen2.5-7b-2xh200.yaml"

QWEN25_7B = {"hidden": 3584, "intermediate": 18944, "heads": 28, "kv_heads": 4, "vocab": 152064, "layers": 28}
CHECK = {**QWEN25_7B, "layers": 4}
TINY = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 1024, "layers": 2}
PROMPT_TOKENS, COMPLETION_TOKENS = 8192, 1024
TINY_PROMPT_TOKENS, TINY_COMPLETION_TOKENS = 256, 32
STOP_AT, STEPS = 2, 4
_WORDS = "the agent tool result search value check plan code test pass answer error step".split()


def qwen2_params(shape: dict) -> int:
    """Parameter count of a Qwen2 (untied embeddings, q/k/v biases)."""
    h, i, kv = shape["hidden"], shape["intermediate"], shape["hidden"] // shape["heads"] * shape["kv_heads"]
    layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    return 2 * shape["vocab"] * h + shape["layers"] * layer + h


def build_random_qwen2(out: Path, shape: dict) -> Path:
    """A random Qwen2ForCausalLM of `shape`, saved in bf16 (loaded as the config's fp32 master
    weights), with the locally trained tiny tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from aftraj.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer(out)
    cfg = Qwen2Config(vocab_size=max(shape["vocab"], len(tok)), hidden_size=shape["hidden"],
                      intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                      max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    return out


def exact_prompt(tok, n_tokens: int, seed: int) -> list[dict]:
    """Chat messages whose chat-template prompt (with the generation prompt) is exactly n_tokens."""
    from aftraj.tokens import chat_prompt_ids

    rng = random.Random(seed)
    words = [rng.choice(_WORDS) for _ in range(n_tokens)]
    lo, hi = 1, len(words)                  # the most words that still fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        n = len(chat_prompt_ids(tok, [{"role": "user", "content": " ".join(words[:mid])}]))
        lo, hi = (mid, hi) if n <= n_tokens else (lo, mid - 1)
    text = " ".join(words[:lo])
    for _ in range(256):                    # top up with " ." (one token each) to the exact length
        n = len(chat_prompt_ids(tok, [{"role": "user", "content": text}]))
        if n == n_tokens:
            return [{"role": "user", "content": text}]
        if n > n_tokens:
            break
        text += " ."
    raise ValueError(f"could not build a prompt of exactly {n_tokens} tokens")


def write_preference_cache(run: Path, tok, *, n_pairs: int, prompt_tokens: int, completion_tokens: int) -> None:
    """What the preferences phase writes (preferences.jsonl + preference_stats.json), with
    prompts of exactly `prompt_tokens` and completions longer than `completion_tokens` (cut)."""
    run.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    long_text = lambda: " ".join(rng.choice(_WORDS) for _ in range(completion_tokens + 64))  # noqa: E731
    records = []
    for i in range(n_pairs):
        subset = "pre" if i % 2 == 0 else "post"
        records.append({"traj_id": f"gpu-check-{i}", "subset": subset, "t": 3,
                        "messages": exact_prompt(tok, prompt_tokens, seed=i), "chosen": long_text(),
                        "rejected": long_text(), "chosen_source": "canonical", "rejected_source": "canonical",
                        "rejected_class": "canonical", "gold": {"decision": "UNSAFE", "step": 3, "agent": "Coder"}})
    (run / "preferences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "preference_stats.json").write_text(json.dumps({"data": "gpu_check synthetic", "n_pairs": n_pairs}) + "\n")


def check_config(root: Path, *, tiny: bool) -> Path:
    """The production config, with the check's model, run folder and 4-step schedule."""
    raw = yaml.safe_load(PRODUCTION.read_text())
    raw.update(model=str(root / "model"), output_dir=str(root / "run"), num_epochs=None, max_steps=STEPS,
               save_steps=STOP_AT, save_total_limit=2, logging_steps=1, report_to=[], samples_per_prompt=0,
               gradient_accumulation_steps=2, warmup_ratio=0.25, warmup_steps=None, sdpa_math_kernel=False)
    if tiny:
        raw.update(max_prompt_tokens=TINY_PROMPT_TOKENS, max_completion_tokens=TINY_COMPLETION_TOKENS,
                   gradient_checkpointing=False)
    path = root / "stage1-gpu-check.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    from training.stage1.config import load_stage1_config

    load_stage1_config(path)                # valid as written
    return path


def prepare(root: Path, *, tiny: bool) -> Path:
    from transformers import AutoTokenizer

    shape = TINY if tiny else CHECK
    build_random_qwen2(root / "model", shape)
    tok = AutoTokenizer.from_pretrained(root / "model")
    cfg_path = check_config(root, tiny=tiny)
    # global batch 2 pairs × 1 rank × 2 micro-steps = 4; 4 steps over 8 pairs = 2 epochs
    write_preference_cache(root / "run", tok, n_pairs=8,
                           prompt_tokens=TINY_PROMPT_TOKENS if tiny else PROMPT_TOKENS,
                           completion_tokens=TINY_COMPLETION_TOKENS if tiny else COMPLETION_TOKENS)
    return cfg_path


def write_figures(fig: dict, name: str, folder: str | Path | None) -> dict:
    """Print every figure as a `key=value` line and write them as JSON to folder/name.json; a
    figure that is not finite (memory on CPU) becomes None (JSON null). Returns the figures."""
    fig.update({k: None for k, v in fig.items() if isinstance(v, float) and not math.isfinite(v)})
    for k, v in fig.items():
        print(f"{k}={v}")
    if folder:
        path = Path(folder) / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fig, indent=2, allow_nan=False) + "\n")
        print(f"{name}: figures written to {path}")
    return fig


def verify(root: Path, *, pairs: int = 1100, require_cuda: bool = True, figures_dir: str | Path | None = None) -> dict:
    """Assert what the check is for and return (and print) the figures."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.stage1.config import load_stage1_config

    cfg = load_stage1_config(root / "stage1-gpu-check.yaml")
    run = Path(cfg.output_dir)
    info = json.loads((run / "run.json").read_text())
    inv = info["invocations"]
    assert [i["resume_from_step"] for i in inv] == [0, STOP_AT], f"expected a run and a resume, got {inv}"
    for i in inv:                           # fp32 rotary buffers after prepare and after a forward
        for when in ("after_prepare", "after_forward"):
            found = i["rotary_buffer_dtypes"][when]
            assert found and set(found.values()) == {"float32"}, f"rotary buffers {when}: {found}"
    saved = json.loads((run / f"checkpoint-{STOP_AT:06d}" / "trainer_state.json").read_text())["optimizer_checksum"]
    restored = inv[1]["optimizer_checksum_restored"]
    assert restored == saved and saved[0][0] > 0, f"optimizer checksum saved {saved} != restored {restored}"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "metrics are not continuous across the resume"
    assert all(math.isfinite(r["loss"]) for r in rows), "non-finite loss"
    assert abs(rows[0]["loss"] - math.log(2)) < 2e-2, f"step 1 loss {rows[0]['loss']} is not ln 2"
    expected_lr = _schedule_lrs(cfg, n_pairs=json.loads((run / "data_stats.json").read_text())["n_pairs"])
    got_lr = [r["lr"] for r in rows]
    assert all(math.isclose(g, e, rel_tol=1e-6, abs_tol=1e-15) for g, e in zip(got_lr, expected_lr, strict=True)), \
        f"learning rates {got_lr} are not the schedule's {expected_lr} (scheduler state lost on resume?)"
    epochs = [r["epoch"] for r in rows]
    assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs), f"epochs not increasing: {epochs}"
    stats = json.loads((run / "data_stats.json").read_text())
    assert stats["prompt_tokens_max"] == stats["prompt_tokens_mean"] == cfg.max_prompt_tokens, stats
    assert stats["completions_cut"] == 2 * stats["n_pairs"], stats
    final = run / "final"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if require_cuda and device != "cuda":
        raise SystemExit("gpu_check verify: no CUDA device")
    model = AutoModelForCausalLM.from_pretrained(final, dtype="auto").to(device)
    assert {p.dtype for p in model.parameters()} == {getattr(torch, cfg.export_dtype)}, "export dtype"
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3]], device=device)).logits
    assert torch.isfinite(out.float()).all(), "the exported model gives non-finite logits"
    del model
    fig = _figures(cfg, rows, pairs)
    fig["device"] = f"cuda:{torch.cuda.get_device_name()}" if device == "cuda" else "cpu"
    write_figures(fig, "gpu_check", figures_dir)
    return fig


def _schedule_lrs(cfg, n_pairs: int) -> list[float]:
    """The learning rate of each step of an uninterrupted run of `cfg` on one rank."""
    import torch
    from transformers import get_scheduler

    sched = cfg.schedule(n_pairs, world_size=1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    lr_sched = get_scheduler(cfg.lr_scheduler, opt, num_warmup_steps=sched.warmup_steps,
                             num_training_steps=sched.steps)
    out = []
    for _ in range(sched.steps):
        out.append(lr_sched.get_last_lr()[0])
        opt.step()
        lr_sched.step()
    return out


def _figures(cfg, rows: list[dict], pairs: int) -> dict:
    """Measured figures and the production extrapolation (stated assumptions, printed)."""
    timed = [r for r in rows if r["step"] not in (1, STOP_AT + 1)] or rows   # no warm-up steps
    micro_s = statistics.median(r["micro_step_seconds"] for r in timed)
    peak = max(r.get("peak_memory_gib", float("nan")) for r in rows)
    reserved = max(r.get("peak_reserved_gib", float("nan")) for r in rows)
    p_check, p_prod = qwen2_params(CHECK), qwen2_params(QWEN25_7B)
    # fixed bytes a parameter: fp32 weight + fp32 gradient + 8-bit Adam (2 × 1 byte) = 10
    fixed_delta_gib = (p_prod / 2 - p_check) * 10 / 2 ** 30
    tokens_micro = cfg.per_device_batch_size * 2 * (cfg.max_prompt_tokens + cfg.max_completion_tokens)
    ckpt_gib = (QWEN25_7B["layers"] - CHECK["layers"]) * tokens_micro * CHECK["hidden"] * 2 / 2 ** 30
    layer_p = (qwen2_params(CHECK) - qwen2_params({**CHECK, "layers": 0})) / CHECK["layers"]
    compute_ratio = (QWEN25_7B["layers"] * layer_p + CHECK["vocab"] * CHECK["hidden"]) / \
        (CHECK["layers"] * layer_p + CHECK["vocab"] * CHECK["hidden"])
    prod = load_production()
    prod_accum = prod.gradient_accumulation_steps
    prod_step_s = micro_s * compute_ratio * prod_accum
    sched = prod.schedule(pairs, world_size=2)
    fig = {"params_check_b": p_check / 1e9, "params_prod_b": p_prod / 1e9, "peak_alloc_gib": peak,
           "peak_reserved_gib": reserved, "micro_step_s": micro_s, "tokens_per_micro_step": tokens_micro,
           "prod_peak_gib": peak + fixed_delta_gib + ckpt_gib, "prod_fixed_delta_gib": fixed_delta_gib,
           "prod_checkpoint_delta_gib": ckpt_gib, "compute_ratio": compute_ratio, "prod_step_s": prod_step_s,
           "prod_steps": sched.steps, "prod_epochs": sched.epochs, "prod_pairs": pairs,
           "prod_epoch_h": prod_step_s * sched.steps / sched.epochs / 3600,
           "prod_run_h": prod_step_s * sched.steps / 3600}
    print(f"assumptions: production GPU holds half of {p_prod / 1e9:.2f}B parameters at 10 bytes each "
          f"(check: {p_check / 1e9:.2f}B on one GPU); {QWEN25_7B['layers'] - CHECK['layers']} more layers of "
          f"bf16 checkpointed hidden states; "
          f"compute ∝ layer + lm_head parameters (×{compute_ratio:.2f}); {prod_accum} micro-steps a step; "
          f"FSDP communication between the 2 GPUs not measured here")
    print(f"gpu_check: peak_alloc_gib={peak:.2f} peak_reserved_gib={reserved:.2f} micro_step_s={micro_s:.3f} "
          f"prod_peak_gib≈{fig['prod_peak_gib']:.1f} prod_step_s≈{prod_step_s:.1f} "
          f"prod_epoch_h≈{fig['prod_epoch_h']:.2f} prod_run_h≈{fig['prod_run_h']:.2f} "
          f"(steps={sched.steps}, epochs={sched.epochs:.2f}, pairs={pairs})")
    return fig


def load_production():
    from training.stage1.config import load_stage1_config

    return load_stage1_config(PRODUCTION)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="random model, exact-length preference cache, check config")
    p.add_argument("--root", required=True)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU test of this code)")
    v = sub.add_parser("verify", help="assert and print the figures")
    v.add_argument("--root", required=True)
    v.add_argument("--pairs", type=int, default=1100, help="preference pairs of the production run")
    v.add_argument("--allow-cpu", action="store_true", help="(tests) verify a CPU run")
    v.add_argument("--figures-dir", help="write gpu_check.json (the figures) into this folder")
    a = ap.parse_args(argv)
    root = Path(a.root)
    if a.cmd == "prepare":
        root.mkdir(parents=True, exist_ok=True)
        print(prepare(root, tiny=a.tiny))
    else:
        verify(root, pairs=a.pairs, require_cuda=not a.allow_cpu, figures_dir=a.figures_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
