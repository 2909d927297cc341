"""Command line of step-scored decision training (the training half of `aftraj train steps`, which
then calibrates the walk's threshold on the held-out rows: aftraj/drivers/steps.py).

    aftraj train steps --config configs/steps/smollm2-135m-cpu.yaml --data CORPUS --out RUN
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML (configs/steps/*.yaml)")
    p.add_argument("--data", help="corpus folder (train.jsonl, val.jsonl) or JSONL file; overrides `data`")
    p.add_argument("--out", help="run folder; overrides `output_dir`")
    p.add_argument("--model", help="local model folder or builtin:NAME; overrides `model`")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key (VALUE parsed as YAML), repeatable")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/ (needs save_steps)")
    p.add_argument("--no-progress", action="store_true", help="no per-step lines")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")


def train_from_args(args):
    """(config, StepsResult or None with --print-config)."""
    from aftraj.config import cli_overrides
    from training.steps.config import load_steps_config
    from training.steps.trainer import train

    cfg = load_steps_config(args.config, cli_overrides(args, {"data": "data", "output_dir": "out", "model": "model"}))
    if args.print_config:
        print(json.dumps(cfg.to_dict()))
        return cfg, None
    return cfg, train(cfg, progress=not args.no_progress, resume=args.resume)


def summary(res) -> dict:
    d = res.data
    return {"output_dir": str(res.output_dir), "final": str(res.final_dir) if res.final_dir else None,
            "steps": d.get("steps"), "loss_first": res.history[0]["loss"] if res.history else None,
            "loss_last": res.history[-1]["loss"] if res.history else None, "rows": d["rows"],
            "alarm_rows": d["alarm_rows"], "runs_per_minute": d.get("runs_per_minute"),
            "peak_rss_gib": d.get("peak_rss_gib")}
