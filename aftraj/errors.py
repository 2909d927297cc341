"""Errors a user can cause, as opposed to bugs.

`UsageError`: a bad path, option value or combination, raised by library code as well as by the
commands. `aftraj.guard.run_guarded` (every entry point) turns it, OSError and the other listed
types into one line on stderr and exit status 2; anything else is a bug and gets a traceback and a
request to report it. Every config error is `aftraj.config.ConfigError`, a UsageError naming the
file and the dotted key.

    from aftraj.errors import UsageError
    raise UsageError("--prompt 12 is outside the trajectory (steps 0..7)")
"""

from __future__ import annotations


class UsageError(ValueError):
    """Something the user asked for cannot be done as asked; the message says what and why."""
