"""The `aftraj` console script: one entry point, subcommands discovered in `aftraj.commands`.

One rule for errors (`run_guarded`): an error a user can cause (the types in USER_ERRORS:
UsageError, SchemaError, config and policy errors, OSError, ...) prints one line naming what
was wrong and exits 2; anything else is a bug: a traceback, a request to report it, exit 1.

    aftraj --help
    python -m aftraj.cli convert --from whoandwhen who_and_when --out ww.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import traceback

import aftraj.commands
from aftraj.errors import UsageError
from aftraj.schema import SchemaError

# The one rule: an error a user can cause is one line on stderr and exit status 2; anything
# else is a bug (traceback, a request to report it, exit status 1). Error types from modules
# that may not be importable (training extras) are named by module and class, looked up only
# if that module was loaded (an exception of a class never loaded cannot have been raised).
USER_ERRORS: tuple[type[BaseException], ...] = (SchemaError, UsageError, OSError, UnicodeError, RecursionError)
USER_ERROR_NAMES = (("aftraj.corpus.config", "ConfigError"), ("aftraj.detectors", "PolicyError"),
                    ("aftraj.prompt", "PromptBudgetError"), ("aftraj.corpus.sandbox", "SandboxError"),
                    ("training.stage1.config", "ConfigError"), ("training.accelerate_config", "AccelerateConfigError"),
                    ("eval.auditors.openai", "AuditorError"), ("yaml", "YAMLError"),
                    ("pyarrow.lib", "ArrowException"))
BUG_HINT = ("this is a bug in aftraj, not in your input: please report it with the command line "
            "and the traceback above")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aftraj", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(aftraj.commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"aftraj.commands.{info.name}").register(sub)
    return parser


def user_error_types() -> tuple[type[BaseException], ...]:
    found = [getattr(sys.modules[m], c, None) for m, c in USER_ERROR_NAMES if m in sys.modules]
    return USER_ERRORS + tuple(t for t in found if isinstance(t, type))


def describe(e: BaseException) -> str:
    """One line naming what was wrong."""
    if isinstance(e, RecursionError):
        msg = "the input is nested too deeply to read"
    elif isinstance(e, UnicodeError):
        msg = f"the input holds text that is not valid Unicode (a lone surrogate?): {e}"
    elif isinstance(e, OSError) and e.strerror:
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
        msg = f"{where}: {e.strerror}" if where else e.strerror
    else:
        msg = str(e) or type(e).__name__
    return " ".join(msg.split("\n")).strip()


def _command(args) -> str:
    parts = [args.command] + [getattr(args, k) for k in ("corpus_command", "stage", "action")
                              if isinstance(getattr(args, k, None), str)]
    return " ".join(parts)


def run_guarded(func, args, name: str) -> int:
    """The one rule, for any entry point: run `func(args)`; a user error is one line naming
    what was wrong (exit 2), anything else a traceback with a request to report it (exit 1)."""
    try:
        return int(func(args) or 0)
    except BrokenPipeError:  # `aftraj inspect … | head`
        return 0
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if isinstance(e, user_error_types()):
            print(f"{name}: {describe(e)}", file=sys.stderr)
            return 2
        traceback.print_exc()
        print(f"{name}: {BUG_HINT}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(args.func, args, f"aftraj {_command(args)}")


if __name__ == "__main__":
    sys.exit(main())
