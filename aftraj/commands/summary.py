"""`aftraj summary PATH [--json]`: per-subset summary of a dataset (JSONL, Who&When, AFTraj parquet)."""

from __future__ import annotations

import json

from aftraj.readers import iter_trajectories
from aftraj.summary import format_summary, summarise


def register(sub) -> None:
    p = sub.add_parser("summary", help="per-subset summary: trajectories, steps, agents, tokens, labels")
    p.add_argument("path", help="JSONL file, Who&When folder, AFTraj parquet folder or corpus folder")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    import os
    import stat

    from aftraj.errors import UsageError
    try:
        mode = os.stat(args.path).st_mode
    except OSError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        # /dev/zero, a FIFO: a line-by-line read would wait (or grow) forever
        raise UsageError(f"{args.path}: not a regular file or folder")
    s = summarise(iter_trajectories(args.path))
    print(json.dumps(s, indent=2) if args.json else format_summary(s))
    return 0
