"""Post-hoc heuristic baselines (Who&When's), each seeing the whole trajectory once.

    aftraj eval --auditor heuristic:uniform-random --data who_and_when --out runs/ww-random

- `uniform-random[,seed=S]`: k̂ uniform over steps 0..N-1 and â uniform over the trajectory's
  agents, independently, seeded per (seed, trajectory id) so results do not depend on order.
  `analytic_expectation()` gives its exact expected metrics (Step-Acc = mean 1/N over U, …).
- `last-step`: the final step and its agent.
- `first-non-human`: the first step whose agent is not the human/user.
- `last-speaker-first-step`: the last non-terminal speaker (not a human, not a code-executing
  terminal such as Computer_terminal), blamed at its first step.
All of them always ALARM, so on safe trajectories FAR is 1: they are attribution baselines.
`heuristic:position-prior` and `heuristic:length` are the content-blind floors of floors.py;
`heuristic:lexical`, `heuristic:bow` and `heuristic:structure` the floors that read (reading.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from aftraj.schema import Step, Trajectory
from aftraj.verdict import Verdict, agent_match
from eval.auditors import AuditResult, Auditor, register_auditor

HUMAN_AGENTS = frozenset({"human", "user", "human_proxy", "userproxy", "user_proxy"})
RULES = ("uniform-random", "last-step", "first-non-human", "last-speaker-first-step")


def is_human(step: Step) -> bool:
    return step.agent.strip().casefold() in HUMAN_AGENTS


def is_terminal(step: Step) -> bool:
    return "terminal" in step.agent.casefold() or step.kind == "tool_result"


@register_auditor("heuristic")
class HeuristicAuditor(Auditor):
    strategy = "posthoc"

    def __new__(cls, arg: str | None = None, **kw):
        floor = cls.resolve(arg)
        return floor(arg, **kw) if floor is not cls else super().__new__(cls)

    @classmethod
    def resolve(cls, arg: str | None) -> type[Auditor]:
        # heuristic:position-prior, heuristic:length (content-blind) and heuristic:lexical, :bow,
        # :structure (floors that read) are the floors of floors.py and reading.py
        from eval.auditors.floors import ALL_FLOORS

        return ALL_FLOORS.get((arg or "").split(",")[0], cls)

    def __init__(self, arg: str | None = None, *, seed: int = 0, **kw) -> None:
        super().__init__(arg, **kw)
        parts = (arg or "").split(",")
        self.rule, self.seed = parts[0], seed
        for p in parts[1:]:
            key, _, val = p.partition("=")
            if key != "seed":
                raise ValueError(f"heuristic auditor: unknown option {p!r} in {arg!r}")
            self.seed = int(val)
        if self.rule not in RULES:
            raise ValueError(f"heuristic auditor needs one of {', '.join(RULES)} (heuristic:NAME); "
                             f"got {self.rule!r}")

    def pick(self, traj: Trajectory) -> tuple[int, str]:
        steps = traj.steps
        if self.rule == "uniform-random":
            rng = random.Random(f"{self.seed}:{traj.id}")
            return rng.randrange(len(steps)), rng.choice(traj.agents)
        if self.rule == "last-step":
            return steps[-1].index, steps[-1].agent
        if self.rule == "first-non-human":
            s = next((s for s in steps if not is_human(s)), steps[0])
            return s.index, s.agent
        speakers = [s for s in steps if not is_human(s) and not is_terminal(s)]
        if not speakers:
            return steps[-1].index, steps[-1].agent
        agent = speakers[-1].agent
        first = next(s for s in steps if s.agent == agent)
        return first.index, agent

    def audit(self, traj: Trajectory, t: int) -> AuditResult:
        k, agent = self.pick(traj)
        if k > t:  # never blame a step the auditor was not shown
            k, agent = t, traj.steps[t].agent
        return AuditResult(Verdict("UNSAFE", step=k, agent=agent, reason=f"heuristic {self.rule}"), t=t)

    def analytic_expectation(self, trajs: Sequence[Trajectory]) -> dict | None:
        """Exact expected metrics of uniform-random (None for the deterministic rules)."""
        if self.rule != "uniform-random" or not trajs:
            return None
        unsafe = [t for t in trajs if t.label.unsafe]
        n, nu = len(trajs), len(unsafe)
        p_step = [1 / len(t.steps) for t in unsafe]
        p_agent = [sum(agent_match(a, t.label.decisive_agent) for a in t.agents) / len(t.agents) for t in unsafe]
        e_abs = [sum(abs(j - t.label.decisive_step) for j in range(len(t.steps))) / len(t.steps)
                 for t in unsafe]
        hits = sum(p_step)
        return {"n": n, "n_unsafe": nu,
                "step_acc": hits / nu if nu else None, "step_recall": hits / nu if nu else None,
                "step_precision": hits / n, "exact_f1": 2 * hits / (n + nu),
                "agent_acc": sum(p_agent) / nu if nu else None,
                "ass": sum(e_abs) / nu if nu else None,
                "far": 1.0 if n > nu else None}
