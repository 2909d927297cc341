"""Stage-1 step time: our BPPO trainer vs a plain TRL 1.16 `DPOTrainer`, same tiny model, same
preference pairs, batch size and sequence lengths, both on CPU in float32, full fine-tune with a
live frozen reference (TRL's default), no gradient checkpointing, AdamW, grad-norm clipping 1.0.

Other processes share the machine and its load swings by several times within minutes, so the
two trainers run back to back in alternating rounds in this one process (ours first in even
rounds, TRL first in odd ones). A step's time is the wall time between consecutive step ends
(the first step of each run is dropped as warm-up). Each round gives the ratio of the two
median step times; `ratio` is the median of the per-round ratios, which cancels load changes
between rounds; the s/step figures are the medians over all steps of all rounds.

    python benchmarks/stage1_step.py [--rounds 5] [--steps 6] [--batch 4] [--hidden 256]
last line: ours_s_per_step=… trl_s_per_step=… ratio=…   (target ratio <= 1.10)
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")


# --- data and model -----------------------------------------------------------------------

def build(root: Path, hidden: int, layers: int, n_traj: int):
    from training.models import build_tiny_model
    from training.stage1.data import synthetic_trajectories
    from training.stage1.pairs import boundary_prompts
    from training.stage1.preferences import build_preferences

    model_dir = build_tiny_model(root / "model", hidden_size=hidden, num_layers=layers)
    prompts, _ = boundary_prompts(synthetic_trajectories(n_traj, seed=1))
    records, _ = build_preferences(prompts, None, 0)
    return model_dir, records


# --- ours ---------------------------------------------------------------------------------

def run_ours(model_dir: Path, records: list[dict], out: Path, steps: int, batch: int) -> tuple[list[float], float]:
    import json

    from training.stage1.config import Stage1Config
    from training.stage1.trainer import train

    out.mkdir(parents=True)
    # the preference cache is reused, so both trainers see the very same pairs
    (out / "preferences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "preference_stats.json").write_text("{}")
    cfg = Stage1Config(model=str(model_dir), data="builtin:synthetic", output_dir=str(out), max_steps=steps,
                       save_steps=10 ** 6, report_to=[], per_device_batch_size=batch, reference="live",
                       finetune="full", lr_scheduler="linear", learning_rate=1e-4, max_grad_norm=1.0,
                       max_completion_tokens=1024, max_prompt_tokens=8192)
    ends, tokens = [], []
    train(cfg, progress=False, on_step_end=lambda row: (ends.append(time.perf_counter()),
                                                          tokens.append(row["tokens"])))
    return [b - a for a, b in zip(ends, ends[1:])], statistics.mean(tokens)


# --- TRL ----------------------------------------------------------------------------------

def run_trl(model_dir: Path, records: list[dict], out: Path, steps: int, batch: int) -> tuple[list[float], float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ds = Dataset.from_list([{"prompt": r["messages"],
                             "chosen": [{"role": "assistant", "content": r["chosen"]}],
                             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in records])
    args = DPOConfig(output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch,
                     learning_rate=1e-4, lr_scheduler_type="linear", max_grad_norm=1.0, bf16=False,
                     use_cpu=True, gradient_checkpointing=False, report_to="none", save_strategy="no",
                     logging_steps=1, disable_tqdm=True, max_length=None, seed=0, beta=0.1,
                     dataloader_num_workers=0)
    trainer = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)   # no per-step log printing (ours prints none either)
    trainer.train()
    lens = [2 * len(x["prompt_ids"]) + len(x["chosen_ids"]) + len(x["rejected_ids"]) for x in trainer.train_dataset]
    return [b - a for a, b in zip(ends, ends[1:])], statistics.mean(lens) * batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4, help="preference pairs per step")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--trajectories", type=int, default=24)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, records = build(root, a.hidden, a.layers, a.trajectories)
        print(f"model: random Qwen2 hidden={a.hidden} layers={a.layers}; {len(records)} pairs; "
              f"batch={a.batch} pairs; steps/run={a.steps}; rounds={a.rounds}; torch threads={torch.get_num_threads()}")
        ours, trl, ratios = [], [], []
        for r in range(a.rounds):
            med = {}
            order = (("ours", run_ours), ("trl", run_trl)) if r % 2 == 0 else (("trl", run_trl), ("ours", run_ours))
            for name, fn in order:
                times, tok = fn(model_dir, records, root / f"{name}-{r}", a.steps, a.batch)
                (ours if name == "ours" else trl).extend(times)
                med[name] = statistics.median(times)
                print(f"round {r} {name:4s}: median {statistics.median(times):.3f} s/step "
                      f"(n={len(times)}, ~{tok:.0f} tokens/step)", flush=True)
            ratios.append(med["ours"] / med["trl"])
            print(f"round {r} ratio ours/trl: {ratios[-1]:.3f}", flush=True)
    o, t = statistics.median(ours), statistics.median(trl)
    print(f"per-round ratios: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(f"ours_s_per_step={o:.4f} trl_s_per_step={t:.4f} ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
