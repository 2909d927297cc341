"""Tuning of the structural monitor on a tune split only: for each method (structural,
baseline), k and the aggregation maximise the per-step stratified AUC (eval.metrics), then the
ALARM threshold maximises Exact-F1 on the threshold sweep (eval.metrics.threshold_sweep) among
the thresholds whose FAR stays within the deployable bound (FAR <= 20 %; all thresholds when
none does); ties: lower FAR, then the higher threshold. Every figure comes from walking the tune split with the
auditor itself (eval.walker, every prefix scored).

    from eval.structural_tune import tune
    monitor.tuned = tune(monitor, tune_trajs)
"""

from __future__ import annotations

from collections.abc import Sequence

from aftraj.schema import Trajectory
from aftraj.structural.monitor import METHODS


def walk_scores(monitor, trajs: Sequence[Trajectory], method: str, k: int, aggregation: str,
                threshold: float | None = None) -> list[dict]:
    """Prediction records of a strict walk over every prefix (eval.walker's format)."""
    from eval.auditors.structural import EmbeddingBaselineAuditor, StructuralAuditor
    from eval.walker import WalkConfig, walk

    cls = StructuralAuditor if method == "structural" else EmbeddingBaselineAuditor
    aud = cls(None, monitor=monitor, k=k, aggregation=aggregation,
              threshold=threshold if threshold is not None else float("inf"))
    return walk(aud, trajs, WalkConfig(all_prefixes=True, max_in_flight=64), progress=False)


def tune(monitor, trajs: Sequence[Trajectory], *, log=None, progress: bool = False) -> dict:
    """`progress`: counts and an ETA over the grid's walks (one per method, aggregation and k)."""
    from aftraj.console import progress as make_progress
    from eval.metrics import DEPLOYABLE_MAX_FAR, pick_threshold, stratified_auc, threshold_sweep

    log = log or (lambda *_: None)
    cfg = monitor.cfg
    out = {}
    bar = make_progress(len(METHODS) * len(cfg.aggregations) * len(cfg.top_k),
                        f"structural tune: walks of {len(trajs)} runs", "walk", enabled=progress)
    for method in METHODS:
        grid = []
        best = None
        for agg in cfg.aggregations:
            for k in cfg.top_k:
                preds = walk_scores(monitor, trajs, method, k, agg)
                bar.update(1)
                auc = stratified_auc(preds, cfg.auc_start, n_boot=0)["auc"]
                grid.append({"k": k, "aggregation": agg, "stratified_auc": auc})
                if auc is not None and (best is None or auc > best[0]):
                    best = (auc, k, agg, preds)
        if best is None:
            raise ValueError("tune: the stratified AUC is undefined on the tune split (one class only at "
                             "every step); give a tune split with safe and unsafe runs")
        auc, k, agg, preds = best
        # within the deployable FAR bound when some threshold reaches it (an Exact-F1 optimum at
        # FAR 85 % is no alarm policy); otherwise the plain optimum
        pick = pick_threshold(threshold_sweep(preds), DEPLOYABLE_MAX_FAR)
        out[method] = {"k": k, "aggregation": agg,
                       "threshold": pick["threshold"] if pick else None,
                       "tune_stratified_auc": auc, "tune_exact_f1": pick["exact_f1"] if pick else None,
                       "tune_far": pick["far"] if pick else None, "tune_n": len(trajs),
                       "auc_start": cfg.auc_start, "grid": grid}
        log(f"tuned {method}: k={k} aggregation={agg} stratified AUC {auc:.3f}; threshold "
            f"{out[method]['threshold']} (Exact-F1 {out[method]['tune_exact_f1']}, FAR {out[method]['tune_far']})")
    bar.close()
    return out


__all__ = ["tune", "walk_scores"]
