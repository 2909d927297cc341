"""Moved: `parse_set` and `cli_overrides` live in `aftraj.config` (the one config layer). This
name stays only until the last importers (training/*/cli.py, aftraj/commands/ablation.py) are
committed with `from aftraj.config import ...`; then it is deleted."""

from aftraj.config import cli_overrides, parse_set

__all__ = ["cli_overrides", "parse_set"]
