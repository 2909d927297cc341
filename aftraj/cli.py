"""The `aftraj` console script: one entry point, subcommands discovered in `aftraj.commands`.

    aftraj --help
    python -m aftraj.cli convert --from whoandwhen who_and_when --out ww.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import aftraj.commands
from aftraj.schema import SchemaError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aftraj", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(aftraj.commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"aftraj.commands.{info.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SchemaError as e:
        print(f"aftraj {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `aftraj inspect … | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
