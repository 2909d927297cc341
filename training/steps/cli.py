"""Command line of step-scored decision training (the training half of `aftraj train steps`, which
then calibrates the walk's threshold on the held-out rows: aftraj/drivers/steps.py).

    aftraj train steps --config configs/steps/smollm2-135m-cpu.yaml --data CORPUS --out RUN
"""

from __future__ import annotations

import argparse

from training import decision


def add_arguments(p: argparse.ArgumentParser) -> None:
    decision.add_arguments(p, configs="configs/steps/*.yaml", data="train.jsonl, val.jsonl", model="")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/ (needs save_steps)")
    decision.add_output_arguments(p)


def train_from_args(args):
    """(config, StepsResult or None with --print-config)."""
    from training.steps.config import load_steps_config
    from training.steps.trainer import train

    cfg, printed = decision.config_from_args(args, load_steps_config)
    if printed:
        return cfg, None
    return cfg, train(cfg, progress=not args.no_progress, resume=args.resume)


def summary(res) -> dict:
    d = res.data
    return decision.summary(res, d.get("steps"), runs_per_minute=d.get("runs_per_minute"),
                            peak_rss_gib=d.get("peak_rss_gib"))
