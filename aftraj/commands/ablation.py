"""`aftraj ablation --config configs/ablation/NAME.yaml --out DIR [--report DIR] [--set KEY=VALUE]`

The ablation table in one command (eval/ablation.py): corpus, base model, format warm-up,
stage 1, stage 2, stage 1 + 2 (checkpoints chosen on the validation split), evaluation of every
row on one stratified held-out sample and one Who&When sample beside the floors and `rules`;
writes REPORT/ablation.md, ablation.json and comparison plots. Phases already done in DIR are
skipped, so an interrupted run resumes where it stopped.

    aftraj ablation --config configs/ablation/cpu.yaml --out runs/ablation-cpu
    aftraj ablation --config configs/ablation/quick.yaml --out out/quick --report out/quick/report
"""

from __future__ import annotations

import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("ablation", help="warm-up, stage 1, stage 2, evaluation: the ablation table")
    p.add_argument("--config", required=True, help="configs/ablation/<name>.yaml")
    p.add_argument("--out", required=True, help="run folder (phases, checkpoints, evaluations, logs)")
    p.add_argument("--report", help="where ablation.md, ablation.json and plots go (default OUT/report)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (YAML value), e.g. --set heldout_sample=16")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=run)


def run(args) -> int:
    import dataclasses

    import yaml

    from aftraj.drivers.ablation import Ablation, PhaseFailed, load_config
    from aftraj.config import parse_set

    cfg = load_config(args.config, parse_set(args.set))
    if args.print_config:
        print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), end="")
        return 0
    ab = Ablation(cfg, Path(args.out), report=Path(args.report) if args.report else None,
                  config_path=args.config)
    try:
        summary = ab.run()
    except PhaseFailed as e:
        print(f"aftraj ablation: {e}", file=sys.stderr)
        return 3
    print((ab.report / "ablation.md").read_text(encoding="utf-8"))
    print(f"report: {ab.report / 'ablation.md'} (+ ablation.json, compare-*/compare.png); "
          f"phases {sum(p['wall_s'] for p in summary['phases']) / 60:.1f} min")
    return 0
