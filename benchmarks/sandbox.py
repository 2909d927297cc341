"""Benchmark the unit-test sandbox: wall time per sample (one fresh confined process each) for
trivial samples, per isolation mode, with one worker and with two.

    .venv/bin/python benchmarks/sandbox.py                  # 300 samples
    .venv/bin/python benchmarks/sandbox.py --n 1000 --workers 1 2

Last line per mode: isolation=… workers=… samples=… ms_per_sample=… (wall clock, start-up of the
runner included, cache cold).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aftraj.corpus.sandbox import Sandbox  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--isolation", nargs="+", default=["namespaces", "none"])
    args = ap.parse_args()
    items = [(f"def f(x):\n    return x + {i}\n", (f"assert f(1) == {i + 1}", "assert f(0) >= 0")) for i in range(args.n)]
    for iso in args.isolation:
        for w in args.workers:
            with Sandbox(timeout_s=2, isolation="auto" if iso == "namespaces" else iso, workers=w) as sb:
                if iso == "namespaces" and sb.isolation != "namespaces":
                    print("isolation=namespaces unavailable here: skipped")
                    break
                t0 = time.perf_counter()
                runs = sb.run_many(items)
                dt = time.perf_counter() - t0
            assert all(r.passed for r in runs), [r.results for r in runs if not r.passed][:3]
            print(f"isolation={iso} workers={w} samples={args.n} ms_per_sample={1000 * dt / args.n:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
