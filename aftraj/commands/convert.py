"""`aftraj convert --from {whoandwhen,aftraj-parquet,jsonl} SRC --out DST.jsonl [--skip-invalid]`

Agent-framework runs (aftraj/adapters/): `aftraj convert --from {autogen,smolagents,openai-agents,otel}
SRC --out DST.jsonl`."""

from __future__ import annotations

import sys

from aftraj.adapters import ADAPTERS, AdapterError, read_runs
from aftraj.readers import FORMATS, iter_trajectories
from aftraj.schema import ReadReport, write_jsonl


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert Who&When, AFTraj parquet, JSONL or agent-framework runs into our JSONL")
    p.add_argument("--from", dest="fmt", choices=FORMATS + tuple(ADAPTERS), required=True, help="source layout")
    p.add_argument("src", help="source file or folder")
    p.add_argument("--out", required=True, help="destination .jsonl")
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip (and count) bad records instead of stopping at the first")
    p.set_defaults(func=run)


def _check_out(args) -> None:
    """The destination's folder must exist (never created on the user's behalf: a typo made a
    folder), and the destination must not be the source (it was overwritten, input lost)."""
    import os

    from aftraj.errors import UsageError

    out = os.path.abspath(args.out)
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise UsageError(f"--out {args.out}: the folder {parent} does not exist (create it first)")
    if os.path.isdir(out):
        raise UsageError(f"--out {args.out}: is a folder; give the .jsonl file to write")
    src = os.path.abspath(args.src)
    if os.path.exists(out) and os.path.exists(src) and os.path.samefile(out, src):
        raise UsageError(f"--out {args.out}: is the input itself; it would be overwritten while it is read")


def run(args) -> int:
    _check_out(args)
    if args.fmt in ADAPTERS:
        return _run_adapter(args)
    report = ReadReport()
    n = write_jsonl(iter_trajectories(args.src, args.fmt, skip_invalid=args.skip_invalid,
                                      report=report), args.out)
    for e in report.errors:
        print(f"skipped: {e}", file=sys.stderr)
    print(f"converted {n} trajectories from {args.src} ({args.fmt}) to {args.out}; "
          f"skipped {report.n_skipped} invalid")
    return 0


def _run_adapter(args) -> int:
    if args.skip_invalid:
        print(f"error: --skip-invalid reads trajectory files; a {args.fmt} file is one export, read whole",
              file=sys.stderr)
        return 2
    try:
        trajs = read_runs(args.src, args.fmt)
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = write_jsonl(trajs, args.out)
    print(f"converted {n} runs from {args.src} ({args.fmt}) to {args.out}")
    return 0
