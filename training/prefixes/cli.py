"""Command line of every-prefix decision training, shared by `aftraj train prefixes` and
`python -m training.prefixes`.

    aftraj train prefixes --config configs/prefixes/smollm2-135m-cpu.yaml --data CORPUS --model STAGE1 --out RUN
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML (configs/prefixes/*.yaml)")
    p.add_argument("--data", help="corpus folder (train.jsonl) or JSONL file; overrides `data`")
    p.add_argument("--out", help="run folder; overrides `output_dir`")
    p.add_argument("--model", help="local model folder or builtin:NAME (e.g. stage 1's final/); overrides `model`")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key (VALUE parsed as YAML), repeatable")
    p.add_argument("--no-progress", action="store_true", help="no per-step lines")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")


def run(args) -> int:
    from aftraj.config import cli_overrides
    from training.prefixes.config import load_prefixes_config
    from training.prefixes.trainer import train

    cfg = load_prefixes_config(args.config, cli_overrides(args, {"data": "data", "output_dir": "out",
                                                                 "model": "model"}))
    if args.print_config:
        print(json.dumps(cfg.to_dict()))
        return 0
    res = train(cfg, progress=not args.no_progress)
    print(json.dumps({"output_dir": str(res.output_dir), "final": str(res.final_dir),
                      "steps": len(res.history), "loss_first": res.history[0]["loss"] if res.history else None,
                      "loss_last": res.history[-1]["loss"] if res.history else None,
                      "rows": res.data["rows"], "alarm_rows": res.data["alarm_rows"],
                      "peak_rss_gib": res.data["peak_rss_gib"]}))
    return 0


def main(argv: list[str] | None = None) -> int:
    from aftraj.guard import run_guarded

    p = argparse.ArgumentParser(prog="python -m training.prefixes", description="Every-prefix decision training")
    add_arguments(p)
    return run_guarded(run, p.parse_args(argv), "python -m training.prefixes")
