"""Stage-1 step time: our BPPO trainer vs a plain TRL 1.16 `DPOTrainer`, same tiny model, same
preference pairs, batch size and sequence lengths, both on CPU in float32, full fine-tune with a
live frozen reference (TRL's default), no gradient checkpointing, AdamW, linear decay,
grad-norm clipping 1.0, no checkpoint saving inside the timed steps.

On a shared machine the load can swing several-fold within a minute, so
the two trainers run *step-interleaved* in one process: each runs its own unmodified loop in its
own thread, and a baton passed at every step end lets exactly one of them compute at a time
(ours step 1, TRL step 1, ours step 2, …). A step's time runs from getting the baton to the
step's end (data collation, forward, backward, optimizer and logging included; waiting for the
baton excluded); the first step of each run, which overlaps the other's set-up, is dropped.
`ratio` = median ours / median TRL over all rounds; per-round ratios are printed too.

    python benchmarks/stage1_step.py [--rounds 2] [--steps 10] [--batch 4] [--hidden 256]
last line: ours_s_per_step=… trl_s_per_step=… ratio=…   (target ratio <= 1.10)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")


class Baton:
    """Exactly one holder at a time; `pass_to(name)` hands it over and wakes the other."""

    def __init__(self, first: str):
        self.turn, self.cv = first, threading.Condition()
        # TRL's Trainer resets accelerate's process-wide state when built: build it first
        self.trl_built = threading.Event()

    def pass_to(self, name: str) -> None:
        with self.cv:
            self.turn = name
            self.cv.notify_all()

    def wait_for(self, name: str) -> float:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == name)
        return time.perf_counter()


# --- data and model -----------------------------------------------------------------------

def build(root: Path, hidden: int, layers: int, n_traj: int):
    from aftraj.models import build_tiny_model
    from aftraj.boundary import boundary_prompts
    from training.common import synthetic_trajectories
    from training.stage1.preferences import build_preferences

    model_dir = build_tiny_model(root / "model", hidden_size=hidden, num_layers=layers)
    prompts, _ = boundary_prompts(synthetic_trajectories(n_traj, seed=1))
    records, _ = build_preferences(prompts, None, 0)
    return model_dir, records


def run_ours(model_dir, records, out: Path, steps: int, batch: int, baton: Baton, res: dict) -> None:
    from training.stage1.config import Stage1Config
    from training.stage1.trainer import train

    out.mkdir(parents=True)
    # the preference cache is reused, so both trainers see the very same pairs
    (out / "preferences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "preference_stats.json").write_text("{}")
    cfg = Stage1Config(model=str(model_dir), data="builtin:synthetic", output_dir=str(out), max_steps=steps,
                       save_steps=10 ** 6, report_to=[], per_device_batch_size=batch, reference="live",
                       finetune="full", lr_scheduler="linear", learning_rate=1e-4, max_grad_norm=1.0,
                       max_completion_tokens=1024, max_prompt_tokens=8192,
                       allow_many_epochs=True)   # a speed benchmark: epochs do not matter
    times, tokens, start = [], [], [None]

    def on_end(row):
        times.append(time.perf_counter() - start[0])
        tokens.append(row["tokens"])
        baton.pass_to("trl")
        start[0] = baton.wait_for("ours")   # also after the last step: our final save waits

    baton.trl_built.wait()
    start[0] = time.perf_counter()
    train(cfg, progress=False, on_step_end=on_end)
    res["ours"] = (times[1:], statistics.mean(tokens))


def run_trl(model_dir, records, out: Path, steps: int, batch: int, baton: Baton, res: dict) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    times, start = [], [time.perf_counter()]

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - start[0])
            baton.pass_to("ours")
            if state.global_step < steps:
                start[0] = baton.wait_for("trl")

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
    baton.trl_built.set()
    start[0] = baton.wait_for("trl")           # the timed steps start after our first step
    trainer.train()
    lens = [2 * len(x["prompt_ids"]) + len(x["chosen_ids"]) + len(x["rejected_ids"]) for x in trainer.train_dataset]
    res["trl"] = (times[1:], statistics.mean(lens) * batch)


def one_round(model_dir, records, root: Path, steps: int, batch: int) -> dict:
    baton, res, errors = Baton("ours"), {}, []

    def guard(fn, *a):
        try:
            fn(*a)
        except BaseException as e:   # surface a failure instead of leaving the other thread waiting
            errors.append(e)
            baton.trl_built.set()
            baton.pass_to("ours" if fn is run_trl else "trl")
            raise

    threads = [threading.Thread(target=guard, args=(fn, model_dir, records, root / name, steps, batch, baton, res))
               for name, fn in (("ours", run_ours), ("trl", run_trl))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
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
        ours, trl = [], []
        for r in range(a.rounds):
            res = one_round(model_dir, records, root / f"round-{r}", a.steps, a.batch)
            (o, o_tok), (t, t_tok) = res["ours"], res["trl"]
            ours += o
            trl += t
            print(f"round {r}: ours median {statistics.median(o):.3f} s/step (n={len(o)}, ~{o_tok:.0f} tokens/step); "
                  f"trl median {statistics.median(t):.3f} s/step (n={len(t)}, ~{t_tok:.0f} tokens/step); "
                  f"ratio {statistics.median(o) / statistics.median(t):.3f}", flush=True)
    mo, mt = statistics.median(ours), statistics.median(trl)
    print(f"ours_s_per_step={mo:.4f} trl_s_per_step={mt:.4f} ratio={mo / mt:.3f}")


if __name__ == "__main__":
    main()
