"""Subcommands of the `aftraj` console script. Each module here defines
`register(subparsers)`, adds its parser and sets `func`; `aftraj.cli` finds them all, so a new
subcommand is a new file, not an edit to a dispatch table."""

from aftraj.console import quiet_libraries

quiet_libraries()   # only the console script imports this package: library notices stay out of it
