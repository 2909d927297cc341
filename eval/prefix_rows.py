"""An every-prefix run's held-out rows read as a walk (`aftraj train prefixes` with a
`heldout_split` writes RUN/heldout.jsonl: the decision log-odds ALARM − SAFE at every held-out
prefix, an unsafe run's up to k*, a safe run's within its prompt cap, before and after training).
The walk's own threshold rule on them (`eval.metrics.threshold_sweep` / `pick_threshold`) and the
probe's content control, post vs twin (`eval.probe.summarize`), with no second metric code.

    from eval.prefix_rows import heldout_threshold, heldout_twins
    pick = heldout_threshold(rows, {t.id: t for t in val}, "log_odds_after")

`aftraj eval tune-threshold RUN` runs both on a run folder.
"""

from __future__ import annotations

from aftraj.schema import Trajectory


def heldout_traces(rows: list[dict], trajs: dict[str, Trajectory], key: str) -> list[dict]:
    """The held-out rows of each run as the walk's prediction record with a complete trace (the
    layout `eval.metrics.threshold_sweep` reads): the decision log-odds `key` at every row's prefix.
    An approximation of a walk of the same runs: an unsafe run's prefixes after k* are not rows (an
    alarm there only lowers precision) and a safe run stops at its prompt cap."""
    by_run: dict[str, list[dict]] = {}
    for r in rows:
        by_run.setdefault(r["id"], []).append(r)
    preds = []
    for rid, rs in by_run.items():
        traj = trajs.get(rid)
        if traj is None:
            raise ValueError(f"held-out row of run {rid!r}: no such run in the held-out data")
        lb = traj.label
        preds.append({"id": rid, "domain": traj.domain, "subset": traj.domain,
                      "gold": "UNSAFE" if lb.unsafe else "SAFE", "n_steps": len(traj.steps),
                      "k_star": lb.decisive_step if lb.unsafe else None,
                      "a_star": lb.decisive_agent if lb.unsafe else None, "trace_complete": True,
                      "trace": [{"t": r["t"], "decision_log_odds": r[key], "step_agent": r["step_agent"],
                                 "alarm": False} for r in sorted(rs, key=lambda r: r["t"])]})
    return preds


def heldout_threshold(rows: list[dict], trajs: dict[str, Trajectory], key: str,
                      max_far: float | None = None) -> dict | None:
    """The decision threshold the held-out rows pick by the walk's own rule (`threshold_sweep`,
    then `pick_threshold`: the best Exact-F1 within FAR <= max_far, the deployable 20 % by
    default; what `aftraj eval tune-threshold` runs on a val walk), with its figures on those
    rows; None without an unsafe run."""
    from eval.metrics import DEPLOYABLE_MAX_FAR, pick_threshold, threshold_sweep

    max_far = DEPLOYABLE_MAX_FAR if max_far is None else max_far
    preds = heldout_traces(rows, trajs, key)
    pick = pick_threshold(threshold_sweep(preds, key="decision_log_odds"), max_far)
    if pick is None:
        return None
    return {**pick, "max_far": max_far, "within_far": pick["far"] is None or pick["far"] <= max_far,
            "n_runs": len(preds), "n_unsafe": sum(p["gold"] == "UNSAFE" for p in preds)}


def heldout_twins(rows: list[dict], trajs: dict[str, Trajectory], key: str, *, n_boot: int = 1000,
                  seed: int = 0) -> dict:
    """The content control on held-out rows (eval/probe.py's headline, read at the rows): for each
    held-out unsafe run with a verified-safe twin among the held-out runs, its log-odds at k*
    ("post") against the twin's at k* ("twin"; identical up to k*-1, the same agent at k*) and
    against its own at k*-1 ("pre"). A content-blind model beats the twin half the time."""
    from aftraj.boundary import find_twins
    from eval.probe import summarize

    at = {(r["id"], r["t"]): r[key] for r in rows}
    records = []
    for uid, twin in find_twins(list(trajs.values())).items():
        k = trajs[uid].label.decisive_step
        if (uid, k) not in at:
            continue
        rec = {"post": {"decision": at[uid, k]}}
        if (uid, k - 1) in at:
            rec["pre"] = {"decision": at[uid, k - 1]}
        if (twin.id, k) in at:
            rec["twin"] = {"decision": at[twin.id, k]}
        records.append(rec)
    s = summarize(records, n_boot=n_boot, seed=seed)
    return {"post_beats_twin": s["post_beats_twin"], "post_beats_pre": s["post_beats_pre"]}
