"""A verdict of the gateway: what the fold found for the run's newest prefix (`verdict_head`:
its findings with their evidence steps, ALARM when a deterministic rule alarms), the auditor's
answer on top of it (serve.auditing), and the end every verdict shares (`verdict_tail`:
decision, auditor status, the intervention action, latency, timestamp, counted in the metrics).

    base, decision, status, score, fold_alarm = verdict_head(run, seq, policy)
    verdict = verdict_tail(run, base, decision, status, score, fold_alarm, t0, cfg.intervention, metrics)
"""

from __future__ import annotations

import time

from serve.runs import Run


def finding(r: Run, f) -> dict:
    """A fold finding with its fold positions (which count run_started) as step indices."""
    d = f.to_dict()
    d["steps"] = [r.step_at[p] for p in f.steps if p < len(r.step_at) and r.step_at[p] is not None]
    seen = r.step_at[f.seen_at] if 0 <= f.seen_at < len(r.step_at) else None
    d["seen_at"] = seen if seen is not None else len(r.steps) - 1
    return d


def verdict_head(r: Run, seq: int, policy):
    """The fold's part of the verdict for the prefix ending at `seq`: (the verdict so far,
    decision, auditor status "off", score, the first alarming finding or None)."""
    findings = [finding(r, f) for f in r.state.findings]
    fold_alarm = next((d for f, d in zip(r.state.findings, findings, strict=True) if f.alarm), None)
    t = len(r.steps) - 1
    base = {"run_id": r.run_id, "seq": seq, "t": t, "findings": findings,
            "policy_revision": policy.revision, "confidence": None, "k": None,
            "agent": None, "reason": None, "auditor_error": None, "model_latency_ms": None,
            "prompt_tokens": 0, "cached_tokens": 0}
    decision = "CONTINUE"
    if fold_alarm is not None:
        # as the `rules` auditor answers for the same finding: its earliest evidence step, and
        # that step's agent (eval/auditors/rules.py)
        decision = "ALARM"
        k = min(fold_alarm["steps"], default=None)
        base.update(k=k, agent=r.steps[k].agent if k is not None and 0 <= k < len(r.steps) else None,
                    reason=f"{fold_alarm['kind']}: {fold_alarm['reason']}")
    return base, decision, "off", 0.0, fold_alarm


def verdict_tail(r: Run, base: dict, decision: str, status: str, score: float, fold_alarm, t0: float,
                 intervention, metrics) -> dict:
    """Complete the verdict: decision, auditor status, action (`intervention.action`),
    latency since `t0` and timestamp; counted in `metrics`."""
    base.update(decision=decision, auditor=status,
                action=intervention.action(score, fold_alarm is not None, status in ("unavailable", "parse_failure")))
    latency = 1000 * (time.perf_counter() - t0)
    base["latency_ms"] = round(latency, 3)
    base["ts"] = round(time.time(), 3)
    metrics.inc("aftraj_gateway_verdicts_total", auditor=status, decision=decision)
    metrics.observe_ms(latency)
    return base


__all__ = ["finding", "verdict_head", "verdict_tail"]
