"""`aftraj export --to aftraj-parquet SRC --out DIR [--from FORMAT] [--skip-invalid]`

Write any trajectories we can read (our JSONL, a corpus folder, Who&When, AFTraj parquet) in the
released AFTraj-2K layout: aftraj_safe.parquet, aftraj_unsafe.parquet, splits_test.json (plus
splits.json / families.json for our train/val/test families). A file read from the release
comes back with equal rows.

    aftraj export --to aftraj-parquet runs/aftraj-2k/corpus.jsonl --out runs/aftraj-2k-released
"""

from __future__ import annotations

import sys

TARGETS = ("aftraj-parquet",)


def register(sub) -> None:
    from aftraj.readers import FORMATS

    p = sub.add_parser("export", help="write trajectories in the released AFTraj-2K parquet layout")
    p.add_argument("--to", choices=TARGETS, required=True, help="target layout")
    p.add_argument("src", help="source file or folder (format detected unless --from)")
    p.add_argument("--from", dest="fmt", choices=("auto",) + FORMATS, default="auto", help="source layout")
    p.add_argument("--out", required=True, help="destination folder")
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip (and count) bad records instead of stopping at the first")
    p.set_defaults(func=run)


def run(args) -> int:
    from aftraj.released import write_aftraj_parquet
    from aftraj.readers import load_trajectories
    from aftraj.schema import ReadReport

    report = ReadReport()
    trajs = load_trajectories(args.src, args.fmt, skip_invalid=args.skip_invalid, report=report)
    counts = write_aftraj_parquet(trajs, None, args.out)
    for e in report.errors:
        print(f"skipped: {e}", file=sys.stderr)
    print(f"exported {len(trajs)} trajectories from {args.src} to {args.out} "
          f"({counts['aftraj_safe.parquet']} safe, {counts['aftraj_unsafe.parquet']} unsafe); "
          f"skipped {report.n_skipped} invalid")
    return 0
