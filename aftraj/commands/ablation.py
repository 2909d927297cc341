"""`aftraj ablation --config configs/ablation/NAME.yaml --out DIR [--report DIR] [--set KEY=VALUE]`
and `aftraj ablation floors --data DIR [--ww who_and_when] [--out FILE]`

The ablation table in one command (aftraj/drivers/ablation.py): corpus, base model, format
warm-up, stage 1, stage 2, stage 1 + 2 (checkpoints chosen on the validation split), evaluation of
every row on one stratified held-out sample and one Who&When sample beside every floor and `rules`;
writes REPORT/ablation.md, ablation.json and comparison plots. Phases already done in DIR are
skipped, so an interrupted run resumes where it stopped.

`floors` prints the floors' table of a built corpus folder (eval/floors.py:
`floors_report`): every floor (position prior, length, error words, bag of words, structure) fit
on its train split, thresholds on val, scored on val and test with intervals, on Who&When per
subset with `--ww`, and the probe's bag of words of step k* on the kind-matched held-out pairs.

    aftraj ablation --config configs/ablation/cpu.yaml --out runs/ablation-cpu
    aftraj ablation --config configs/ablation/quick.yaml --out out/quick --report out/quick/report
    aftraj ablation floors --data out/aftraj-2k --ww who_and_when --out out/aftraj-2k/floors.json
"""

from __future__ import annotations

import sys
from pathlib import Path

from aftraj.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser("ablation", help="warm-up, stage 1, stage 2, evaluation: the ablation table; "
                                        "`ablation floors --data DIR`: the floors' table of a corpus")
    actions = p.add_subparsers(dest="action", metavar="floors")
    f = actions.add_parser("floors", help="every floor fit on a corpus's train split (thresholds on val), "
                                          "scored on val, test and Who&When")
    f.add_argument("--data", required=True, help="a built corpus folder (train.jsonl, val.jsonl, test.jsonl)")
    f.add_argument("--ww", metavar="PATH", help="also score the floors on this Who&When folder or file "
                                                "(evaluation only; e.g. who_and_when)")
    f.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default 1000)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--no-probe", action="store_true", help="leave out the probe's bag of words of step k*")
    f.add_argument("--out", help="also write the figures to this JSON file")
    f.set_defaults(func=run_floors, _parser=f)
    p.add_argument("--config", help="configs/ablation/<name>.yaml (required)")
    p.add_argument("--out", help="run folder (phases, checkpoints, evaluations, logs; required)")
    p.add_argument("--report", help="where ablation.md, ablation.json and plots go (default OUT/report)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (YAML value), e.g. --set heldout_sample=16")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=run, _parser=p)


def run(args) -> int:
    import dataclasses

    import yaml

    from aftraj.drivers.ablation import Ablation, PhaseFailed, load_config
    from aftraj.config import parse_set

    if not args.config:
        raise UsageError("aftraj ablation: --config is required (or `aftraj ablation floors --data DIR`)")
    cfg = load_config(args.config, parse_set(args.set))
    if args.print_config:
        print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), end="")
        return 0
    if not args.out:
        raise UsageError("aftraj ablation: --out is required (the run folder)")
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


def run_floors(args) -> int:
    import json

    from eval.floors import floors_markdown, floors_report

    if not Path(args.data).is_dir():
        raise UsageError(f"--data {args.data}: not a folder (a built corpus folder with train/val/test.jsonl)")
    if args.n_boot < 0:
        raise UsageError(f"--n-boot must be >= 0, got {args.n_boot}")
    try:
        res = floors_report(args.data, ww=args.ww, n_boot=args.n_boot, seed=args.seed, probe=not args.no_probe)
    except ValueError as e:      # no train/val split, a Who&When run in train: the floors' own messages
        raise UsageError(f"--data {args.data}: {e}") from None
    print(floors_markdown(res), end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        print(f"figures: {args.out}")
    return 0
