"""Command line of the format warm-up (NOT part of the paper's recipe):

    aftraj train warmup --config configs/warmup/smollm2-135m-cpu.yaml --data CORPUS --out RUN \
        [--model PATH] [--max-steps N] [--set KEY=VALUE] [--no-progress]
    aftraj train warmup --config CFG --data CORPUS --out DIR --check-only   # parse rate of --model (raw base)
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="warm-up YAML (configs/warmup/*.yaml)")
    p.add_argument("--data", help="corpus folder (train.jsonl + val.jsonl) or JSONL; overrides `data`")
    p.add_argument("--out", help="run folder; overrides `output_dir`")
    p.add_argument("--model", help="local model folder or builtin:NAME; overrides `model`")
    p.add_argument("--max-steps", type=int, help="overrides `max_steps`")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key (VALUE parsed as YAML), repeatable")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--check-only", action="store_true",
                   help="no training: the parse check alone on the model (e.g. the raw base), same "
                        "val prefixes; writes OUT/parse_check.json")


def run(args) -> int:
    from aftraj.config import cli_overrides
    from training.warmup.config import load_warmup_config
    from training.warmup.trainer import check_model, warmup

    over = cli_overrides(args, {"data": "data", "output_dir": "out", "model": "model", "max_steps": "max_steps"})
    cfg = load_warmup_config(args.config, over)
    if args.check_only:
        print(json.dumps(check_model(cfg)))
        return 0
    stats = warmup(cfg, progress=not args.no_progress)
    print(json.dumps({k: stats[k] for k in ("final", "steps", "seconds_per_step", "loss_first",
                                             "loss_last", "n", "parse_rate", "failure_codes")}))
    return 0
