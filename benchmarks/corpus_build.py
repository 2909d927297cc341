"""Benchmark the corpus build: build a config twice with the same seed, time each build, and
check that the two output folders are byte-identical.

    .venv/bin/python benchmarks/corpus_build.py                       # the 2k scripted corpus
    .venv/bin/python benchmarks/corpus_build.py --config configs/corpus/demo-small.yaml --keep out/bench

Last line: trajectories=… seconds=… per_s=… identical=true|false (seconds: the first build,
wall clock, including every export).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aftraj.corpus.build import build_corpus  # noqa: E402
from aftraj.corpus.config import load_corpus_config  # noqa: E402


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs/corpus/aftraj-2k-scripted.yaml"))
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", default=None, help="write the first build here (default: a temporary folder)")
    args = ap.parse_args()
    cfg = load_corpus_config(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        first = Path(args.keep) if args.keep else Path(tmp) / "a"
        second = Path(tmp) / "b"
        times = []
        for out in (first, second):
            t0 = time.perf_counter()
            res = build_corpus(cfg, out, seed=args.seed)
            times.append(time.perf_counter() - t0)
            tot = res.stats["total"]
            print(f"build into {out}: {tot['trajectories']} trajectories ({tot['safe']} safe, {tot['unsafe']} "
                  f"unsafe) in {times[-1]:.2f} s", flush=True)
        da, db = digest(first), digest(second)
        identical = da == db
        if not identical:
            diff = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))
            print(f"differing files: {diff[:10]}")
        n = res.stats["total"]["trajectories"]
        print(f"files={len(da)} second_build_seconds={times[1]:.2f}")
        print(f"trajectories={n} seconds={times[0]:.2f} per_s={n / times[0]:.1f} identical={str(identical).lower()}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
