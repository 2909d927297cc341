"""Constructive stream (DESIGN §4): corrupt one turn of a verified-safe rollout at step k with a
typed error, replay the rest with the same policy, and keep the result only if the run now fails
and the targeted turn really changed (no downstream recovery). Label: (k, agent at k).

Error types: computation_slip, verdict_misread, wrong_entity, fabricated_tool_result,
wrong_tool_argument, premature_termination. `targets(…)` lists the steps a type applies to in a
rollout; `corrupt(…)` builds the corrupted turn with the template's own turn builders (content
and the simulator's reading agree, so the downstream agents act on the corruption). Both are
tables, per domain and error type, in each domain's module (`aftraj.corpus.domains.<domain>`:
`targets`, `corruptions`); free-form (openai-backend) turns are corrupted here, by text. A corruption
is kept only if the slip detector (`aftraj.corpus.slips`, the same definitions safe curation
uses) sees it in the prefix that ends at it.

    from aftraj.corpus.inject import inject
    res = inject(template, task, policy, safe_rollout, "computation_slip", k, seed=0, sandbox=sb)
    res.kept, res.rollout
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace

from aftraj.corpus.config import ERROR_TYPES
from aftraj.corpus.domains import DOMAINS
from aftraj.corpus.domains.base import act
from aftraj.corpus.rollout import Rollout, Turn, replay_with
from aftraj.corpus.slips import slips_at

DESCRIPTIONS = {
    "computation_slip": "states a wrong value for a computation or fact it had correctly in hand",
    "verdict_misread": "misreads the check and reports the wrong verdict",
    "wrong_entity": "uses the wrong entity (a different quantity, name or document subject)",
    "fabricated_tool_result": "reports a tool result that no tool call produced",
    "wrong_tool_argument": "calls a tool with a wrong argument",
    "premature_termination": "ends the run with an answer before the work is done",
}


def _h(*parts) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=4).digest(), "big")


# --------------------------------------------------------------------------- where each type applies

def targets(template, task, turns: list[Turn], etype: str) -> list[int]:
    """Steps of a rollout where `etype` can be injected (never the request, never a tool result)."""
    d = DOMAINS.get(template.domain)
    applies = d.targets.get(etype) if d is not None else None
    out = []
    for i, t in enumerate(turns):
        if i == 0 or t.kind == "tool_result":
            continue
        if str(act(t)).startswith("llm_"):
            if _generic(template, turns, i, etype) is not None:
                out.append(i)
        elif applies is not None and applies(task, t):
            out.append(i)
    return out


# --------------------------------------------------------------------------- corruptions

_NUM = re.compile(r"-?\d+(?:\.\d+)?")
_FLIPS = (("INCORRECT", "CORRECT"), ("REJECT", "APPROVE"))


def _generic(template, turns: list[Turn], k: int, etype: str) -> Turn | None:
    """Corruptions of free-form (openai-backend) turns, by text: the same six types where the
    turn allows them (wrong_entity needs structure and is not attempted)."""
    t = turns[k]
    if etype == "computation_slip" and t.kind in ("message", "final_answer"):
        nums = list(_NUM.finditer(t.content))
        if nums:
            m = nums[-1]
            v = str(int(float(m.group())) + 1)
            return replace(t, content=t.content[:m.start()] + v + t.content[m.end():], slip=None)
    if etype == "verdict_misread" and t.kind == "message" and t.agent == template.partner:
        for bad, good in _FLIPS:
            if bad in t.content:
                return replace(t, content=t.content.replace(bad, good, 1), slip=None)
            if good in t.content:
                return replace(t, content=t.content.replace(good, bad, 1), slip=None)
    if etype == "fabricated_tool_result" and t.kind == "tool_call" and not t.error:
        return Turn(agent=t.agent, kind="message", content=f"I ran {t.tool}; it returned 0.", sim={"act": "llm_message"})
    if etype == "wrong_tool_argument" and t.kind == "tool_call" and not t.error and t.arguments:
        key = sorted(t.arguments)[0]
        val = t.arguments[key]
        new = str(val) + "1" if isinstance(val, str) else val
        if new != val:
            return replace(t, arguments={**t.arguments, key: new}, slip=None)
    if etype == "premature_termination" and t.agent == template.lead and t.kind in ("message", "tool_call"):
        nums = _NUM.findall(t.content)
        ans = nums[-1] if nums else "unknown"
        return Turn(agent=t.agent, kind="final_answer", content=f"FINAL ANSWER: {ans}", sim={"act": "llm_final"})
    return None


def corrupt(template, task, turns: list[Turn], k: int, etype: str) -> Turn | None:
    """The corrupted version of turn k (None when this type cannot change it), phrased with the
    template's own turn builders, so it reads like an honest turn of the same act."""
    if str(act(turns[k])).startswith("llm_"):
        return _generic(template, turns, k, etype)
    if etype == "fabricated_tool_result" and act(turns[k - 1]) == "precall":
        # a result stated right after announcing the call: two messages where a message and a call
        # stand in every other run (the step kinds alone would tell)
        return None
    d = DOMAINS.get(template.domain)
    fn = d.corruptions.get(etype) if d is not None else None
    if fn is None:
        raise ValueError(f"unknown error type {etype!r} (known: {', '.join(ERROR_TYPES)})")
    return fn(template, task, turns, k, _h(task.id, etype, k))


# --------------------------------------------------------------------------- inject + replay

@dataclass
class InjectionResult:
    etype: str
    step: int
    kept: bool
    outcome: str          # kept | recovered | unchanged | not_applicable | invisible
    original: Turn
    corrupted: Turn | None
    rollout: Rollout | None
    reason: str

    def provenance(self) -> dict:
        return {"injection_type": self.etype, "step": self.step, "description": DESCRIPTIONS[self.etype],
                "original_turn": self.original.content[:500],
                "original_arguments": self.original.arguments,
                "replay": {"outcome": "success" if self.rollout and self.rollout.success else "failure",
                           "check": self.rollout.check_reason[:500] if self.rollout else None}}


def inject(template, task, policy, safe: Rollout, etype: str, k: int, *, seed: int, sandbox=None,
           max_steps: int = 40) -> InjectionResult:
    orig = safe.turns[k]
    bad = corrupt(template, task, safe.turns, k, etype)
    if bad is None:
        return InjectionResult(etype, k, False, "not_applicable", orig, None, None, "the type cannot change this turn")
    if bad.same_as(orig):
        return InjectionResult(etype, k, False, "unchanged", orig, bad, None, "the corruption did not change the turn")
    if not str(act(bad)).startswith("llm_") and not slips_at(template, task, list(safe.turns[:k]) + [bad], k):
        return InjectionResult(etype, k, False, "invisible", orig, bad, None,
                               "the slip detector does not see the corruption in the prefix that ends at it")
    r = replay_with(template, task, policy, safe.turns, k, bad, seed=seed, sandbox=sandbox, max_steps=max_steps)
    if not r.turns[k].same_as(bad):
        return InjectionResult(etype, k, False, "unchanged", orig, bad, r, "the replay did not keep the turn")
    if r.success:
        return InjectionResult(etype, k, False, "recovered", orig, bad, r, "the run recovered downstream")
    return InjectionResult(etype, k, True, "kept", orig, bad, r, f"{template.domain}: {DESCRIPTIONS[etype]}")


__all__ = ["targets", "corrupt", "inject", "InjectionResult", "DESCRIPTIONS"]
