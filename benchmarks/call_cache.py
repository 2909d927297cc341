"""What the per-call cache costs (eval/resume.py: `CallCache`, `CachedAuditor`): the strict walk of
an auditor bare, through the cache while it fills (every answer hashed and appended to
calls.jsonl), and replayed from the full cache (what `aftraj eval --resume` does for the calls a
killed run made). Records must be the same all three ways. The `rules` auditor answers in
microseconds, so its overhead is the worst case; a model call (`hf`, `openai`) takes seconds.

    python benchmarks/call_cache.py                                  # rules on the shipped Who&When
    python benchmarks/call_cache.py --auditor dummy:gold --data runs/aftraj-2k --split test
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--auditor", default="rules")
    ap.add_argument("--data", default=str(REPO / "eval" / "data" / "who_and_when"))
    ap.add_argument("--split")
    ap.add_argument("--all-prefixes", action="store_true", help="walk every prefix (more calls a run)")
    ap.add_argument("--repeat", type=int, default=3, help="best of N timings (default 3)")
    args = ap.parse_args(argv)

    from eval.auditors import get_auditor
    from eval.resume import CachedAuditor, CallCache
    from eval.run import EvalConfig, auditor_options, call_settings, load_eval_data
    from eval.walker import WalkConfig, walk

    cfg = EvalConfig(auditor=args.auditor, data=args.data, split=args.split, out="-")
    trajs, _ = load_eval_data(cfg)
    wc = WalkConfig(all_prefixes=args.all_prefixes)
    settings = call_settings(cfg)
    opts = auditor_options(cfg)          # what `aftraj eval` gives this auditor (`data` to a floor)

    def strip(recs):
        return [{k: v for k, v in r.items() if k != "latencies_s"} for r in recs]

    def timed(fn):
        best, out = None, None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        return best, out

    with tempfile.TemporaryDirectory() as tmp:
        bare_s, bare = timed(lambda: walk(get_auditor(args.auditor, **opts), trajs, wc, progress=False))

        def filling():
            (Path(tmp) / "calls.jsonl").unlink(missing_ok=True)
            with CallCache(Path(tmp), settings, keep=False) as cache:
                return walk(CachedAuditor(get_auditor(args.auditor, **opts), cache), trajs, wc,
                            progress=False)

        fill_s, filled = timed(filling)
        size = (Path(tmp) / "calls.jsonl").stat().st_size

        def replaying():
            with CallCache(Path(tmp), settings, keep=True) as cache:
                recs = walk(CachedAuditor(get_auditor(args.auditor, **opts), cache), trajs, wc,
                            progress=False)
                return recs, cache.hits, cache.misses

        replay_s, (replayed, hits, misses) = timed(replaying)
    calls = sum(r["calls"] for r in bare)
    same = strip(bare) == strip(filled) == strip(replayed)
    print(f"auditor={args.auditor} data={args.data} split={args.split} trajectories={len(trajs)} calls={calls}")
    print(f"bare: {bare_s:.3f} s ({1e6 * bare_s / calls:.0f} us a call)")
    print(f"filling the cache: {fill_s:.3f} s ({1e6 * (fill_s - bare_s) / calls:+.0f} us a call), "
          f"calls.jsonl {size / 1e6:.2f} MB ({size / calls:.0f} bytes a call)")
    print(f"replayed from the cache: {replay_s:.3f} s ({1e6 * replay_s / calls:.0f} us a call), "
          f"{hits} hits, {misses} asked")
    print(f"same_records={'true' if same else 'false'} load_avg=" + ",".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0 if same and misses == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
