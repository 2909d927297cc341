"""A decision threshold from an every-prefix run's held-out rows (`aftraj train prefixes --set
heldout_split=val` writes RUN/heldout.jsonl: the decision log-odds of every held-out prefix, an
unsafe run's up to k*, a safe run's within `max_safe_prompt_tokens`), chosen by the walk's own rule:
the rows become walk traces and `eval.metrics.threshold_sweep` / `pick_threshold` (the best
Exact-F1 within FAR <= 20 %, what `aftraj eval tune-threshold` runs on a val walk) pick on them.
An approximation of a val walk of the same runs: an unsafe run's prefixes after k* are not there
(an alarm there would only lower precision) and a safe run stops at the prompt cap.

    python reports/ablation-cpu/heldout_walk.py --heldout runs/pfx2/heldout.jsonl \
        --data runs/ablation-cpu/corpus/val.jsonl [--key log_odds_after] [--max-far 0.2]
last line: the pick as JSON (threshold, far, step_acc, exact_f1, agent_acc, n_runs)
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def traces(rows: list[dict], trajs: dict, key: str) -> list[dict]:
    """One prediction record a held-out run, its rows as a complete walk trace."""
    by_run = defaultdict(list)
    for r in rows:
        by_run[r["id"]].append(r)
    preds = []
    for rid, rs in by_run.items():
        lb = trajs[rid].label
        preds.append({"id": rid, "domain": trajs[rid].domain, "subset": trajs[rid].domain,
                      "gold": "UNSAFE" if lb.unsafe else "SAFE", "n_steps": len(trajs[rid].steps),
                      "k_star": lb.decisive_step if lb.unsafe else None,
                      "a_star": lb.decisive_agent if lb.unsafe else None, "trace_complete": True,
                      "trace": [{"t": r["t"], "decision_log_odds": r[key], "step_agent": r["step_agent"],
                                 "alarm": False} for r in sorted(rs, key=lambda r: r["t"])]})
    return preds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heldout", required=True, help="RUN/heldout.jsonl of `aftraj train prefixes`")
    ap.add_argument("--data", required=True, help="the held-out split's JSONL (its labels)")
    ap.add_argument("--key", default="log_odds_after", choices=("log_odds_before", "log_odds_after"))
    ap.add_argument("--max-far", type=float, default=0.2)
    args = ap.parse_args()

    from aftraj.schema import iter_jsonl
    from eval.metrics import pick_threshold, threshold_sweep

    rows = [json.loads(line) for line in open(args.heldout, encoding="utf-8") if line.strip()]
    trajs = {t.id: t for t in iter_jsonl(args.data)}
    preds = traces(rows, trajs, args.key)
    pick = pick_threshold(threshold_sweep(preds, key="decision_log_odds"), args.max_far)
    print(json.dumps({**pick, "n_runs": len(preds), "n_unsafe": sum(p["gold"] == "UNSAFE" for p in preds),
                      "key": args.key}))


if __name__ == "__main__":
    main()
