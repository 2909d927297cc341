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


def run(args) -> int:
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
