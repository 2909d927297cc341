"""The structural monitor (`aftraj.structural`) as auditors: `structural:DIR` (token-pattern
retrieval) and `structural-baseline:DIR` (plain embedding retrieval), DIR being the output of
`aftraj structural fit`.

Each answers every prefix with a score, P(UNSAFE) = the (aggregated) fail_frac of its
neighbours, as `confidence`, so `--all-prefixes` gives the per-step stratified AUC and the
threshold sweep; and it raises ALARM when the score reaches the threshold tuned on the tune
split (blaming the current step t and its agent), so Exact-F1, FAR etc. are the ALARM
auditor's. k, the aggregation and the threshold come from DIR/monitor.json (tuned at fit time).

    aftraj structural fit --data runs/aftraj-2k --out runs/structural
    aftraj eval --auditor structural:runs/structural --data runs/aftraj-2k/test.jsonl \
        --all-prefixes --auc-start 1 --out runs/eval-structural
    aftraj eval --auditor structural-baseline:runs/structural --data runs/aftraj-2k/test.jsonl \
        --all-prefixes --auc-start 1 --out runs/eval-structural-baseline
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from aftraj.schema import Trajectory
from aftraj.verdict import Verdict
from eval.auditors import AuditResult, Auditor, register_auditor


@register_auditor("structural")
class StructuralAuditor(Auditor):
    method = "structural"
    confidence_kind = "score"   # the neighbours' fail fraction, not a calibrated probability

    def __init__(self, arg: str | None = None, *, monitor=None, k: int | None = None,
                 aggregation: str | None = None, threshold: float | None = None, **kw) -> None:
        super().__init__(arg, **kw)
        from aftraj.structural.monitor import StructuralMonitor

        if monitor is None:
            if not arg:
                raise ValueError(f"{self.name} needs the fitted folder: --auditor {self.name}:DIR "
                                 f"(aftraj structural fit --data CORPUS --out DIR)")
            monitor = StructuralMonitor.load(arg)
        self.monitor = monitor
        tuned = monitor.tuned.get(self.method, {})
        self.k = k if k is not None else tuned.get("k", monitor.cfg.top_k[0])
        self.aggregation = aggregation or tuned.get("aggregation", "raw")
        th = threshold if threshold is not None else tuned.get("threshold")
        self.threshold = math.inf if th is None else float(th)   # no tuned threshold: never ALARM

    def audit(self, traj: Trajectory, t: int) -> AuditResult:
        t0 = time.perf_counter()
        score = self.monitor.score(traj, t, self.method, self.k, self.aggregation)
        if score >= self.threshold:
            v = Verdict("UNSAFE", step=t, agent=traj.steps[t].agent,
                        reason=f"{self.method} score {score:.3f} >= {self.threshold:.3f}")
        else:
            v = Verdict("SAFE")
        return AuditResult(v, t=t, confidence=min(1.0, max(0.0, score)), latency_s=time.perf_counter() - t0)

    def audit_batch(self, requests: Sequence[tuple[Trajectory, int]]) -> list[AuditResult]:
        self.monitor.prepare(requests)   # one batched embedding of the round's new steps
        return [self.audit(traj, t) for traj, t in requests]


@register_auditor("structural-baseline")
class EmbeddingBaselineAuditor(StructuralAuditor):
    """Mean of the last N step embeddings, cosine top-k among other families' prefixes."""

    method = "baseline"
