"""The `aftraj` console script: one entry point, subcommands discovered in `aftraj.commands`.

One rule for errors (`aftraj.guard.run_guarded`, shared with every other entry point): an
error a user can cause (a UsageError, OSError, ...) prints one line naming what was wrong and
exits 2; anything else is a bug: a traceback, a request to report it, exit 1.

    aftraj --help
    aftraj --version
    python -m aftraj.cli convert --from whoandwhen who_and_when --out ww.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import aftraj.commands
from aftraj.guard import run_guarded


def version() -> str:
    """The installed distribution's version (`agentforesight`), else the source tree's
    (`aftraj.__version__`, e.g. run from a checkout without `pip install -e`)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("agentforesight")
    except PackageNotFoundError:
        import aftraj

        return aftraj.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aftraj", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"aftraj {version()}",
                        help="print the installed version (agentforesight) and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(aftraj.commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"aftraj.commands.{info.name}").register(sub)
    return parser


def _command(args) -> str:
    parts = [args.command] + [getattr(args, k) for k in ("corpus_command", "stage", "action")
                              if isinstance(getattr(args, k, None), str)]
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(args.func, args, f"aftraj {_command(args)}")


if __name__ == "__main__":
    sys.exit(main())
