"""The walk's calibration for a step-scored checkpoint (`aftraj train steps`), chosen on the
held-out split and stored with the checkpoint: the threshold on the decision log-odds at which the
walk (the first step whose log-odds >= threshold raises ALARM at that step, blaming its agent) has
the best Exact-F1 within FAR <= 20 %, by the one rule (`eval.prefix_rows.heldout_threshold`, i.e.
`eval.metrics.threshold_sweep` + `pick_threshold`). The held-out rows are every step of every
held-out run, scored from one forward a run, which equals the online walk step for step
(tests/aftraj/test_step_reading.py), so the figures are the val walk's own.

Per-(domain, agent) offsets added to the log-odds before the threshold (`fit_offsets`: coordinate
ascent on the same rule) are kept only when a two-fold cross-fit over the held-out runs says they
help (`check_offsets`: fit on one half, scored on the other, both ways, against the threshold
alone); else `offsets` is null and the threshold is the plain one.

Writes RUN/final/steps_calibration.json, which the `hf-steps` and `vllm-steps` auditors load.

    python -m eval.step_calibration RUN [--max-far 0.2]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CALIBRATION_FILE = "steps_calibration.json"


def calibrate(run_dir: str | Path, *, max_far: float | None = None, heldout=None, offsets: bool = True) -> dict:
    """Choose the threshold on RUN/heldout_steps.jsonl and write RUN/final/steps_calibration.json.
    `heldout`: the held-out trajectories (default: the `heldout_split` of RUN/config.json's data).
    `offsets`: also try per-(domain, agent) offsets, kept only when a two-fold cross-fit on the
    held-out runs says they help (`check_offsets`)."""
    from aftraj.errors import UsageError
    from aftraj.readers import load_trajectories
    from eval.metrics import DEPLOYABLE_MAX_FAR
    from eval.prefix_rows import heldout_threshold

    run = Path(run_dir)
    rows_path = run / "heldout_steps.jsonl"
    if not rows_path.is_file():
        raise UsageError(f"{rows_path}: no held-out rows; train with heldout_split set (e.g. --set heldout_split=val)")
    rows = [json.loads(line) for line in rows_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if heldout is None:
        cfg = json.loads((run / "config.json").read_text(encoding="utf-8"))
        heldout = load_trajectories(Path(cfg["data"]) / f"{cfg['heldout_split']}.jsonl", "jsonl")
    trajs = {t.id: t for t in heldout}
    max_far = DEPLOYABLE_MAX_FAR if max_far is None else max_far
    pick = heldout_threshold(rows, trajs, "log_odds", max_far)
    if pick is None:
        raise UsageError(f"{rows_path}: no unsafe held-out run: no threshold to choose")
    out = {"threshold": pick["threshold"], "max_far": max_far, "chosen_on": str(rows_path),
           "val": {k: pick.get(k) for k in ("far", "exact_f1", "step_acc", "agent_acc", "n_runs", "n_unsafe",
                                            "within_far")},
           "offsets": None,
           "rule": "eval.metrics.pick_threshold over the held-out walk (first step with log-odds >= threshold)"}
    if offsets:
        out["offsets_check"] = check_offsets(rows, trajs, max_far)
        if out["offsets_check"]["kept"]:
            fit = fit_offsets(rows, trajs, max_far)
            out.update(threshold=fit["threshold"], offsets=fit["offsets"],
                       val={**out["val"], **{k: fit[k] for k in ("far", "exact_f1", "step_acc", "agent_acc")}})
    final = run / "final"
    if final.is_dir():
        (final / CALIBRATION_FILE).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return out


# --------------------------------------------------------------------------- offsets

OFFSET_GRID = (-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0)
N_THRESHOLDS = 60          # the sweep's thresholds: quantiles of the shifted scores (the fits' speed)


def offset_key(traj, t: int) -> str:
    """The offsets' key of step t: its run's domain and the step's agent."""
    return f"{traj.domain}/{traj.steps[t].agent}"


def _pick(rows, trajs, offs: dict, max_far: float) -> dict | None:
    """The one rule (`threshold_sweep` + `pick_threshold`) on the rows' log-odds plus `offs`, over
    N_THRESHOLDS quantile thresholds."""
    from eval.metrics import pick_threshold, threshold_sweep
    from eval.prefix_rows import heldout_traces

    shifted = [{**r, "v": r["log_odds"] + offs.get(offset_key(trajs[r["id"]], r["t"]), 0.0)} for r in rows]
    vals = sorted(x["v"] for x in shifted)
    ths = sorted({round(vals[int(i * (len(vals) - 1) / (N_THRESHOLDS - 1))], 4) for i in range(N_THRESHOLDS)}
                 | {round(vals[-1] + 1.0, 4)})
    return pick_threshold(threshold_sweep(heldout_traces(shifted, trajs, "v"), ths, key="decision_log_odds"), max_far)


def fit_offsets(rows, trajs, max_far: float, passes: int = 2) -> dict:
    """Per-(domain, agent) offsets by coordinate ascent over OFFSET_GRID (the keys with an ALARM
    row first, by their rows' count), each move kept when the picked threshold's Exact-F1 rises
    (ties: lower FAR); returns the pick with its `offsets`."""
    offs: dict[str, float] = {}
    best = _pick(rows, trajs, offs, max_far)
    if best is None:
        return {"offsets": {}, "threshold": None, "far": None, "exact_f1": None, "step_acc": None, "agent_acc": None}
    count: dict[str, int] = {}
    for r in rows:
        k = offset_key(trajs[r["id"]], r["t"])
        count[k] = count.get(k, 0) + 1
    score = lambda p: (p["exact_f1"] or 0.0, -(p["far"] or 0.0))     # noqa: E731
    for _ in range(passes):
        moved = False
        for key in sorted(count, key=lambda k: -count[k]):
            for o in OFFSET_GRID:
                if o == offs.get(key, 0.0):
                    continue
                trial = {**offs, key: o}
                p = _pick(rows, trajs, trial, max_far)
                if p is not None and score(p) > score(best) and (p["far"] is None or p["far"] <= max_far):
                    offs, best, moved = trial, p, True
        if not moved:
            break
    return {**best, "offsets": {k: v for k, v in offs.items() if v}}


def check_offsets(rows, trajs, max_far: float) -> dict:
    """Two-fold cross-fit on the held-out runs (split by run, alternating in id order): fit the
    threshold alone, and the threshold with offsets, on one half; score the other half with what
    was fit; both ways. Offsets are kept when their held-out-half Exact-F1 (summed hits over both
    halves' alarms and unsafe runs) beats the threshold alone's."""
    from eval.metrics import summarize
    from eval.prefix_rows import heldout_traces

    ids = sorted({r["id"] for r in rows})
    halves = [set(ids[0::2]), set(ids[1::2])]

    def apply(part, thr, offs):
        shifted = [{**r, "v": r["log_odds"] + offs.get(offset_key(trajs[r["id"]], r["t"]), 0.0)}
                   for r in rows if r["id"] in part]
        preds = heldout_traces(shifted, trajs, "v")
        for p in preds:
            hit = next((e for e in p["trace"] if e["decision_log_odds"] >= thr), None)
            p.update(alarmed=hit is not None, d=hit and hit["t"], k_hat=hit and hit["t"],
                     a_hat=hit and hit["step_agent"])
        return preds

    out = {}
    for name, use in (("threshold_only", False), ("with_offsets", True)):
        preds = []
        for fit_on, test_on in ((halves[0], halves[1]), (halves[1], halves[0])):
            fit_rows = [r for r in rows if r["id"] in fit_on]
            fit = fit_offsets(fit_rows, trajs, max_far) if use else {**(_pick(fit_rows, trajs, {}, max_far) or {}),
                                                                      "offsets": {}}
            if fit.get("threshold") is None:
                return {"kept": False, "why": "a half holds no unsafe run"}
            preds += apply(test_on, fit["threshold"], fit["offsets"])
        m = summarize(preds, n_boot=0)
        out[name] = {"exact_f1": m["exact_f1"], "far": m["far"]}
    gain = (out["with_offsets"]["exact_f1"] or 0.0) - (out["threshold_only"]["exact_f1"] or 0.0)
    far_ok = out["with_offsets"]["far"] is None or out["with_offsets"]["far"] <= max_far
    return {**out, "kept": gain > 0 and far_ok, "gain_exact_f1": round(gain, 4)}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m eval.step_calibration", description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run folder of `aftraj train steps`")
    p.add_argument("--max-far", type=float, default=None)
    p.add_argument("--no-offsets", action="store_true", help="the threshold alone (no per-agent offsets tried)")
    a = p.parse_args(argv)
    print(json.dumps(calibrate(a.run, max_far=a.max_far, offsets=not a.no_offsets)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
