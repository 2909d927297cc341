"""The one rule for errors, for every entry point (`aftraj`, `python -m training.stage1`, …): an
error a user can cause is one line on stderr naming what was wrong and exit status 2; anything
else is a bug: a traceback, a request to report it, exit status 1.

A user error is a `UsageError` (aftraj/errors.py: the config, schema, prompt-budget, auditor and
sandbox errors subclass it) or what the operating system or the input's encoding refuses
(OSError, UnicodeError, RecursionError). Library code raises those; no command catches them itself.

    from aftraj.guard import run_guarded
    sys.exit(run_guarded(main, args, "python -m training.stage1"))
"""

from __future__ import annotations

import sys
import traceback

from aftraj.errors import UsageError

USER_ERRORS: tuple[type[BaseException], ...] = (UsageError, OSError, UnicodeError, RecursionError)
BUG_HINT = ("this is a bug in aftraj, not in your input: please report it with the command line "
            "and the traceback above")


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


def run_guarded(func, args, name: str) -> int:
    """Run `func(args)`; a user error is one line naming what was wrong (exit 2), anything else a
    traceback with a request to report it (exit 1)."""
    try:
        return int(func(args) or 0)
    except BrokenPipeError:  # `aftraj inspect … | head`
        return 0
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if isinstance(e, USER_ERRORS):
            print(f"{name}: {describe(e)}", file=sys.stderr)
            return 2
        traceback.print_exc()
        print(f"{name}: {BUG_HINT}", file=sys.stderr)
        return 1
