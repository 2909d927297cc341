"""`rules`: the fold's deterministic detectors as an auditor (no model).

At prefix t the trajectory's steps 0..t are folded (`aftraj.fold.TrajectoryFolder`, one step
per call, O(1) per step); the first finding whose kind the policy lists in `alarm_on` raises
ALARM at the earliest evidence step of that finding, blaming that step's agent, with the
finding's reason. Evidence gaps (`insufficient_loop_evidence`) and kinds not in `alarm_on` are
never alarms. The trajectory's termination (step limit without answer, tool error …) is only
known once the run has ended, so it is folded with the last step.

The detectors read tool calls, tool results, errors, the run's end and its usage. A message-only
run (Who&When: every step is an agent's message) gives them nothing to read: none can fire, and
the auditor's SAFE there means "no rule applies", not "judged safe". `report_notes(trajs)` says
so, with counts, in metrics.json and report.md (`auditor_notes`), and each such verdict's
reasoning says it too, rather than a silent 0 % Step-Acc.

    aftraj eval --auditor rules --data heldout.jsonl --out runs/eval-rules
    aftraj eval --auditor rules:configs/policies/templates.yaml --data heldout.jsonl --out runs/eval-rules
"""

from __future__ import annotations

from aftraj.detectors import Policy, default_policy, load_policy
from aftraj.fold import TrajectoryFolder
from aftraj.schema import Trajectory
from aftraj.verdict import Verdict
from eval.auditors import AuditResult, Auditor, register_auditor


@register_auditor("rules")
class RulesAuditor(Auditor):
    """ARG: a policy YAML path (default: the built-in policy, configs/policies/default.yaml)."""

    def __init__(self, arg: str | None = None, *, policy: Policy | None = None, **kw) -> None:
        super().__init__(arg, **kw)
        self.policy = policy or (load_policy(arg) if arg else default_policy())
        self._folders: dict[str, TrajectoryFolder] = {}
        self._readable: dict[str, tuple[Trajectory, bool]] = {}

    def _folder(self, traj: Trajectory) -> TrajectoryFolder:
        f = self._folders.get(traj.id)
        if f is None or f.traj is not traj:
            f = self._folders[traj.id] = TrajectoryFolder(traj, self.policy)
        return f

    def finding_at(self, traj: Trajectory, t: int):
        """The first alarm-raising finding visible at prefix t, or None."""
        if not 0 <= t < len(traj.steps):
            raise IndexError(f"prefix t={t} is out of range for {traj.id!r} ({len(traj.steps)} steps)")
        return self._folder(traj).first_alarm(t)    # O(1): no scan of the findings so far

    @staticmethod
    def rule_readable(traj: Trajectory) -> bool:
        """True when the run holds something a rule detector reads: a tool call or result, a
        step with an error, a recorded termination other than `completed`, or token usage."""
        return (traj.termination not in (None, "completed")
                or any(s.kind in ("tool_call", "tool_result") or s.error is not None
                       or (s.meta or {}).get("aftraj_event", {}).get("usage") for s in traj.steps))

    def report_notes(self, trajs) -> list[str]:
        """What the report must say about these runs (see the module docstring)."""
        n_blind = sum(not self.rule_readable(t) for t in trajs)
        if not n_blind:
            return []
        return [f"rules: {n_blind} of {len(trajs)} trajectories are message-only (no tool call, tool result, "
                f"error, step limit or usage): the rule detectors (loops, stalls, cycles, error streaks, tool "
                f"policy, budgets) cannot fire on them, so this auditor's SAFE there means 'no rule applies' "
                f"(e.g. Who&When, whose steps are agents' messages); its Step-Acc on them measures nothing"]

    def audit(self, traj: Trajectory, t: int) -> AuditResult:
        f = self.finding_at(traj, t)
        if f is None:
            readable = self._readable.get(traj.id)
            if readable is None or readable[0] is not traj:
                readable = self._readable[traj.id] = (traj, self.rule_readable(traj))
            think = ("No rule finding in the steps shown." if readable[1] else
                     "Message-only run: no tool call, result, error or step limit for a rule to read; "
                     "no rule can fire here (this SAFE is not a judgement).")
            return AuditResult(Verdict("SAFE", think=think), t=t)
        k = f.first_step
        agent = traj.steps[k].agent
        think = (f"Rule {f.kind} (policy revision {f.policy_revision}) fired on evidence "
                 f"{', '.join(f.event_ids)} (steps {', '.join(map(str, f.steps))}).")
        return AuditResult(Verdict("UNSAFE", step=k, agent=agent, reason=f.reason, think=think), t=t)

    def end(self, traj: Trajectory) -> None:
        self._folders.pop(traj.id, None)
        self._readable.pop(traj.id, None)
