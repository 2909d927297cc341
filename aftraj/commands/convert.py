"""`aftraj convert --from {whoandwhen,aftraj-parquet,jsonl} SRC --out DST.jsonl [--skip-invalid]`"""

from __future__ import annotations

import sys

from aftraj.readers import FORMATS, iter_trajectories
from aftraj.schema import ReadReport, write_jsonl


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert Who&When, AFTraj parquet or JSONL into our JSONL")
    p.add_argument("--from", dest="fmt", choices=FORMATS, required=True, help="source layout")
    p.add_argument("src", help="source file or folder")
    p.add_argument("--out", required=True, help="destination .jsonl")
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip (and count) bad records instead of stopping at the first")
    p.set_defaults(func=run)


def run(args) -> int:
    report = ReadReport()
    n = write_jsonl(iter_trajectories(args.src, args.fmt, skip_invalid=args.skip_invalid,
                                      report=report), args.out)
    for e in report.errors:
        print(f"skipped: {e}", file=sys.stderr)
    print(f"converted {n} trajectories from {args.src} ({args.fmt}) to {args.out}; "
          f"skipped {report.n_skipped} invalid")
    return 0
