"""Constructive stream (DESIGN §4): corrupt one turn of a verified-safe rollout at step k with a
typed error, replay the rest with the same policy, and keep the result only if the run now fails
and the targeted turn really changed (no downstream recovery). Label: (k, agent at k).

Error types: computation_slip, verdict_misread, wrong_entity, fabricated_tool_result,
wrong_tool_argument, premature_termination. `targets(…)` lists the steps a type applies to in a
rollout; `corrupt(…)` builds the corrupted turn with the template's own turn builders (content
and the simulator's reading agree, so the downstream agents act on the corruption). A corruption
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
from aftraj.corpus.rollout import Rollout, Turn, replay_with
from aftraj.corpus.slips import slips_at
from aftraj.corpus.tasks import eval_arith, fmt_num, full_expression

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
                or (d == "agentic" and a == "claim" and len(str(t.sim.get("value", ""))) >= 3)
        elif etype == "verdict_misread":
            ok = (d in ("math", "coding") and a == "verdict" and t.sim.get("ok")) or (d == "agentic" and a == "confirm")
        elif etype == "wrong_entity":
            ok = (d == "math" and a == "call" and _math_index(task, t.sim.get("sg")) >= 2) or \
                 (d == "coding" and a == "code" and _is_correct_code(task, t)) or (d == "agentic" and a == "claim")
        elif etype in ("fabricated_tool_result", "wrong_tool_argument"):
            ok = (d == "math" and a == "call") or (d == "coding" and a == "tcall") or (d == "agentic" and a == "lookup")
        elif etype == "premature_termination":
            ok = (d == "math" and a == "call" and _math_index(task, t.sim.get("sg")) >= 1) or \
                 (d == "coding" and a == "code") or (d == "agentic" and a == "search" and t.sim.get("hop", 0) >= 1)
        if ok:
            out.append(i)
    return out


def _is_correct_code(task, t: Turn) -> bool:
    from aftraj.corpus.tasks import code_blocks, function_named

    f = function_named(task, t.sim.get("function"))
    blocks = code_blocks(t.content)
    return f is not None and bool(blocks) and blocks[-1] == f["variants"]["correct"]


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
    """The corrupted version of turn k (None when this type cannot change it), phrased with the
    template's own turn builders, so it reads like an honest turn of the same act."""
    t, d = turns[k], template.domain
    if str(_act(t)).startswith("llm_"):
        return _generic(template, turns, k, etype)
    fn = _CORRUPTIONS.get((d, etype))
    if fn is None:
        raise ValueError(f"unknown error type {etype!r} (known: {', '.join(ERROR_TYPES)})")
    return fn(template, task, turns, k, _h(task.id, etype, k))


# --- math

def _m_computation(tpl, task, turns, k, salt):
    t = turns[k]
    return tpl.claim_turn(task, t.sim["sg"], _bump(t.sim["value"], salt))


def _m_verdict(tpl, task, turns, k, salt):
    t = turns[k]
    n = sum(_act(u) == "verdict" for u in turns[:k])
    return tpl.verdict_turn(task, False, t.sim["expected"], _bump(str(t.sim["expected"]), salt), n)


def _m_calls(turns, sg, k) -> int:
    return sum(_act(u) == "call" and u.sim.get("sg") == sg for u in turns[:k])


def _m_entity(tpl, task, turns, k, salt):
    t = turns[k]
    plan = task.data["plan"]
    ids = [p["id"] for p in plan]
    sg = plan[_math_index(task, t.sim["sg"])]
    claims = _math_claims(turns[:k])
    refs = [j for j, a in enumerate(sg["args"]) if isinstance(a, str)]
    others = [x for x in ids[:_math_index(task, sg["id"])] if refs and x != sg["args"][refs[0]] and x in claims
              and claims[x] != claims.get(sg["args"][refs[0]])]
    if not others:
        return None
    args = [claims.get(a, "0") if isinstance(a, str) else str(a) for a in sg["args"]]
    args[refs[0]] = claims[others[salt % len(others)]]
    expr = sg["template"].format(*args)
    if expr == t.arguments["expression"]:
        return None
    return tpl.call_turn(task, sg["id"], expr, attempt=_m_calls(turns, sg["id"], k))


