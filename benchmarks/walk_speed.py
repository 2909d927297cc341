"""The strict walk as `aftraj eval --auditor hf` runs it, with each speed measure of the `hf`
backend turned off in turn, in one process on one model (ratios measured in one run).

Variants (each walks the same trajectories with `eval.walker.walk`; the records, latencies
aside and floats to 1e-4, must equal "now"'s, or the script says so and exits 1):
  now          this build: drafts shrink after a miss, lookahead, finished rows leave the
               stack, grouped KV heads attended without transformers' repeat copy on CPU
  no-lookahead a round's spare rows stay empty (`WalkConfig(lookahead=False)`)
  fixed-drafts every draft as long as `draft_tokens` (no `Decoder.next_cap`)
  gqa-copy     transformers' repeat of the KV heads under a mask (no `masked_gqa`)
  before       all three off (the walk of b0feec0, finished rows aside)

    .venv/bin/python benchmarks/walk_speed.py --model out/demo/ablation/stage12/final \\
        --data out/demo/ablation/corpus --split test --sample 2 --batch 12 --threads 2
    .venv/bin/python benchmarks/walk_speed.py --model out/demo/ablation/stage12/final \\
        --data who_and_when --sample 1 --variants now,no-lookahead

Last lines: `variant=… s=… ratio_to_now=… same_records=true|false` per variant, then
`load_avg=…` (the machine is shared: read ratios, not seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = ("now", "no-lookahead", "fixed-drafts", "gqa-copy", "before")


@contextlib.contextmanager
def variant(name: str):
    """Turn this build's speed measures off for the block, as `name` says."""
    import eval.decoding as hf

    off = {"no-lookahead": {"lookahead"}, "fixed-drafts": {"drafts"}, "gqa-copy": {"gqa"},
           "before": {"lookahead", "drafts", "gqa"}, "now": set()}[name]
    saved = hf.Decoder.next_cap, hf.masked_gqa
    if "drafts" in off:
        hf.Decoder.next_cap = lambda self, cap, prop, j: self.draft_tokens
    if "gqa" in off:
        hf.masked_gqa = lambda enabled=True: contextlib.nullcontext()
    try:
        yield "lookahead" not in off
    finally:
        hf.Decoder.next_cap, hf.masked_gqa = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a local model folder (a full model or an adapter)")
    ap.add_argument("--data", required=True, help="as `aftraj eval --data` (a corpus folder, a file, who_and_when)")
    ap.add_argument("--split", default=None)
    ap.add_argument("--sample", type=int, default=2)
    ap.add_argument("--sample-seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=12, help="--max-in-flight (rows a round)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad or "now" not in names:
        ap.error(f"--variants: from {', '.join(VARIANTS)}, with now among them (got {args.variants})")

    import torch

    from eval.auditors import get_auditor
    from eval.run import EvalConfig, load_eval_data
    from eval.walker import WalkConfig, walk

    torch.set_num_threads(args.threads)
    cfg = EvalConfig(auditor="hf", data=args.data, split=args.split, sample=args.sample,
                     sample_seed=args.sample_seed, out="-")
    trajs, _ = load_eval_data(cfg)
    aud = get_auditor("hf", model=args.model, max_new_tokens=args.max_new_tokens, batch_size=args.batch)
    n_prefix = sum(len(t.steps) for t in trajs)
    print(f"model={args.model} data={args.data} split={args.split} trajectories={len(trajs)} "
          f"steps={n_prefix} batch={args.batch} max_new_tokens={args.max_new_tokens} threads={args.threads}")

    def strip(recs):
        return [{k: v for k, v in r.items() if k != "latencies_s"} for r in recs]

    def close(a, b) -> bool:
        """Equal, floats to 1e-4: a many-token forward (a draft verified, a stacked round) sums
        in another order than one token at a time (log-odds move by ~2e-5)."""
        if isinstance(a, float) and isinstance(b, float):
            return abs(a - b) <= 1e-4 * max(1.0, abs(a))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    seconds, records = {}, {}
    for name in names:
        with variant(name) as lookahead:
            aud.sessions.clear()
            t0 = time.perf_counter()
            recs = walk(aud, trajs, WalkConfig(max_in_flight=args.batch, lookahead=lookahead), progress=False)
            seconds[name] = time.perf_counter() - t0
        records[name] = strip(recs)
        calls = sum(r["calls"] for r in recs)
        print(f"  {name}: {seconds[name]:.1f} s, {calls} calls, "
              f"{sum(r['completion_tokens'] for r in recs)} completion tokens", flush=True)
    ok = True
    for name in names:
        same = close(records[name], records["now"])
        ok &= same
        print(f"variant={name} s={seconds[name]:.2f} ratio_to_now={seconds[name] / seconds['now']:.2f} "
              f"same_records={'true' if same else 'false'}")
    print("load_avg=" + ",".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
