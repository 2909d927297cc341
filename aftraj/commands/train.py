"""`aftraj train stage1 --config CFG [--data DIR] [--out DIR] [--resume]` (and later stages).

Each stage's arguments live next to its code (`training.<stage>.cli`: `add_arguments`, `run`; a
stage that joins packages runs through a driver's `run`); a stage whose package is not installed
is simply not offered.

    aftraj train stage1 --config configs/stage1/tiny-cpu.yaml --out runs/stage1-tiny
"""

from __future__ import annotations

import importlib

STAGES = {"warmup": "format warm-up, NOT in the paper (issue 11)",
          "stage1": "BPPO on boundary pairs (DESIGN §5)", "stage2": "GRPO (DESIGN §5)",
          "prefixes": "decision training on every prefix, NOT in the paper (issue 21)",
          "steps": "step-scored decision training, one forward a run, NOT in the paper (issue 44)"}
# a stage whose command joins packages runs through a driver (training, then eval's calibration)
CLI = {"steps": "aftraj.drivers.steps"}


def register(sub) -> None:
    found = {}
    for name in STAGES:
        try:
            found[name] = (importlib.import_module(f"training.{name}.cli"),
                           importlib.import_module(CLI.get(name, f"training.{name}.cli")))
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith((f"training.{name}", CLI.get(name, "-"))):
                continue
            raise
    # `aftraj --help` names only the stages that exist
    p = sub.add_parser("train", help="train the auditor ("
                       + ", ".join(f"{n}: {STAGES[n].split(' ')[0]}" for n in found) + ")")
    stages = p.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, (cli, runner) in found.items():
        sp = stages.add_parser(name, help=STAGES[name])
        cli.add_arguments(sp)
        sp.set_defaults(func=runner.run)