def _m_fabricated(tpl, task, turns, k, salt):
    t = turns[k]
    true = eval_arith(t.arguments["expression"])
    return tpl.claim_turn(task, t.sim["sg"], fmt_num(true + [3, -3, 7, -5][salt % 4]))


def _m_argument(tpl, task, turns, k, salt):
    t = turns[k]
    expr = t.arguments["expression"]
    nums = list(re.finditer(r"\d+", expr))
    m = nums[salt % len(nums)]
    new = expr[:m.start()] + str(int(m.group()) + [1, 2, -1][salt % 3]) + expr[m.end():]
    try:
        if new == expr or eval_arith(new) == eval_arith(expr):
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return tpl.call_turn(task, t.sim["sg"], new, attempt=_m_calls(turns, t.sim["sg"], k))


def _m_premature(tpl, task, turns, k, salt):
    claims = _math_claims(turns[:k])
    if not claims:
        return None
    return tpl.final_turn(task, list(claims.values())[-1])


# --- coding

def _c_function(task, t):
    from aftraj.corpus.tasks import function_named

    return function_named(task, t.sim.get("function"))


def _c_computation(tpl, task, turns, k, salt):
    t = turns[k]
    f = _c_function(task, t)
    bugs = sorted(x for x in f["variants"] if x.startswith("bug:")) if f else []
    if not bugs:
        return None
    return tpl.code_turn(task, f["function"], f["variants"][bugs[salt % len(bugs)]], t.sim.get("attempt", 0))


def _c_entity(tpl, task, turns, k, salt):
    t = turns[k]
    f = _c_function(task, t)
    return tpl.code_turn(task, f["function"], f["variants"]["wrong_name"], t.sim.get("attempt", 0)) if f else None


def _c_verdict(tpl, task, turns, k, salt):
    t = turns[k]
    fn = t.sim.get("function")
    n = sum(_act(u) == "verdict" and u.sim.get("function") == fn for u in turns[:k])
    return tpl.verdict_turn(task, fn, False, "FAIL test_0: fails on the edge case", n)


def _c_fabricated(tpl, task, turns, k, salt):
    fn = turns[k].sim.get("function")
    return Turn(agent=tpl.partner, kind="message",
                content=f"Thought: I already know how this goes.\nRan the tests on `{fn}`: passed 1/3 tests\n"
                        "FAIL test_1: assertion failed", sim={"act": "report", "passed": False, "function": fn})


def _c_argument(tpl, task, turns, k, salt):
    t = turns[k]
    fn = t.sim.get("function")
    n = sum(_act(u) == "verdict" and u.sim.get("function") == fn for u in turns[:k])
    return tpl.tcall_turn(task, fn, "smoke", n)


def _c_premature(tpl, task, turns, k, salt):
    return tpl.final_turn(task, turns[:k])


# --- agentic

def _a_context(tpl, task, turns, k):
    claims, attempts = tpl._claims(turns[:k])
    hop = turns[k].sim["hop"]
    return hop, tpl._subject(task, claims, hop), attempts.get(hop, 0)


def garble(v: str, salt: int) -> str:
    """A fact copied wrong: a year off by a little, a name or city with its last letter changed."""
    if v.isdigit():
        return str(int(v) + [1, -1, 10][salt % 3])
    return v[:-1] + ("e" if v[-1] != "e" else "a")


def _a_computation(tpl, task, turns, k, salt):
    t = turns[k]
    hop, subj, att = _a_context(tpl, task, turns, k)
    return tpl.claim_turn(task, hop, subj, garble(str(t.sim["value"]), salt), t.sim.get("doc_id"), att)


def _a_entity(tpl, task, turns, k, salt):
    t = turns[k]
    hop, subj, att = _a_context(tpl, task, turns, k)
    rel = task.data["hops"][hop]["relation"]
    wrong = [doc for doc in task.data["docs"] if rel in doc["facts"] and str(doc["facts"][rel]) != str(t.sim["value"])]
    if not wrong:
        return None
    near = [doc for doc in wrong if doc["title"].startswith(subj.split(" ")[0])] or wrong
    doc = near[salt % len(near)]
    return tpl.claim_turn(task, hop, subj, str(doc["facts"][rel]), t.sim.get("doc_id"), att)


