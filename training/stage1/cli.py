"""Command line of stage 1, shared by `aftraj train stage1` and `python -m training.stage1`.

    aftraj train stage1 --config configs/stage1/tiny-cpu.yaml [--data DIR] [--out DIR] [--resume]
    python -m training.stage1 --config configs/stage1/smollm2-135m-cpu.yaml --max-steps 3
    aftraj train stage1 --phase preferences --config CFG --out DIR      # one process: sample, cache
    accelerate launch --config_file configs/accelerate/fsdp-2xh200.yaml -m training.stage1 \
        --phase train --config CFG --out DIR                             # reads the cache only
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="stage-1 YAML (configs/stage1/*.yaml)")
    p.add_argument("--data", help="corpus folder (train.jsonl, else corpus.jsonl) or JSONL file; "
                                  "overrides the config's `data`")
    p.add_argument("--out", help="run folder; overrides the config's `output_dir`")
    p.add_argument("--model", help="local model folder or builtin:NAME; overrides `model`")
    p.add_argument("--phase", choices=("all", "preferences", "train"), default="all",
                   help="preferences: sample and cache the preference pairs (one process, GPU or "
                        "endpoint); train: train from the cache only (what `accelerate launch` runs); "
                        "all (default, one process only): preferences if not cached, then train")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    p.add_argument("--max-steps", type=int, help="a fixed step count instead of the config's schedule "
                                                 "(sets `max_steps`, clears `num_epochs`)")
    p.add_argument("--stop-at-step", type=int,
                   help="save a checkpoint at this step and stop (the schedule still spans max_steps)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key (VALUE parsed as YAML), repeatable")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (overrides applied) as JSON and exit")


def run(args) -> int:
    from aftraj.config import cli_overrides
    from training.stage1.config import load_stage1_config
    from training.stage1.trainer import sample_preferences, train

    over = cli_overrides(args, {"data": "data", "output_dir": "out", "model": "model", "max_steps": "max_steps"})
    if args.max_steps is not None:
        over["num_epochs"] = None
    cfg = load_stage1_config(args.config, over)    # ConfigError, OSError: the CLI's user-error rule
    if args.print_config:
        print(json.dumps(cfg.to_dict()))
        return 0
    if args.phase == "preferences":
        stats = sample_preferences(cfg)
        print(json.dumps({"output_dir": cfg.output_dir, "phase": "preferences",
                          "n_prompts": stats.get("n_prompts"), "n_samples": stats.get("n_samples"),
                          "sampling_seconds": stats.get("sampling_seconds")}))
        return 0
    res = train(cfg, resume=args.resume, stop_at_step=args.stop_at_step, progress=not args.no_progress,
                phase=args.phase)
    last = res.history[-1] if res.history else {}
    print(json.dumps({"output_dir": str(res.output_dir), "last_step": res.last_step,
                      "final": str(res.final_dir) if res.final_dir else None,
                      "loss_first": res.history[0]["loss"] if res.history else None,
                      "loss_last": last.get("loss")}))
    return 0


def main(argv: list[str] | None = None) -> int:
    from aftraj.guard import run_guarded

    p = argparse.ArgumentParser(prog="python -m training.stage1", description="Stage 1: BPPO training")
    add_arguments(p)
    return run_guarded(run, p.parse_args(argv), "python -m training.stage1")
