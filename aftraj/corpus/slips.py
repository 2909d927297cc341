"""The slip detector (DESIGN §4 "Validity"): one predicate per injection type and domain, each
reading only the prefix that ends at the step it judges (the step's content, the turns before it
and the task), never the simulator's slip record. Three users, one definition:

- safe curation rejects a successful run that holds any slip, even one caught later;
- the injector keeps a corruption only if the detector sees it at its step (the error is
  visible in the prefix that ends at it);
- the scripted diagnosis judge proposes the detector's findings on a failed run.

    from aftraj.corpus.slips import find_slips
    for f in find_slips(template, task, rollout.turns): print(f.step, f.type, f.reason)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from aftraj.corpus.config import ERROR_TYPES
from aftraj.corpus.tasks import code_blocks, eval_arith, functions_of


@dataclass(frozen=True)
class Finding:
    step: int
    agent: str
    type: str
    reason: str


def _act(t) -> str | None:
    return t.sim.get("act")


def _num_eq(a, b) -> bool:
    try:
        return eval_arith(str(a)) == eval_arith(str(b))
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return str(a).strip() == str(b).strip()


# =========================================================================== math

def _m_claims(turns) -> dict:
    return {t.sim["sg"]: t.sim["value"] for t in turns if _act(t) == "claim"}


def m_computation_slip(tpl, task, turns, j):
    t, p = turns[j], turns[j - 1]
    if _act(t) != "claim" or p.kind != "tool_result":
        return None
    if not p.error and not _num_eq(t.sim["value"], p.content):
        return f"claims {t.sim['value']} where compute returned {p.content.strip()}"
    if p.error and j >= 2:
        expr = next(iter((turns[j - 2].arguments or {}).values()), None)
        if isinstance(expr, str) and not _num_eq(t.sim["value"], expr):
            return f"claims {t.sim['value']} for {expr} worked by hand"
    return None


def m_fabricated_tool_result(tpl, task, turns, j):
    t, p = turns[j], turns[j - 1]
    if _act(t) == "claim" and p.kind != "tool_result":
        return f"states a result for the {tpl.desc(task, t.sim['sg'])} that no compute call produced"
    return None


def _m_call_problem(tpl, task, turns, j) -> tuple[str, str] | None:
    t = turns[j]
    if _act(t) != "call":
        return None
    sg = t.sim["sg"]
    claims = _m_claims(turns[:j])
    expected = tpl.expected_call(task, sg, claims)
    actual = next(iter((t.arguments or {}).values()), None)
    if not isinstance(actual, str) or actual == expected or _num_eq(actual, expected):
        return None
    plan = next(p for p in task.data["plan"] if p["id"] == sg)
    refs = [i for i, a in enumerate(plan["args"]) if isinstance(a, str)]
    for i in refs:
        for other, v in claims.items():
            args = [claims.get(a, "0") if isinstance(a, str) else str(a) for a in plan["args"]]
            args[i] = v
            if other != plan["args"][i] and plan["template"].format(*args) == actual:
                return "wrong_entity", f"computes the {plan['desc']} from the {tpl.desc(task, other)} ({v})"
    return "wrong_tool_argument", f"calls compute with {actual} where the givens make it {expected}"


def m_wrong_entity(tpl, task, turns, j):
    r = _m_call_problem(tpl, task, turns, j)
    return r[1] if r and r[0] == "wrong_entity" else None


def m_wrong_tool_argument(tpl, task, turns, j):
    r = _m_call_problem(tpl, task, turns, j)
    return r[1] if r and r[0] == "wrong_tool_argument" else None


def m_verdict_misread(tpl, task, turns, j):
    t = turns[j]
    if _act(t) != "verdict":
        return None
    res = next((u for u in reversed(turns[:j]) if u.kind == "tool_result" and u.sim.get("of") == "vcall"), None)
    last_sg = task.data["plan"][-1]["id"]
    claimed = _m_claims(turns[:j]).get(last_sg)
    if res is None or res.error or claimed is None:
        return None
    agree = _num_eq(res.content, claimed)
    if t.sim.get("ok") and not agree:
        return f"says CORRECT although the recomputation gives {res.content.strip()}, not {claimed}"
    if not t.sim.get("ok") and (agree or not _num_eq(t.sim.get("expected"), res.content)):
        return f"says INCORRECT (expected {t.sim.get('expected')}) although the recomputation gives {res.content.strip()}"
    return None


def m_premature_termination(tpl, task, turns, j):
    t = turns[j]
    if t.kind != "final_answer":
        return None
    missing = [p["desc"] for p in task.data["plan"] if p["id"] not in _m_claims(turns[:j])]
    if missing:
        return f"answers before finding the {missing[0]}"
    return None


# =========================================================================== coding

def _function(task, fn):
    return next((f for f in functions_of(task) if f["function"] == fn), None)


def _code_of(t) -> str:
    blocks = code_blocks(t.content)
    return blocks[-1] if blocks else ""


def c_computation_slip(tpl, task, turns, j):
    t = turns[j]
    f = _function(task, t.sim.get("function")) if _act(t) == "code" else None
    if f is None:
        return None
    code = _code_of(t)
    wrong = {k for k, v in f["variants"].items() if v == code and (k.startswith("bug:") or k == "stub")}
    if wrong:
        return f"posts an implementation of `{f['function']}` that departs from its spec ({sorted(wrong)[0]})"
    return None


def c_wrong_entity(tpl, task, turns, j):
    t = turns[j]
    f = _function(task, t.sim.get("function")) if _act(t) == "code" else None
    if f is None:
        return None
    code = _code_of(t)
    if code and not re.search(rf"^def {re.escape(f['function'])}\(", code, re.M):
        names = re.findall(r"^def (\w+)\(", code, re.M)
        return f"defines `{names[-1] if names else '?'}`, a function the spec does not name, instead of `{f['function']}`"
    return None


def c_wrong_tool_argument(tpl, task, turns, j):
    t = turns[j]
    if _act(t) != "tcall":
        return None
    latest = next((u for u in reversed(turns[:j]) if _act(u) == "code"), None)
    fn = latest.sim.get("function") if latest else None
    args = t.arguments or {}
    if args.get("suite") != "public":
        return f"runs the {args.get('suite')!r} suite instead of the public tests"
    if fn is not None and args.get("function") != fn:
        return f"tests {args.get('function')!r} instead of `{fn}`, the code just posted"
    return None


_RUN = re.compile(r"passed (\d+)/(\d+) tests")


def c_fabricated_tool_result(tpl, task, turns, j):
    t = turns[j]
    if t.kind == "message" and t.agent == tpl.partner and _RUN.search(t.content) and _act(t) != "verdict":
        return "reports a test run that no run_tests call produced"
    return None


def c_verdict_misread(tpl, task, turns, j):
    t = turns[j]
    if _act(t) != "verdict":
        return None
    p = turns[j - 1]
    m = _RUN.search(p.content)
    if p.kind == "tool_result" and not p.error and m:
        passed = m.group(1) == m.group(2)
    elif p.kind == "tool_result" and p.error:
        passed = False
    else:
        return None   # a verdict on a report (a fabricated one is flagged where it was made)
    if bool(t.sim.get("ok")) != passed:
        return f"{'approves' if t.sim.get('ok') else 'rejects'} although the run says {m.group(0) if m else p.content[:80]}"
    return None


def c_premature_termination(tpl, task, turns, j):
    t = turns[j]
    if t.kind != "final_answer" or str(_act(t)).startswith("llm_"):
        return None
    prog = tpl.progress(task, turns[:j])
    open_ = [fn for fn, p in prog.items() if not p["approved"]]
    if open_:
        return f"answers before `{open_[0]}` is written and approved"
    return None


# =========================================================================== agentic

def _a_doc(task, did):
    return next((d for d in task.data["docs"] if d["id"] == did), None)


def _a_claim_problem(tpl, task, turns, j) -> tuple[str, str] | None:
    t, p = turns[j], turns[j - 1]
    if _act(t) != "claim" or p.kind != "tool_result" or p.sim.get("of") != "lookup" or p.error:
        return None
    doc = _a_doc(task, (p.result_ids or [None])[0])
    rel = task.data["hops"][t.sim["hop"]]["relation"]
    if doc is None or rel not in doc["facts"]:
        return None
    fact, v = str(doc["facts"][rel]), str(t.sim["value"])
    if v == fact:
        return None
    others = {str(d["facts"][rel]) for d in task.data["docs"] if rel in d["facts"] and d["id"] != doc["id"]}
    if v in others:
        return "wrong_entity", f"reports {v}, another entity's {rel}; {doc['id']} says {fact}"
    return "computation_slip", f"reports {v} where {doc['id']} says {fact}"


def a_computation_slip(tpl, task, turns, j):
    r = _a_claim_problem(tpl, task, turns, j)
    return r[1] if r and r[0] == "computation_slip" else None


def a_wrong_entity(tpl, task, turns, j):
    r = _a_claim_problem(tpl, task, turns, j)
    return r[1] if r and r[0] == "wrong_entity" else None


def a_fabricated_tool_result(tpl, task, turns, j):
    t, p = turns[j], turns[j - 1]
    if _act(t) == "claim" and not (p.kind == "tool_result" and p.sim.get("of") == "lookup"):
        return "states a fact that no lookup returned"
    return None


def a_wrong_tool_argument(tpl, task, turns, j):
    t, p = turns[j], turns[j - 1]
    if _act(t) != "lookup" or p.kind != "tool_result" or p.sim.get("of") != "search":
        return None
    claims, _ = tpl._claims(turns[:j])
    subj = tpl._subject(task, claims, t.sim["hop"])
    exact = [h for h in (p.result_ids or ()) if (_a_doc(task, h) or {}).get("title") == subj]
    did = (t.arguments or {}).get("doc_id")
    if exact and did not in exact:
        return f"opens {did} although the search listed {exact[0]} ({subj})"
    return None


def a_verdict_misread(tpl, task, turns, j):
    t = turns[j]
    if _act(t) != "confirm":
        return None
    claims, _ = tpl._claims(turns[:j])
    last = len(task.data["hops"]) - 1
    if last not in claims:
        return "confirms an answer before every hop has a claim"
    if str(t.sim.get("value")) != str(claims[last]["value"]):
        return f"confirms {t.sim.get('value')} although the last hop found {claims[last]['value']}"
    bad = tpl._check_chain(task, turns[:j], claims)
    if bad is not None:
        return f"confirms although the evidence for hop {bad + 1} does not hold"
    return None


def a_premature_termination(tpl, task, turns, j):
    t = turns[j]
    if t.kind != "final_answer" or str(_act(t)).startswith("llm_"):
        return None
    claims, _ = tpl._claims(turns[:j])
    missing = [h for h in range(len(task.data["hops"])) if h not in claims]
    if missing:
        return f"answers before hop {missing[0] + 1} is found"
    if not any(_act(u) == "confirm" for u in turns[:j]):
        return "answers before the evidence is checked"
    return None


Predicate = Callable[..., "str | None"]
PREDICATES: dict[str, dict[str, Predicate]] = {
    "math": {"computation_slip": m_computation_slip, "verdict_misread": m_verdict_misread,
             "wrong_entity": m_wrong_entity, "fabricated_tool_result": m_fabricated_tool_result,
             "wrong_tool_argument": m_wrong_tool_argument, "premature_termination": m_premature_termination},
    "coding": {"computation_slip": c_computation_slip, "verdict_misread": c_verdict_misread,
               "wrong_entity": c_wrong_entity, "fabricated_tool_result": c_fabricated_tool_result,
               "wrong_tool_argument": c_wrong_tool_argument, "premature_termination": c_premature_termination},
    "agentic": {"computation_slip": a_computation_slip, "verdict_misread": a_verdict_misread,
                "wrong_entity": a_wrong_entity, "fabricated_tool_result": a_fabricated_tool_result,
                "wrong_tool_argument": a_wrong_tool_argument, "premature_termination": a_premature_termination},
}
assert all(set(p) == set(ERROR_TYPES) for p in PREDICATES.values())


def slips_at(template, task, turns, j: int) -> list[Finding]:
    """Every injection type whose predicate holds at step j (reading turns[: j + 1] only)."""
    t = turns[j]
    if j == 0 or t.kind == "tool_result" or str(_act(t)).startswith("llm_"):
        return []
    prefix = list(turns[: j + 1])
    out = []
    for etype, pred in PREDICATES.get(template.domain, {}).items():
        why = pred(template, task, prefix, j)
        if why:
            out.append(Finding(j, t.agent, etype, why))
    return out


def find_slips(template, task, turns) -> list[Finding]:
    """Every slip of a run, earliest first."""
    return [f for j in range(1, len(turns)) for f in slips_at(template, task, turns, j)]


__all__ = ["Finding", "PREDICATES", "find_slips", "slips_at"]