def _a_verdict(tpl, task, turns, k, salt):
    t = turns[k]
    claims = [u for u in turns[:k] if _act(u) == "claim"]
    hops = task.data["hops"]
    wrong = hops[-1]["subject"] if len(hops) > 1 else (claims[0].sim["value"] if claims else "unknown")
    if len(claims) >= 2:
        wrong = str(claims[-2].sim["value"])
    if str(wrong) == str(t.sim.get("value")):
        return None
    n = sum(_act(u) in ("redo", "confirm") for u in turns[:k])
    return tpl.confirm_turn(task, wrong, n)


def _a_fabricated(tpl, task, turns, k, salt):
    t = turns[k]
    hop, subj, att = _a_context(tpl, task, turns, k)
    rel = task.data["hops"][hop]["relation"]
    wrong = sorted({str(doc["facts"][rel]) for doc in task.data["docs"] if rel in doc["facts"]}
                   - {str(task.data["hops"][hop]["answer"])})
    if not wrong:
        return None
    return tpl.claim_turn(task, hop, subj, wrong[salt % len(wrong)], t.arguments.get("doc_id"), att)


def _a_argument(tpl, task, turns, k, salt):
    t = turns[k]
    hop, subj, att = _a_context(tpl, task, turns, k)
    prev = next((u for u in reversed(turns[:k]) if u.kind == "tool_result" and u.sim.get("of") == "search"), None)
    hits = [h for h in (prev.sim.get("hits") if prev else []) if h != t.arguments["doc_id"]]
    if not hits:
        return None
    return tpl.lookup_turn(task, hop, hits[salt % len(hits)], subj, att)


def _a_premature(tpl, task, turns, k, salt):
    claims = [u for u in turns[:k] if _act(u) == "claim"]
    if not claims:
        return None
    return tpl.final_turn(task, str(claims[-1].sim["value"]))


_CORRUPTIONS = {
    ("math", "computation_slip"): _m_computation, ("math", "verdict_misread"): _m_verdict,
    ("math", "wrong_entity"): _m_entity, ("math", "fabricated_tool_result"): _m_fabricated,
    ("math", "wrong_tool_argument"): _m_argument, ("math", "premature_termination"): _m_premature,
    ("coding", "computation_slip"): _c_computation, ("coding", "verdict_misread"): _c_verdict,
    ("coding", "wrong_entity"): _c_entity, ("coding", "fabricated_tool_result"): _c_fabricated,
    ("coding", "wrong_tool_argument"): _c_argument, ("coding", "premature_termination"): _c_premature,
    ("agentic", "computation_slip"): _a_computation, ("agentic", "verdict_misread"): _a_verdict,
    ("agentic", "wrong_entity"): _a_entity, ("agentic", "fabricated_tool_result"): _a_fabricated,
    ("agentic", "wrong_tool_argument"): _a_argument, ("agentic", "premature_termination"): _a_premature,
}


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
    if not str(_act(bad)).startswith("llm_") and not slips_at(template, task, list(safe.turns[:k]) + [bad], k):
        return InjectionResult(etype, k, False, "invisible", orig, bad, None,
                               "the slip detector does not see the corruption in the prefix that ends at it")
    r = replay_with(template, task, policy, safe.turns, k, bad, seed=seed, sandbox=sandbox, max_steps=max_steps)
    if not r.turns[k].same_as(bad):
        return InjectionResult(etype, k, False, "unchanged", orig, bad, r, "the replay did not keep the turn")
    if r.success:
        return InjectionResult(etype, k, False, "recovered", orig, bad, r, "the run recovered downstream")
    return InjectionResult(etype, k, True, "kept", orig, bad, r, f"{template.domain}: {DESCRIPTIONS[etype]}")


__all__ = ["targets", "corrupt", "inject", "InjectionResult", "DESCRIPTIONS", "full_expression"]
