"""`aftraj train stage1 --config CFG [--data DIR] [--out DIR] [--resume]` (and later stages).

Each stage's arguments live next to its code (`training.<stage>.cli`: `add_arguments`, `run`);
a stage whose package is not installed is simply not offered.

    aftraj train stage1 --config configs/stage1/tiny-cpu.yaml --out runs/stage1-tiny
"""

from __future__ import annotations

import importlib

STAGES = {"stage1": "BPPO on boundary pairs (DESIGN §5)", "stage2": "GRPO (DESIGN §5)"}


def register(sub) -> None:
    p = sub.add_parser("train", help="train the auditor (stage1: BPPO, stage2: GRPO)")
    stages = p.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, help_text in STAGES.items():
        try:
            cli = importlib.import_module(f"training.{name}.cli")
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith(f"training.{name}"):
                continue
            raise
        sp = stages.add_parser(name, help=help_text)
        cli.add_arguments(sp)
        sp.set_defaults(func=cli.run)
