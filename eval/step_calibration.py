"""The walk's calibration for a step-scored checkpoint (`aftraj train steps`), chosen on the
held-out split and stored with the checkpoint: the threshold on the decision log-odds at which the
walk (the first step whose log-odds >= threshold raises ALARM at that step, blaming its agent) has
the best Exact-F1 within FAR <= 20 %, by the one rule (`eval.prefix_rows.heldout_threshold`, i.e.
`eval.metrics.threshold_sweep` + `pick_threshold`). The held-out rows are every step of every
held-out run, scored from one forward a run, which equals the online walk step for step
(tests/aftraj/test_step_reading.py), so the figures are the val walk's own.

Writes RUN/final/steps_calibration.json, which the `hf-steps` and `vllm-steps` auditors load.

    python -m eval.step_calibration RUN [--max-far 0.2]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CALIBRATION_FILE = "steps_calibration.json"


def calibrate(run_dir: str | Path, *, max_far: float | None = None, heldout=None) -> dict:
    """Choose the threshold on RUN/heldout_steps.jsonl and write RUN/final/steps_calibration.json.
    `heldout`: the held-out trajectories (default: the `heldout_split` of RUN/config.json's data)."""
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
    final = run / "final"
    if final.is_dir():
        (final / CALIBRATION_FILE).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m eval.step_calibration", description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run folder of `aftraj train steps`")
    p.add_argument("--max-far", type=float, default=None)
    a = p.parse_args(argv)
    print(json.dumps(calibrate(a.run, max_far=a.max_far)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
