"""The dummy auditor, for tests and smoke runs: deterministic answers with no model.

    aftraj eval --auditor dummy:gold --data ww.jsonl --out runs/eval-gold

Arguments (`dummy:ARG`):
- `safe` (default): CONTINUE at every prefix.
- `gold`: the oracle, `aftraj.verdict.gold_verdict(traj, t)`: ALARM exactly at k* (metrics are perfect).
- `alarm-at-N`: ALARM at prefix N (or the last step if shorter), blaming step N and its agent.
- `fail`: every answer is a parse failure (counted as CONTINUE).
- `confidence=P` may follow any of these after a comma (`gold,confidence=0.7`) to report P(UNSAFE).
A `fn=callable(traj, t) -> Verdict | ParseFailure` keyword replaces the rule (tests script answers).
"""

from __future__ import annotations

from aftraj.verdict import ParseFailure, Verdict, gold_verdict
from eval.auditors import AuditResult, Auditor, register_auditor


@register_auditor("dummy")
class DummyAuditor(Auditor):
    def __init__(self, arg: str | None = None, *, fn=None, **kw) -> None:
        super().__init__(arg, **kw)
        parts = (arg or "safe").split(",")
        self.rule, self.confidence = parts[0], None
        for p in parts[1:]:
            key, _, val = p.partition("=")
            if key != "confidence":
                raise ValueError(f"dummy auditor: unknown option {p!r} in {arg!r}")
            self.confidence = float(val)
        self.fn = fn
        if fn is None and not (self.rule in ("safe", "gold", "fail") or self.rule.startswith("alarm-at-")):
            raise ValueError(f"dummy auditor: unknown rule {self.rule!r} "
                             f"(safe | gold | fail | alarm-at-N)")
        if self.rule.startswith("alarm-at-"):
            self.at = int(self.rule.removeprefix("alarm-at-"))
        self.calls = 0

    def _answer(self, traj, t) -> Verdict | ParseFailure:
        if self.fn is not None:
            return self.fn(traj, t)
        if self.rule == "safe":
            return Verdict("SAFE")
        if self.rule == "gold":
            return gold_verdict(traj, t)
        if self.rule == "fail":
            return ParseFailure("missing_answer", "dummy: scripted failure", "")
        at = min(self.at, len(traj.steps) - 1)
        if t < at:
            return Verdict("SAFE")
        return Verdict("UNSAFE", step=at, agent=traj.steps[at].agent, reason="dummy alarm")

    def audit(self, traj, t) -> AuditResult:
        self.calls += 1
        return AuditResult(self._answer(traj, t), t=t, confidence=self.confidence)
