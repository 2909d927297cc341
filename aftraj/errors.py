"""Errors a user can cause, as opposed to bugs.

`UsageError`: a bad path, option value or combination, raised by library code as well as by the
commands. The console script (`aftraj.cli.main`) turns it, and the other error types listed in
`aftraj.cli.USER_ERRORS` (schema, config, policy, prompt-budget errors, OSError, ...), into one
line on stderr and exit status 2; anything else is a bug and gets a traceback and a request to
report it.

    from aftraj.errors import UsageError
    raise UsageError("--prompt 12 is outside the trajectory (steps 0..7)")
"""

from __future__ import annotations


class UsageError(ValueError):
    """Something the user asked for cannot be done as asked; the message says what and why."""
