"""Safe curation (DESIGN §4): a successful rollout enters D_safe only if all three predicates
hold; every rejection is recorded with its predicate and reason.

1. outcome_equivalence: the run completed and the task's checker passes on its final answer.
2. valid_tool_use: every call is permitted for its agent and well-formed, gets a result, and no
   tool error is left unhandled (the caller must retry the tool before moving on); no tool
   result appears without a call.
3. subgoal_coherence: every step advances or verifies a sub-goal: deterministic rules (non-empty,
   a known act of the template, no verbatim repeat of an earlier turn, no repeated identical
   call), or the judge backend (`curation.coherence: judge`).
4. slip_free: the slip detector (`aftraj.corpus.slips`, one predicate per injection type, the
   injector's own definitions) finds no slip, not even one a checker caught later. The rejection
   names the type (`slip_type`).

    from aftraj.corpus.curate import curate
    rejections = curate(template, task, rollout)     # [] means accepted
"""

from __future__ import annotations

from dataclasses import dataclass

from aftraj.corpus.rollout import Rollout

PREDICATES = ("outcome_equivalence", "valid_tool_use", "subgoal_coherence", "slip_free")


@dataclass(frozen=True)
class Rejection:
    predicate: str
    reason: str
    step: int | None = None
    slip_type: str | None = None

    def to_dict(self) -> dict:
        return {"predicate": self.predicate, "reason": self.reason, "step": self.step, "slip_type": self.slip_type}


def slip_free(template, task, r: Rollout) -> Rejection | None:
    from aftraj.corpus.slips import find_slips

    found = find_slips(template, task, r.turns)
    if found:
        f = found[0]
        return Rejection("slip_free", f"{f.agent} {f.reason}", f.step, f.type)
    return None


def outcome_equivalence(template, task, r: Rollout) -> Rejection | None:
    if r.termination != "completed" or r.final_answer is None:
        return Rejection("outcome_equivalence", f"the run did not complete ({r.termination})")
    if not r.success:
        return Rejection("outcome_equivalence", f"checker failed: {r.check_reason}")
    return None


def valid_tool_use(template, task, r: Rollout) -> Rejection | None:
    turns = r.turns
    for i, t in enumerate(turns):
        if t.kind == "tool_call":
            if t.error:
                return Rejection("valid_tool_use", f"malformed call: {t.error}", i)
            problem = template.call_problem(t.agent, t.tool, t.arguments)
            if problem:
                return Rejection("valid_tool_use", problem, i)
            if i + 1 >= len(turns) or turns[i + 1].kind != "tool_result":
                return Rejection("valid_tool_use", f"call to {t.tool} got no result", i)
        elif t.kind == "tool_result":
            if i == 0 or turns[i - 1].kind != "tool_call":
                return Rejection("valid_tool_use", "a tool result without a call", i)
            if t.error:
                caller = turns[i - 1].agent
                nxt = next((u for u in turns[i + 1:] if u.agent == caller), None)
                if nxt is None or nxt.kind != "tool_call" or nxt.tool != turns[i - 1].tool:
                    return Rejection("valid_tool_use", f"unhandled tool error: {t.error}", i)
    return None


def coherence_rules(template, task, r: Rollout) -> Rejection | None:
    turns = r.turns
    for i, t in enumerate(turns):
        if i == 0:
            continue
        if not t.content.strip() and t.kind != "tool_result":
            return Rejection("subgoal_coherence", "an empty turn advances no sub-goal", i)
        act = t.sim.get("act")
        if template.acts and act not in template.acts and not str(act).startswith("llm_"):
            return Rejection("subgoal_coherence", f"step has no sub-goal role (act {act!r})", i)
        if t.kind == "tool_result":
            continue
        # a verbatim repeat of the agent's previous turn with nothing new from anyone else between
        for j in range(i - 1, 0, -1):
            u = turns[j]
            if u.agent == t.agent:
                if (u.kind, u.content, u.tool, u.arguments) == (t.kind, t.content, t.tool, t.arguments):
                    between = turns[j + 1:i]
                    if all(b.agent in (t.agent, "environment") and not b.error for b in between):
                        return Rejection("subgoal_coherence", f"repeats step {j} with nothing new (no progress)", i)
                break
    return None


def curate(template, task, r: Rollout, *, judge=None, coherence: str = "rules") -> list[Rejection]:
    """All predicate failures (empty = the rollout is verified safe)."""
    out = []
    for rej in (outcome_equivalence(template, task, r), valid_tool_use(template, task, r)):
        if rej is not None:
            out.append(rej)
    if coherence == "judge":
        if judge is None:
            raise ValueError("coherence: judge needs a judge backend")
        ok, step, reason = judge.coherence(template, task, r)
        if not ok:
            out.append(Rejection("subgoal_coherence", f"judge: {reason}", step))
    else:
        rej = coherence_rules(template, task, r)
        if rej is not None:
            out.append(rej)
    rej = slip_free(template, task, r)
    if rej is not None:
        out.append(rej)
    return out
