"""Subcommands of the `aftraj` console script. Each module here defines
`register(subparsers)`, adds its parser and sets `func`; `aftraj.cli` finds them all, so a new
subcommand is a new file, not an edit to a dispatch table."""
