"""Command line of stage 2, shared by `aftraj train stage2` and `python -m training.stage2`.

    aftraj train stage2 --engine trl --config configs/stage2/tiny-cpu.yaml [--init STAGE1_DIR] [--out DIR] [--resume]
    aftraj train stage2 --engine verl --config configs/stage2/qwen2.5-7b-8xh200.yaml --init STAGE1_DIR --dry-run
"""

from __future__ import annotations

import argparse
import json
import sys

ENGINES = ("trl", "verl")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=ENGINES, default="trl",
                   help="trl: TRL GRPOTrainer on this machine (CPU or one GPU); verl: the verl recipe "
                        "(GPU nodes; its own environment, scripts/setup_verl.sh)")
    p.add_argument("--config", required=True, help="stage-2 YAML (configs/stage2/*.yaml)")
    p.add_argument("--init", help="stage-1 checkpoint folder (policy and KL reference); overrides `model`")
    p.add_argument("--data", help="corpus folder or JSONL file; overrides the config's `data`")
    p.add_argument("--out", help="run folder; overrides the config's `output_dir`")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    p.add_argument("--max-steps", type=int, help="override `max_steps`")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key (VALUE parsed as YAML), repeatable")
    p.add_argument("--dry-run", action="store_true",
                   help="verl: build the data and print the verl command line without running it")
    p.add_argument("--verl-python", default=None,
                   help="verl: the Python of verl's environment (default: .venv-verl/bin/python)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from aftraj.config import cli_overrides
    from aftraj.config import ConfigError
    from training.stage2.config import load_stage2_config

    over = cli_overrides(args, {"data": "data", "output_dir": "out", "model": "init", "max_steps": "max_steps"})
    try:
        cfg = load_stage2_config(args.config, over)
    except (ConfigError, FileNotFoundError) as e:
        print(f"stage2: {e}", file=sys.stderr)
        return 2
    if args.engine == "verl":
        from training.stage2.verl_engine import run_verl

        return run_verl(cfg, dry_run=args.dry_run, resume=args.resume, python=args.verl_python)
    if args.dry_run:
        print("stage2: --dry-run is for --engine verl (the TRL path runs in this process)", file=sys.stderr)
        return 2
    from training.stage2.trl_engine import train

    try:
        res = train(cfg, resume=args.resume, progress=not args.no_progress)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"stage2: {e}", file=sys.stderr)
        return 2
    last = res.history[-1] if res.history else {}
    print(json.dumps({"output_dir": str(res.output_dir), "last_step": res.last_step,
                      "final": str(res.final_dir) if res.final_dir else None,
                      "reward_last": last.get("reward"), "kl_last": last.get("kl")}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.stage2", description="Stage 2: GRPO training")
    add_arguments(p)
    return run(p.parse_args(argv))
