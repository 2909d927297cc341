"""Constructive stream (DESIGN §4): corrupt one turn of a verified-safe rollout at step k with a
typed error, replay the rest with the same policy, and keep the result only if the run now fails
and the targeted turn really changed (no downstream recovery). Label: (k, agent at k).

Error types: computation_slip, verdict_misread, wrong_entity, fabricated_tool_result,
wrong_tool_argument, premature_termination. `targets(…)` lists the steps a type applies to in a
rollout; `corrupt(…)` builds the corrupted turn (content and the simulator's reading agree, so
the downstream agents act on the corruption).

    from aftraj.corpus.inject import inject
    res = inject(template, task, policy, safe_rollout, "computation_slip", k, seed=0, sandbox=sb)
    res.kept, res.rollout
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace

from aftraj.corpus.config import ERROR_TYPES
from aftraj.corpus.rollout import Rollout, Turn, replay_with
from aftraj.corpus.tasks import eval_arith, fmt_num, full_expression
from aftraj.corpus.templates import PHRASE

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


def _act(t: Turn) -> str | None:
    return t.sim.get("act")


# --------------------------------------------------------------------------- where each type applies

def targets(template, task, turns: list[Turn], etype: str) -> list[int]:
    """Steps of a rollout where `etype` can be injected (never the request, never a tool result)."""
    d = template.domain
    out = []
    for i, t in enumerate(turns):
        a = _act(t)
        if i == 0 or t.kind == "tool_result":
            continue
        if str(a).startswith("llm_"):
            if _generic(template, turns, i, etype) is not None:
                out.append(i)
            continue
        ok = False
        if etype == "computation_slip":
            ok = (d == "math" and a == "claim") or (d == "coding" and a == "code" and _is_correct_code(task, t)) \
                or (d == "agentic" and a == "claim" and str(t.sim.get("value", "")).isdigit())
        elif etype == "verdict_misread":
            ok = (d in ("math", "coding") and a == "verdict" and t.sim.get("ok")) or (d == "agentic" and a == "confirm")
        elif etype == "wrong_entity":
            ok = (d == "math" and a == "call" and _math_index(task, t.sim.get("sg")) >= 2) or \
                 (d == "coding" and a == "code" and _is_correct_code(task, t)) or (d == "agentic" and a == "claim")
        elif etype == "fabricated_tool_result":
            ok = (d == "math" and a == "call") or (d == "coding" and a == "tcall") or (d == "agentic" and a == "lookup")
        elif etype == "wrong_tool_argument":
            ok = (d == "math" and a == "call") or (d == "coding" and a == "tcall") or (d == "agentic" and a == "lookup")
        elif etype == "premature_termination":
            ok = (d == "math" and a == "call" and _math_index(task, t.sim.get("sg")) >= 1) or \
                 (d == "coding" and a == "code") or (d == "agentic" and a == "search" and t.sim.get("hop", 0) >= 1)
        if ok:
            out.append(i)
    return out


def _is_correct_code(task, t: Turn) -> bool:
    from aftraj.corpus.tasks import code_from_text

    return code_from_text(t.content) == task.data["variants"]["correct"]


def _math_index(task, sg) -> int:
    ids = [p["id"] for p in task.data.get("plan", [])]
    return ids.index(sg) if sg in ids else -1


def _math_claims(turns: list[Turn]) -> dict:
    return {t.sim["sg"]: t.sim["value"] for t in turns if _act(t) == "claim"}


def _bump(v: str, salt: int) -> str:
    delta = [1, -1, 2, -2, 10][salt % 5]
    return fmt_num(eval_arith(v) + delta)


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
    """The corrupted version of turn k (None when this type cannot change it)."""
    t, d = turns[k], template.domain
    if str(_act(t)).startswith("llm_"):
        return _generic(template, turns, k, etype)
    salt = _h(task.id, etype, k)
    if etype == "computation_slip":
        if d == "math":
            v = _bump(t.sim["value"], salt)
            return replace(t, content=re.sub(r"come to .*\.$", f"come to {v}.", t.content), sim={**t.sim, "value": v}, slip=None)
        if d == "coding":
            bugs = sorted(x for x in task.data["variants"] if x.startswith("bug:"))
            if not bugs:
                return None
            b = bugs[salt % len(bugs)]
            return template._code_turn(task.data["variants"][b], b, t.sim.get("attempt", 0), None)
        v = str(int(t.sim["value"]) + [1, -1, 10][salt % 3])
        return replace(t, content=t.content.replace(f" is {t.sim['value']} ", f" is {v} ", 1), sim={**t.sim, "value": v}, slip=None)
    if etype == "verdict_misread":
        if d == "math":
            wrong = _bump(str(t.sim["expected"]), salt)
            return replace(t, content=f"INCORRECT: I get {wrong}, not {t.sim['expected']}.",
                           sim={"act": "verdict", "ok": False, "expected": wrong}, slip=None)
        if d == "coding":
            return replace(t, content="REJECT: test_0 fails on the edge case.", sim={"act": "verdict", "ok": False}, slip=None)
        claims = [u for u in turns[:k] if _act(u) == "claim"]
        hops = task.data["hops"]
        wrong = hops[-1]["subject"] if len(hops) > 1 else (claims[0].sim["value"] if claims else "unknown")
        if claims and len(claims) >= 2:
            wrong = str(claims[-2].sim["value"])
        if str(wrong) == str(t.sim.get("value")):
            return None
        return replace(t, content=f"Evidence checked. The answer is {wrong}.", sim={"act": "confirm", "value": wrong}, slip=None)
    if etype == "wrong_entity":
        if d == "math":
            plan = task.data["plan"]
            ids = [p["id"] for p in plan]
            sg = plan[_math_index(task, t.sim["sg"])]
            claims = _math_claims(turns[:k])
            refs = [j for j, a in enumerate(sg["args"]) if isinstance(a, str)]
            others = [x for x in ids[:_math_index(task, sg["id"])] if x != sg["args"][refs[0]] and x in claims] if refs else []
            if not others:
                return None
            args = [claims.get(a, "0") if isinstance(a, str) else str(a) for a in sg["args"]]
            args[refs[0]] = claims[others[salt % len(others)]]
            expr = sg["template"].format(*args)
            if expr == t.arguments["expression"]:
                return None
            return replace(t, arguments={"expression": expr}, slip=None)
        if d == "coding":
            return template._code_turn(task.data["variants"]["wrong_name"], "wrong_name", t.sim.get("attempt", 0), None)
        hop = t.sim["hop"]
        rel = task.data["hops"][hop]["relation"]
        wrong = [doc for doc in task.data["docs"] if rel in doc["facts"] and str(doc["facts"][rel]) != str(t.sim["value"])]
        if not wrong:
            return None
        subj_first = t.content.split(" of ", 1)[-1].split(" ")[0]
        near = [doc for doc in wrong if doc["title"].startswith(subj_first)] or wrong
        doc = near[salt % len(near)]
        v = str(doc["facts"][rel])
        return replace(t, content=t.content.replace(f" is {t.sim['value']} ", f" is {v} ", 1), sim={**t.sim, "value": v}, slip=None)
    if etype == "fabricated_tool_result":
        if d == "math":
            true = eval_arith(t.arguments["expression"])
            v = fmt_num(true + [3, -3, 7, -5][salt % 4])
            desc = next(p["desc"] for p in task.data["plan"] if p["id"] == t.sim["sg"])
            return Turn(agent=t.agent, kind="message", content=f"compute returned {v}, so the {desc} come to {v}.",
                        sim={"act": "claim", "sg": t.sim["sg"], "value": v})
        if d == "coding":
            return Turn(agent=t.agent, kind="message", content="Ran the tests: passed 1/3 tests\nFAIL test_1: assertion failed",
                        sim={"act": "report", "passed": False})
        hop = t.sim["hop"]
        rel = task.data["hops"][hop]["relation"]
        wrong = sorted({str(doc["facts"][rel]) for doc in task.data["docs"] if rel in doc["facts"]}
                       - {str(task.data["hops"][hop]["answer"])})
        if not wrong:
            return None
        v = wrong[salt % len(wrong)]
        did = t.arguments.get("doc_id")
        return Turn(agent=t.agent, kind="message", content=f"lookup({did}) says the {PHRASE[rel]} is {v}.",
                    sim={"act": "claim", "hop": hop, "value": v, "doc_id": did})
    if etype == "wrong_tool_argument":
        if d == "math":
            expr = t.arguments["expression"]
            nums = list(re.finditer(r"\d+", expr))
            m = nums[salt % len(nums)]
            new = expr[:m.start()] + str(int(m.group()) + [1, 2, -1][salt % 3]) + expr[m.end():]
            if new == expr or eval_arith(new) == eval_arith(expr):
                return None
            return replace(t, arguments={"expression": new}, slip=None)
        if d == "coding":
            return replace(t, arguments={**t.arguments, "function": t.arguments["function"].rsplit("_", 1)[0]}, slip=None)
        prev = next((u for u in reversed(turns[:k]) if u.kind == "tool_result" and u.sim.get("of") == "search"), None)
        hits = [h for h in (prev.sim.get("hits") if prev else []) if h != t.arguments["doc_id"]]
        if not hits:
            return None
        did = hits[salt % len(hits)]
        return replace(t, content=f"Reading {did}.", arguments={"doc_id": did}, slip=None)
    if etype == "premature_termination":
        if d == "math":
            claims = _math_claims(turns[:k])
            if not claims:
                return None
            ans = list(claims.values())[-1]
            return Turn(agent=t.agent, kind="final_answer", content=f"FINAL ANSWER: {ans} (that should be it)",
                        sim={"act": "final", "answer": ans})
        if d == "coding":
            stub = task.data["variants"]["stub"]
            return Turn(agent="CodeWriter", kind="final_answer", content=f"FINAL ANSWER: (good enough)\n```python\n{stub}```",
                        sim={"act": "final"})
        claims = [u for u in turns[:k] if _act(u) == "claim"]
        if not claims:
            return None
        ans = str(claims[-1].sim["value"])
        return Turn(agent="Manager", kind="final_answer", content=f"FINAL ANSWER: {ans} (enough evidence)",
                    sim={"act": "final", "answer": ans})
    raise ValueError(f"unknown error type {etype!r} (known: {', '.join(ERROR_TYPES)})")


# --------------------------------------------------------------------------- inject + replay

@dataclass
class InjectionResult:
    etype: str
    step: int
    kept: bool
    outcome: str          # kept | recovered | unchanged | not_applicable
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
    r = replay_with(template, task, policy, safe.turns, k, bad, seed=seed, sandbox=sandbox, max_steps=max_steps)
    if not r.turns[k].same_as(bad):
        return InjectionResult(etype, k, False, "unchanged", orig, bad, r, "the replay did not keep the turn")
    if r.success:
        return InjectionResult(etype, k, False, "recovered", orig, bad, r, "the run recovered downstream")
    return InjectionResult(etype, k, True, "kept", orig, bad, r, f"{template.domain}: {DESCRIPTIONS[etype]}")


__all__ = ["targets", "corrupt", "inject", "InjectionResult", "DESCRIPTIONS", "full_expression"]
