"""Command line of every-prefix decision training, shared by `aftraj train prefixes` and
`python -m training.prefixes`.

    aftraj train prefixes --config configs/prefixes/smollm2-135m-cpu.yaml --data CORPUS --model STAGE1 --out RUN
"""

from __future__ import annotations

import argparse
import json

from training import decision


def add_arguments(p: argparse.ArgumentParser) -> None:
    decision.add_arguments(p, configs="configs/prefixes/*.yaml", data="train.jsonl", model=" (e.g. stage 1's final/)")
    decision.add_output_arguments(p)


def run(args) -> int:
    from training.prefixes.config import load_prefixes_config
    from training.prefixes.trainer import train

    cfg, printed = decision.config_from_args(args, load_prefixes_config)
    if printed:
        return 0
    res = train(cfg, progress=not args.no_progress)
    print(json.dumps(decision.summary(res, len(res.history), peak_rss_gib=res.data["peak_rss_gib"])))
    return 0


def main(argv: list[str] | None = None) -> int:
    from aftraj.guard import run_guarded

    p = argparse.ArgumentParser(prog="python -m training.prefixes", description="Every-prefix decision training")
    add_arguments(p)
    return run_guarded(run, p.parse_args(argv), "python -m training.prefixes")
