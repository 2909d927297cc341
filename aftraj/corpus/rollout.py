"""The rollout engine: run a multi-agent template against a policy backend, turn by turn, with
the environment executing tool calls; replay from any step with overridden turns.

A rollout is a pure function of (template, task, policy, seed, prefix, overrides): the scripted
policy draws its slips from a hash of (seed, task, decision slot), never from a shared RNG, so
replaying with one turn changed reproduces every later decision that does not depend on it.

    from aftraj.corpus.rollout import run_rollout, replay_restoring
    r = run_rollout(template, task, policy, seed=0, sandbox=sb)
    r2 = replay_restoring(r_template, task, policy, r.turns, j, seed=0, sandbox=sb, fixed={})
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

from aftraj.schema import Step

MAX_STEPS = 40


@dataclass(frozen=True)
class Turn:
    """A step before it gets its index. `sim` is the simulator's structured reading of the turn
    (what it claims; never rendered to the auditor); `slip` marks a natural slip (ground truth)."""

    agent: str
    kind: str
    content: str
    tool: str | None = None
    arguments: dict | None = None
    result_ids: tuple[str, ...] | None = None
    error: str | None = None
    sim: dict = field(default_factory=dict)
    slip: str | None = None

    def to_step(self, index: int, traj_id: str) -> Step:
        meta = {"sim": self.sim} if self.sim else {}
        return Step(index=index, agent=self.agent, kind=self.kind, content=self.content, tool=self.tool,
                    arguments=self.arguments, result_ids=self.result_ids, error=self.error,
                    event_id=f"{traj_id}#{index}", meta=meta)

    @classmethod
    def from_step(cls, s: Step) -> Turn:
        return cls(agent=s.agent, kind=s.kind, content=s.content, tool=s.tool, arguments=s.arguments,
                   result_ids=s.result_ids, error=s.error, sim=dict(s.meta.get("sim") or {}))

    def same_as(self, other: Turn) -> bool:
        """Equal as the auditor and the simulator see it (ignores the ground-truth slip flag)."""
        return replace(self, slip=None) == replace(other, slip=None)


def _u(*parts: Any) -> float:
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


@dataclass
class Ctx:
    """Seeded decisions for the scripted policy: keyed by slot, so replays are reproducible."""

    seed: int
    task_id: str
    slips: Any                 # SlipConfig
    clean: bool = False        # the safe version of a turn: no slips, checkers always catch

    def slip(self, kind: str, *slot: Any) -> bool:
        if self.clean:
            return False
        return _u(self.seed, self.task_id, "slip", kind, *slot) < self.slips.rate(kind)

    def detour(self, kind: str, *slot: Any) -> bool:
        """A handled failure (`transient_error`, `draft_error`, `plan_slip`, `empty_search`): drawn
        like a slip but not one, so the safe version of a turn keeps it too (restoring an earlier
        step to its safe version must not change which detours the run takes)."""
        return _u(self.seed, self.task_id, "slip", kind, *slot) < self.slips.rate(kind)

    def catches(self, *slot: Any) -> bool:
        """Whether a checker notices a real problem (else it misses it: a verdict slip)."""
        if self.clean:
            return True
        return _u(self.seed, self.task_id, "catch", *slot) < self.slips.catch_rate

    def pick(self, n: int, *slot: Any) -> int:
        return int(_u(self.seed, self.task_id, "pick", *slot) * n) % max(n, 1)


class PolicyError(RuntimeError):
    """The policy could not produce a turn (endpoint down, refusal): the rollout is cancelled."""


@dataclass
class Rollout:
    task_id: str
    template: str
    turns: list[Turn]
    final_answer: str | None
    termination: str          # completed | step_limit | cancelled | tool_error
    success: bool
    check_reason: str
    seed: int
    backend: str
    model: str
    fixed: dict[int, Turn] = field(default_factory=dict)   # turns not produced by the policy
    notes: list[str] = field(default_factory=list)         # recorded problems (malformed calls …)

    @property
    def slips(self) -> list[dict]:
        return [{"step": i, "agent": t.agent, "type": t.slip} for i, t in enumerate(self.turns) if t.slip]


def run_rollout(template, task, policy, *, seed: int, sandbox=None, prefix: list[Turn] | None = None,
                fixed: dict[int, Turn] | None = None, max_steps: int = MAX_STEPS) -> Rollout:
    """Run from `prefix` (default: the request turn), using `fixed[i]` instead of the policy at i."""
    fixed = dict(fixed or {})
    turns = list(prefix) if prefix else [template.request_turn(task)]
    notes: list[str] = []
    termination = "step_limit"
    consecutive_tool_errors = 0
    while len(turns) < max_steps:
        i = len(turns)
        if i in fixed:
            turn = fixed[i]
        elif turns[-1].kind == "tool_call":
            turn = environment_turn(template, task, policy, turns, seed=seed, sandbox=sandbox)
        else:
            try:
                turn = policy.next_turn(template, task, turns, seed=seed)
            except PolicyError as e:
                notes.append(f"step {i}: policy error: {e}")
                termination = "cancelled"
                break
        turns.append(turn)
        if turn.kind == "tool_call" and turn.error:
            notes.append(f"step {i}: malformed tool call: {turn.error}")
        if turn.kind == "tool_result" and turn.error:
            consecutive_tool_errors += 1
            notes.append(f"step {i}: tool error: {turn.error}")
            if consecutive_tool_errors >= 3:
                termination = "tool_error"
                break
        elif turn.kind == "tool_result":
            consecutive_tool_errors = 0
        if turn.kind == "final_answer":
            termination = "completed"
            break
    final = turns[-1].content if turns[-1].kind == "final_answer" else None
    answer = template.answer_of(turns[-1]) if final is not None else None
    if termination == "completed":
        ok, why = template.check(task, answer, sandbox)
    else:
        ok, why = False, f"no final answer ({termination})"
    return Rollout(task_id=task.id, template=template.name, turns=turns, final_answer=answer,
                   termination=termination, success=ok, check_reason=why, seed=seed,
                   backend=policy.backend, model=policy.model, fixed=fixed, notes=notes)


TRANSIENT_FAULTS = ("{tool} timed out after 30 s", "{tool} is unavailable (HTTP 503); try again",
                    "rate limit exceeded for {tool}; retry shortly", "connection to the {tool} backend reset")


def environment_turn(template, task, policy, turns: list[Turn], *, seed: int, sandbox=None) -> Turn:
    """The environment's answer to the call turns[-1]: the tool's result, or a transient fault the
    policy draws (`policy.fault`, seeded by (seed, task, call index), so replays meet the same
    faults). A fault is a tool error the caller handles by retrying; the retry always goes through."""
    fault = getattr(policy, "fault", None)
    why = fault(template, task, turns, seed=seed) if fault is not None else None
    if why:
        call = turns[-1]
        return Turn(agent="environment", kind="tool_result", content=f"ERROR: {why}", tool=call.tool, result_ids=(),
                    error=why, sim={"act": "result", "of": call.sim.get("act"), "transient": True})
    return template.execute(task, turns, sandbox)


def clean_turn(template, task, policy, turns: list[Turn], j: int, *, seed: int, sandbox=None) -> Turn:
    """The safe version of turn j given turns[:j]: the environment's real output for a tool
    result, else the policy's turn with slips off."""
    if j > 0 and turns[j - 1].kind == "tool_call":
        return environment_turn(template, task, policy, turns[:j], seed=seed, sandbox=sandbox)
    if j == 0:
        return template.request_turn(task)
    return policy.next_turn(template, task, turns[:j], seed=seed, clean=True)


def replay_with(template, task, policy, turns: list[Turn], j: int, new_turn: Turn, *, seed: int,
                sandbox=None, fixed: dict[int, Turn] | None = None, max_steps: int = MAX_STEPS) -> Rollout:
    """Keep turns[:j], put `new_turn` at j, keep the other fixed turns (injections) after j,
    and let the policy play the rest."""
    fx = {k: v for k, v in (fixed or {}).items() if k > j}
    fx[j] = new_turn
    return run_rollout(template, task, policy, seed=seed, sandbox=sandbox, prefix=turns[:j], fixed=fx,
                       max_steps=max_steps)


def replay_restoring(template, task, policy, turns: list[Turn], j: int, *, seed: int, sandbox=None,
                     fixed: dict[int, Turn] | None = None, max_steps: int = MAX_STEPS) -> Rollout:
    """Restore turn j to its safe version and replay (the counterfactual of DESIGN §4)."""
    safe = clean_turn(template, task, policy, turns, j, seed=seed, sandbox=sandbox)
    return replay_with(template, task, policy, turns, j, safe, seed=seed, sandbox=sandbox, fixed=fixed,
                       max_steps=max_steps)
