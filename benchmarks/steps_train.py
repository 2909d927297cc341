"""Throughput of step-scored decision training (`aftraj train steps`) on CPU: a short run on the
first runs of a corpus's train split (as many unsafe as safe), runs a minute and tokens a second,
and the projection for every train run of the corpus (an estimate from the measured rate and the
split's token count, labelled so). Nothing is exported (max_steps stops before the end).

    python benchmarks/steps_train.py --data /tmp/lead/base2k --runs 16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/steps/smollm2-135m-cpu.yaml")
    p.add_argument("--data", required=True, help="a corpus folder (train.jsonl)")
    p.add_argument("--runs", type=int, default=40, help="runs trained (half unsafe, half safe)")
    p.add_argument("--model", default=None)
    p.add_argument("--mixed-precision", choices=("no", "bf16", "auto"), default=None,
                   help="override the config's mixed_precision")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a loaded machine with few cores, spinning threads slow each other down)")
    a = p.parse_args()

    import torch

    torch.set_num_threads(a.threads)

    from aftraj.prompt import step_reading
    from aftraj.readers import load_trajectories
    from training.common import load_tokenizer
    from aftraj.models import resolve_model_spec
    from training.steps.config import load_steps_config
    from training.steps.trainer import train

    out = tempfile.mkdtemp(prefix="steps-bench-")
    over = {"data": a.data, "output_dir": out, "max_unsafe_runs": a.runs // 2, "max_safe_runs": a.runs // 2,
            "heldout_split": None, "save_steps": 0, "warmup_steps": 0}
    if a.model:
        over["model"] = a.model
    if a.mixed_precision:
        over["mixed_precision"] = a.mixed_precision
    cfg = load_steps_config(a.config, over)
    cfg.max_steps = -(-a.runs // cfg.runs_per_step)
    t0 = time.perf_counter()
    res = train(cfg)
    wall = time.perf_counter() - t0
    d = res.data
    # the whole split's tokens as training reads them (unsafe runs to k*, safe runs whole)
    tok = load_tokenizer(resolve_model_spec(cfg.model))
    trajs = load_trajectories(os.path.join(a.data, "train.jsonl"), "jsonl")
    t1 = time.perf_counter()
    total = 0
    for t in trajs:
        last = t.label.decisive_step if t.label.unsafe else None
        total += sum(len(s.ids) for s in step_reading(tok, t, last, **cfg.reading()).segments)
    tokenize_all_s = time.perf_counter() - t1
    tok_per_s = d["tokens_trained"] / max(d["train_s"], 1e-3)
    proj = total / tok_per_s
    print(json.dumps({
        "runs_trained": d["runs_trained"], "steps": d["steps"], "tokens_trained": d["tokens_trained"],
        "trunk_tokens_run": d.get("trunk_tokens_run"), "trunk_tokens_reused": d.get("trunk_tokens_reused"),
        "train_s": d["train_s"],
        "runs_per_minute": d["runs_per_minute"], "tokens_per_s": round(tok_per_s, 1),
        "mixed_precision": d["mixed_precision"], "torch_threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "peak_rss_gib": d["peak_rss_gib"], "wall_s_with_setup": round(wall, 1),
        "split_runs": len(trajs), "split_tokens": total, "tokenize_split_s": round(tokenize_all_s, 1),
        "estimate_one_epoch_all_runs_min": round(proj / 60, 1),
        "estimate_note": "split tokens / measured tokens a second (training only; plus tokenising, and "
                         "scoring the val split in float32); shared beginnings make the real rate per token higher "
                         "where more twins share a step"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
