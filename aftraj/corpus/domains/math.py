"""The math domain (DESIGN §4): multi-step word problems generated from a seed, each a plan of
arithmetic sub-goals; MathSolver + Verifier with the tool `compute`; answers checked exactly, then
symbolically (sympy) for other spellings ("3/4" == "0.75"); its slip predicates, injection
targets and corruptions; the MATH-500 reader (a local copy, nothing downloads).

    from aftraj.corpus.domains.math import DOMAIN, eval_arith
    tasks = DOMAIN.generate(10, seed=0)
"""

from __future__ import annotations

import ast
import random
import re
from fractions import Fraction
from pathlib import Path

from aftraj.corpus.domains.base import (ENV, FINAL_THOUGHTS, NOTE_PERCENT, OPENING_PERCENT, OPTIONAL_UNTIL, PRECALL_PERCENT,
                                        Domain, Task, Template,
                                        act, final_text, jsonl_rows, need, one_type, rid, say)
from aftraj.corpus.rollout import Turn


# =========================================================================== tasks

_MAX_POW_BITS = 100_000


def eval_arith(expr: str) -> Fraction:
    """Exact arithmetic over + - * / // % ** and parentheses (the `compute` tool). Raises ValueError."""
    if len(expr) > 500:
        raise ValueError("expression is longer than 500 characters")
    try:
        tree = ast.parse(expr.replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse expression: {e.msg}") from None

    def ev(n: ast.AST) -> Fraction:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool):
            return Fraction(n.value).limit_denominator(10**9) if isinstance(n.value, float) else Fraction(n.value)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.BinOp):
            a, b = ev(n.left), ev(n.right)
            if isinstance(n.op, ast.Add):
                return a + b
            if isinstance(n.op, ast.Sub):
                return a - b
            if isinstance(n.op, ast.Mult):
                return a * b
            if isinstance(n.op, (ast.Div, ast.FloorDiv, ast.Mod)):
                if b == 0:
                    raise ValueError("division by zero")
                if isinstance(n.op, ast.Div):
                    return a / b
                return Fraction(a // b) if isinstance(n.op, ast.FloorDiv) else a % b
            if isinstance(n.op, ast.Pow):
                if b.denominator != 1 or abs(b) > 64:
                    raise ValueError("exponent must be a small integer")
                # nested powers grow fast ((((9**64)**64)**64)**64 takes a minute): bound the result
                if max(a.numerator.bit_length(), a.denominator.bit_length()) * abs(int(b)) > _MAX_POW_BITS:
                    raise ValueError("the result is too large")
                return a ** int(b)
        raise ValueError(f"unsupported syntax: {type(n).__name__}")

    return ev(tree)


def fmt_num(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


_LATEX = [(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)"), (r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)"),
          (r"\\left|\\right|\\!|\\,|\\;|\$", ""), (r"\\cdot|\\times", "*"), (r"\\pi", "pi"),
          (r"\^\{([^{}]*)\}", r"**(\1)"), (r"\^", "**"), (r"\\boxed\{(.*)\}", r"\1"),
          (r"\\text\{[^{}]*\}", ""), (r"(?<=\d),(?=\d{3}\b)", ""), (r"\\%|%", "")]


def normalise_math(ans: str) -> str:
    s = ans.strip()
    for pat, rep in _LATEX:
        s = re.sub(pat, rep, s)
    return s.strip().rstrip(".").strip()


def math_equal(answer: str | None, reference: str) -> bool:
    """Exact after normalisation, then exact rational arithmetic, then sympy equivalence."""
    if answer is None:
        return False
    a, r = normalise_math(str(answer)), normalise_math(reference)
    if not a:
        return False
    if a == r:
        return True
    try:
        return eval_arith(a) == eval_arith(r)
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError):
        pass
    if len(a) > 200 or len(r) > 200:
        return False
    try:
        ea, er = _sympy_expr(a), _sympy_expr(r)
        import sympy

        return bool(sympy.simplify(ea - er) == 0)
    except Exception:  # noqa: BLE001 - any parse failure means "not equal"
        return False


# sympy's parse_expr evals its input with builtins in scope, and answers are untrusted (model
# output, pool files): only arithmetic, one-letter symbols and these functions reach it.
_SYMPY_TEXT = re.compile(r"[0-9A-Za-z+\-*/().,\s]*")
_SYMPY_FUNCS = ("sqrt", "pi", "exp", "log", "ln", "sin", "cos", "tan", "oo")


def _sympy_expr(s: str):
    import sympy
    from sympy.parsing.sympy_parser import parse_expr

    names = set(re.findall(r"[A-Za-z]+", s))
    if not _SYMPY_TEXT.fullmatch(s) or any(len(n) > 1 and n not in _SYMPY_FUNCS for n in names):
        raise ValueError(f"not a plain math expression: {s[:80]!r}")
    scope = {"__builtins__": {}, "Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational,
             "Symbol": sympy.Symbol, "Function": sympy.Function, "ln": sympy.log, "E": sympy.E, "I": sympy.I,
             **{f: getattr(sympy, f) for f in _SYMPY_FUNCS if f != "ln"}}
    return parse_expr(s, global_dict=scope, evaluate=True)


_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elif", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kira",
          "Luis", "Mira", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Viktor",
          "Wen", "Ximena", "Yusuf", "Zoe"]
_ITEMS = ["apples", "stickers", "marbles", "pencils", "cookies", "stamps", "beads", "books",
          "cards", "shells", "bolts", "seeds", "candles", "buttons", "tiles"]


def gen_math(seed: int, i: int) -> Task:
    rng = random.Random(f"{seed}:math:{i}")
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 9), rng.randint(3, 15)
    text = [f"{name} has {a} boxes with {b} {item} in each box."]
    plan = [{"id": "s1", "desc": f"{item} at the start", "template": "{0} * {1}", "args": [a, b]}]
    value = Fraction(a * b)
    n_ops = rng.randint(1, 8)          # 2 to 9 sub-goals: runs of about 12 to 40 steps
    for j in range(n_ops):
        prev = f"s{len(plan)}"
        sid = f"s{len(plan) + 1}"
        last = j == n_ops - 1
        kinds = ["buy", "give", "triple", "lose_half"] + (["share"] if last else [])
        kind = rng.choice(kinds)
        if kind == "give" and value < 6:
            kind = "buy"
        if kind == "lose_half" and value % 2:
            kind = "buy"
        if kind == "share":
            divs = [d for d in range(2, 10) if value % d == 0]
            if not divs:
                kind = "buy"
        if kind == "buy":
            c, d = rng.randint(2, 6), rng.randint(2, 12)
            text.append(f"Then {name} buys {c} more packs of {d} {item}.")
            step = {"desc": f"{item} after buying the packs", "template": "{0} + {1} * {2}", "args": [prev, c, d]}
            value = value + c * d
        elif kind == "give":
            e = rng.randint(1, int(value) // 2)
            text.append(f"{name} gives {e} {item} to a friend.")
            step = {"desc": f"{item} after giving some away", "template": "{0} - {1}", "args": [prev, e]}
            value = value - e
        elif kind == "triple":
            text.append(f"A generous neighbour triples {name}'s {item}.")
            step = {"desc": f"{item} after tripling", "template": "{0} * {1}", "args": [prev, 3]}
            value = value * 3
        elif kind == "lose_half":
            text.append(f"{name} loses half of the {item}.")
            step = {"desc": f"{item} after losing half", "template": "{0} - {0} / {1}", "args": [prev, 2]}
            value = value - value / 2
        else:
            n = rng.choice(divs)
            text.append(f"Finally {name} shares the {item} equally among {n} friends.")
            step = {"desc": f"{item} each friend gets", "template": "{0} / {1}", "args": [prev, n]}
            value = value / n
        plan.append({"id": sid, **step})
    q = (f"How many {item} does each friend get?" if plan[-1]["template"] == "{0} / {1}"
         else f"How many {item} does {name} have now?")
    prompt = " ".join(text) + " " + q
    return Task(id=f"math/{seed}-{i:05d}", domain="math", source="generated", prompt=prompt,
                reference=fmt_num(value), data={"plan": plan})


def full_expression(plan: list[dict]) -> str:
    """The whole computation as one expression over the task's constants (the Verifier's check)."""
    exprs: dict[str, str] = {}
    for sg in plan:
        args = [f"({exprs[a]})" if isinstance(a, str) else str(a) for a in sg["args"]]
        exprs[sg["id"]] = sg["template"].format(*args)
    return exprs[plan[-1]["id"]]


def read_math500(path: str | Path, limit: int | None = None) -> list[Task]:
    """MATH-500 JSONL: problem, answer, (solution, subject, level, unique_id)."""
    path, out = Path(path), []
    for lineno, row in jsonl_rows(path):
        prob, ans = need(row, "problem", path, lineno), need(row, "answer", path, lineno)
        uid = str(row.get("unique_id") or lineno)
        out.append(Task(id=f"math500/{uid}", domain="math", source="math500", prompt=str(prob),
                        reference=str(ans), data={"subject": row.get("subject"), "level": row.get("level")}))
        if limit and len(out) >= limit:
            break
    return out


def generate(n: int, seed: int, **_) -> list[Task]:
    """n generated word problems."""
    return [gen_math(seed, i) for i in range(n)]


# =========================================================================== template

LEDGER_PERCENT = 35   # a run whose Verifier noted results on the way may end on its sign-off, no recomputation


class MathTemplate(Template):
    name, domain, lead, partner = "math_solver_verifier", "math", "MathSolver", "Verifier"
    tools = {"MathSolver": ("compute",), "Verifier": ("compute",)}
    arg_schema = {"compute": {"expression": (str, None)}}
    tool_doc = {"compute": "Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses)."}
    acts = ("request", "plan", "plan_check", "precall", "call", "result", "claim", "note", "vcall", "verdict", "final")

    def role_prompt(self, agent: str) -> str:
        if agent == "MathSolver":
            return ("You are MathSolver. Solve the word problem step by step. Use the compute tool for "
                    "every calculation. When the Verifier has checked your result, reply with "
                    "'FINAL ANSWER: <number>'.")
        return ("You are Verifier. Recompute the MathSolver's result independently with the compute "
                "tool and reply 'CORRECT' or 'INCORRECT: expected <number>'.")

    def check_answer(self, task, answer, sandbox=None):
        ok = math_equal(answer, task.reference)
        return ok, "answer matches" if ok else f"answer {answer!r} != reference {task.reference!r}"

    def _run_tool(self, task, turns, call, sandbox):
        expr = call.arguments["expression"]
        try:
            v = fmt_num(eval_arith(expr))
        except (ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
            return Turn(agent=ENV, kind="tool_result", content=f"ERROR: {e}", tool="compute", result_ids=(),
                        error=str(e), sim={"act": "result", "of": call.sim.get("act")})
        return Turn(agent=ENV, kind="tool_result", content=v, tool="compute",
                    result_ids=(rid("calc", expr),), sim={"act": "result", "of": call.sim.get("act"), "value": v})

    # ------------------------------------------------------------------ turns (shared with the injector)
    @staticmethod
    def desc(task, sg) -> str:
        return next(p["desc"] for p in task.data["plan"] if p["id"] == sg)

    def call_turn(self, task, sg, expr, *, attempt=0, slip=None, args_key="expression") -> Turn:
        d = self.desc(task, sg)
        thought = say(task, ("call-t", sg, attempt), (f"Thought: next, the {d}.", f"Thought: on to the {d}.",
                                                       f"Thought: now I need the {d}; the numbers are in the problem and my last result.",
                                                       f"Thought: the {d} — let the tool do the arithmetic.",
                                                       f"Thought: the {d}; the tool keeps arithmetic errors out.",
                                                       f"Thought: {d} next — a wrong operand here would fail the whole chain."))
        act = say(task, ("call-a", sg, attempt), (f"Computing the {d}: {expr}.", f"Calling compute for the {d} with {expr}.",
                                                   f"compute({expr}) gives the {d}."))
        return Turn(agent="MathSolver", kind="tool_call", content=f"{thought}\n{act}", tool="compute",
                    arguments={args_key: expr}, sim={"act": "call", "sg": sg}, slip=slip)

    def claim_turn(self, task, sg, v, *, slip=None, by_hand=False) -> Turn:
        d = self.desc(task, sg)
        thought = say(task, ("claim-t", sg), ("Thought: the result is in; recording it.", "Thought: good, that sub-goal is done.",
                                              f"Thought: that settles the {d}.", "Thought: no error from the tool; recording it."))
        if by_hand:
            thought = "Thought: the tool call failed; I'll work it out by hand."
        act = say(task, ("claim-a", sg), (f"So the {d} come to {v}.", f"That makes {v} {d}.", f"The {d}: {v}.",
                                          f"Result noted: the {d} are {v}."))
        return Turn(agent="MathSolver", kind="message", content=f"{thought}\n{act}",
                    sim={"act": "claim", "sg": sg, "value": v}, slip=slip)

    def verdict_turn(self, task, ok, claimed, expected, n, *, slip=None) -> Turn:
        thought = say(task, ("verdict-t", n), (f"Thought: compare the recomputation with the claimed {claimed}.",
                                               "Thought: does the independent check agree?",
                                               "Thought: checking the final figure."))
        if ok:
            act = say(task, ("verdict-ok", n), (f"CORRECT: the result {claimed} checks out.",
                                                f"CORRECT: my recomputation also gives {claimed}.", f"CORRECT — {claimed} matches.",
                                                f"CORRECT: no error found; {claimed} checks out."))
        else:
            act = say(task, ("verdict-no", n), (f"INCORRECT: expected {expected}, not {claimed}.",
                                                f"INCORRECT: the recomputation gives {expected}; the claim was {claimed}.",
                                                f"INCORRECT: I get {expected}, not {claimed}.",
                                                f"INCORRECT: something went wrong; I get {expected}, not {claimed}."))
        return Turn(agent="Verifier", kind="message", content=f"{thought}\n{act}",
                    sim={"act": "verdict", "ok": ok, "expected": expected if not ok else claimed}, slip=slip)

    def final_turn(self, task, ans, *, slip=None) -> Turn:
        return Turn(agent="MathSolver", kind="final_answer",
                    content=f"{say(task, 'final', FINAL_THOUGHTS)}\n{final_text(ans)}",
                    sim={"act": "final", "answer": ans}, slip=slip)

    def plan_turn(self, task, *, missing: str | None = None, revised: bool = False) -> Turn:
        """The plan: one line per sub-goal. `missing`: a plan that leaves that stage out (a plan
        slip, not an injected type: the Verifier catches it before any work, the plan is redone)."""
        plan = [sg for sg in task.data["plan"] if sg["id"] != missing]
        lines = [f"{k + 1}) find the {sg['desc']}" for k, sg in enumerate(plan)]
        if revised:
            thought = say(task, "replan", ("Thought: right, I dropped a stage; revising the plan.",
                                           "Thought: my mistake, the plan was incomplete; here it is again in full."))
        else:
            thought = say(task, "plan", (f"Thought: {len(plan)} quantities to track; each goes through the calculator.",
                                         f"Thought: I'll break this into {len(plan)} calculations and check each with compute.",
                                         f"Thought: the story has {len(plan)} stages, so {len(plan)} sub-results.",
                                         "Thought: a wrong intermediate value would propagate, so each stage goes through the calculator."))
        return Turn(agent="MathSolver", kind="message", content=f"{thought}\nPlan: " + "; ".join(lines) + ".",
                    sim={"act": "plan", **({"missing": missing} if missing else {})})

    def ledger_check_turn(self, task, sg, v) -> Turn:
        """The Verifier signs off on the last result against the sub-results it noted on the way,
        without a recomputation: the run's answer follows at once (a Verifier turn before a final
        answer, as a premature answer after a note also is)."""
        d = self.desc(task, sg)
        act = say(task, ("ledger", sg), (f"The {d}: {v}. That was the last stage, and every sub-result I noted checks out.",
                                         f"Last stage done ({d} = {v}); the ledger has every stage, no error in it.",
                                         f"{d}: {v}. All stages are in my ledger; go ahead and answer."))
        return Turn(agent="Verifier", kind="message", content=f"Thought: keeping a ledger of the sub-results.\n{act}",
                    sim={"act": "note", "sg": sg, "ledger_check": True})

    def precall_turn(self, task, sg, inputs) -> Turn:
        """The solver names a sub-goal's inputs before calling (a message where a call could stand)."""
        d = self.desc(task, sg)
        act = say(task, ("precall", sg), (f"For the {d} I need {', '.join(inputs)}.",
                                          f"Inputs for the {d}: {', '.join(inputs)}.",
                                          f"The {d} comes from {', '.join(inputs)}; calling compute next."))
        return Turn(agent="MathSolver", kind="message", content=f"Thought: before the call, the inputs.\n{act}",
                    sim={"act": "precall", "sg": sg})

    def plan_check_turn(self, task, missing: str) -> Turn:
        n = len(task.data["plan"])
        d = self.desc(task, missing)
        thought = say(task, "plancheck-t", ("Thought: compare the plan with the problem before any work.",
                                            "Thought: does the plan cover every stage of the story?"))
        act = say(task, "plancheck-a", (f"INCORRECT: I get {n} stages, not {n - 1}; the {d} is missing.",
                                        f"INCORRECT: expected {n} stages, not {n - 1}; the plan skips the {d}.",
                                        f"INCORRECT: something went wrong; I count {n} stages, not {n - 1}.",
                                        f"INCORRECT: the problem gives {n} stages; the plan was {n - 1}."))
        return Turn(agent="Verifier", kind="message", content=f"{thought}\n{act}", sim={"act": "plan_check", "missing": missing})

    def vcall_turn(self, task, n) -> Turn:
        expr = full_expression(task.data["plan"])
        thought = say(task, ("vcall-t", n), ("Thought: I'll recompute everything from the givens in one expression.",
                                             "Thought: an independent check: the whole computation at once."))
        act = say(task, ("vcall-a", n), (f"Recomputing the whole problem from the givens: {expr}.",
                                         f"Checking with one expression: {expr}."))
        return Turn(agent="Verifier", kind="tool_call", content=f"{thought}\n{act}", tool="compute",
                    arguments={"expression": expr}, sim={"act": "vcall"})

    def note_turn(self, task, sg, v) -> Turn:
        d = self.desc(task, sg)
        act = say(task, ("note", sg), (f"Noted: {d} = {v}. Carry on.", f"I have the {d} as {v}; continue.",
                                       f"Tracking: {v} {d}.", f"No errors so far: {d} = {v}.",
                                       f"{d}: {v}. I'll flag anything that looks wrong at the end."))
        return Turn(agent="Verifier", kind="message", content=f"Thought: keeping a ledger of the sub-results.\n{act}",
                    sim={"act": "note", "sg": sg})

    def expected_call(self, task, sg, claims) -> str:
        p = next(p for p in task.data["plan"] if p["id"] == sg)
        return p["template"].format(*[claims.get(a, "0") if isinstance(a, str) else str(a) for a in p["args"]])

    @staticmethod
    def _state(turns):
        st = {"plan": False, "claims": {}, "calls": {}, "vcalls": 0, "verdict": None, "verdicts": 0, "notes": set()}
        for t in turns:
            a = t.sim.get("act")
            if a == "plan" and not t.sim.get("missing"):
                st["plan"] = True
            elif a == "call":
                st["calls"][t.sim["sg"]] = st["calls"].get(t.sim["sg"], 0) + 1
            elif a == "claim":
                st["claims"][t.sim["sg"]] = t.sim["value"]
            elif a == "note":
                st["notes"].add(t.sim["sg"])
            elif a == "vcall":
                st["vcalls"] += 1
            elif a == "verdict":
                st["verdict"], st["verdicts"] = t.sim, st["verdicts"] + 1
        return st

    def scripted_next(self, task, turns, ctx):
        """The next turn: the first of these reactions, in order, that has one."""
        st = self._state(turns)
        for react in (self._on_tool_result, self._on_message, self._said_twice, self._optional_opening):
            turn = react(task, turns, ctx, st)
            if turn is not None:
                return turn
        return self._next_step(task, turns, ctx, st)

    @staticmethod
    def _ids(task) -> list[str]:
        return [sg["id"] for sg in task.data["plan"]]

    def _on_tool_result(self, task, turns, ctx, st):
        """After the tool: the computed value claimed, the Verifier's verdict on its recomputation,
        or (after the misnamed argument's error) the value worked out by hand."""
        last = turns[-1]
        if last.kind == "tool_result" and last.sim.get("of") == "call" and not last.error:
            caller = next(t for t in reversed(turns) if t.kind == "tool_call")
            sg = caller.sim["sg"]
            attempt = st["calls"].get(sg, 1)
            v = last.sim.get("value", last.content.strip())
            slip = None
            if ctx.slip("computation_slip", "claim", sg, attempt):
                delta = [1, -1, 2, 10, -2][ctx.pick(5, "claimdelta", sg, attempt)]
                v, slip = fmt_num(eval_arith(v) + delta), "computation_slip"
            return self.claim_turn(task, sg, v, slip=slip)
        if last.kind == "tool_result" and last.sim.get("of") == "vcall":
            return self._verdict(task, last, ctx, st)
        if last.kind == "tool_result" and last.sim.get("of") == "call" and last.error:
            caller = next(t for t in reversed(turns) if t.kind == "tool_call")
            expr = (caller.arguments or {}).get("expr")
            if isinstance(expr, str):   # the misnamed argument: works it out by hand, ignoring the error
                return self.claim_turn(task, caller.sim["sg"], fmt_num(eval_arith(expr)), by_hand=True)
        return None

    def _verdict(self, task, last, ctx, st) -> Turn:
        """The Verifier's verdict on its recomputation `last` of the final figure."""
        r = last.sim.get("value")
        claimed = st["claims"].get(self._ids(task)[-1])
        n = st["verdicts"]
        if r is not None and claimed is not None and eval_arith(r) == eval_arith(claimed):
            if ctx.slip("verdict_misread", "verdict", n):
                wrong = fmt_num(eval_arith(r) + [1, -1, 3][ctx.pick(3, "vdelta", n)])
                return self.verdict_turn(task, False, claimed, wrong, n, slip="verdict_misread")
            return self.verdict_turn(task, True, claimed, claimed, n)
        if r is not None and ctx.catches("verdict", n, claimed, r):
            return self.verdict_turn(task, False, claimed, r, n)
        return self.verdict_turn(task, True, claimed, claimed, n, slip="verdict_misread" if r is not None else None)

    def _on_message(self, task, turns, ctx, st):
        """After a message: the final answer once verified (or signed off from the notes), the ledger
        check or a note on a claim, the check of a plan that misses a step, the revised plan."""
        last, ids = turns[-1], self._ids(task)
        if last.sim.get("act") == "verdict" or (st["verdict"] is not None and last.agent == "Verifier"):
            vd = st["verdict"]
            ans = vd["expected"] if not vd.get("ok") else st["claims"].get(ids[-1], vd.get("expected"))
            return self.final_turn(task, ans)
        if last.sim.get("act") == "note" and last.sim.get("ledger_check"):
            return self.final_turn(task, st["claims"][ids[-1]])
        if last.sim.get("act") == "claim" and last.sim["sg"] == ids[-1] and st["vcalls"] == 0 \
                and len(st["notes"] - {"givens"}) >= 2 and ctx.pick(100, "ledger") < LEDGER_PERCENT:
            return self.ledger_check_turn(task, last.sim["sg"], last.sim["value"])
        if last.sim.get("act") == "claim" and last.sim["sg"] != ids[-1] and last.sim["sg"] not in st["notes"] \
                and ctx.pick(100, "note", last.sim["sg"]) < NOTE_PERCENT:
            return self.note_turn(task, last.sim["sg"], last.sim["value"])
        if last.sim.get("act") == "plan" and last.sim.get("missing"):
            return self.plan_check_turn(task, last.sim["missing"])
        if last.sim.get("act") == "plan_check":
            return self.plan_turn(task, revised=True)
        return None

    def _said_twice(self, task, turns, ctx, st):
        return self._redundant(turns, ctx)

    def _optional_opening(self, task, turns, ctx, st):
        """Around the plan, now and then: the MathSolver lists the givens, the Verifier acknowledges."""
        last = turns[-1]
        if last.sim.get("act") in ("plan", "note") and last.sim.get("sg") is None and "givens" not in st["notes"] \
                and ctx.pick(100, "opening", len(turns)) < OPENING_PERCENT:
            nums = ", ".join(str(a) for sg in task.data["plan"] for a in sg["args"] if not isinstance(a, str))
            return Turn(agent="MathSolver", kind="message", sim={"act": "note", "sg": "givens"},
                        content="Thought: first, the numbers the problem gives.\n" + say(task, "givens", (
                            f"Givens: {nums}.", f"The problem gives {nums}.", f"Numbers to use: {nums}.")))
        if last.sim.get("act") == "plan" and ctx.pick(100, "prenote") < OPENING_PERCENT:
            return Turn(agent="Verifier", kind="message", sim={"act": "note", "sg": None},
                        content="Thought: I'll check the final figure independently.\n" + say(task, "prenote", (
                            "Fine by me; go ahead.", "Agreed. Post each sub-result as you get it.",
                            "Plan looks complete. I'll recompute at the end.")))
        return None

    def _next_step(self, task, turns, ctx, st) -> Turn:
        """The work itself: the plan, the next sub-goal, the Verifier's recomputation, the answer."""
        plan = task.data["plan"]
        if not st["plan"]:
            missing = None
            if len(plan) >= 3 and not any(act(t) == "plan" for t in turns) and ctx.detour("plan_slip", "plan"):
                missing = plan[1 + ctx.pick(len(plan) - 2, "planmiss")]["id"]
            return self.plan_turn(task, missing=missing)
        todo = [sg for sg in plan if sg["id"] not in st["claims"]]
        if todo:
            return self._next_subgoal(task, turns, ctx, st, todo)
        if st["verdict"] is None and st["vcalls"] < 2:
            return self.vcall_turn(task, st["vcalls"])
        return self.final_turn(task, st["claims"][self._ids(task)[-1]])

    def _next_subgoal(self, task, turns, ctx, st, todo) -> Turn:
        """The first sub-goal not yet claimed: its tool call (or the slips and detours around it)."""
        ids, last = self._ids(task), turns[-1]
        sg = todo[0]
        k = ids.index(sg["id"])
        attempt = st["calls"].get(sg["id"], 0)
        if 0 < k and st["claims"] and ctx.slip("premature_termination", "prem", sg["id"]):
            return self.final_turn(task, st["claims"][ids[k - 1]], slip="premature_termination")
        if last.sim.get("act") != "precall" and len(turns) + 4 * len(todo) < OPTIONAL_UNTIL + 4 and ctx.pick(100, "precall", sg["id"], attempt) < PRECALL_PERCENT:
            return self.precall_turn(task, sg["id"], [st["claims"].get(a, "?") if isinstance(a, str) else str(a)
                                                      for a in sg["args"]])
        args = [st["claims"].get(a, "0") if isinstance(a, str) else str(a) for a in sg["args"]]
        slip = None
        if ctx.slip("wrong_tool_argument", "call", sg["id"], attempt):
            nums = [j for j, a in enumerate(sg["args"]) if not isinstance(a, str)]
            if nums:
                j = nums[ctx.pick(len(nums), "callarg", sg["id"], attempt)]
                args[j] = str(int(args[j]) + [1, 2, -1][ctx.pick(3, "calldelta", sg["id"], attempt)])
                slip = "wrong_tool_argument"
        elif k >= 2 and ctx.slip("wrong_entity", "ent", sg["id"], attempt):
            refs = [j for j, a in enumerate(sg["args"]) if isinstance(a, str)]
            if refs:
                other = ids[ctx.pick(k - 1, "entpick", sg["id"]) % (k - 1)]   # an earlier quantity
                if other != sg["args"][refs[0]] and other in st["claims"] \
                        and st["claims"][other] != st["claims"].get(sg["args"][refs[0]]):
                    args[refs[0]] = st["claims"][other]
                    slip = "wrong_entity"
        expr = sg["template"].format(*args)
        if slip is None and attempt == 0 and ctx.slip("tool_misuse", "misuse", sg["id"]):
            return self.call_turn(task, sg["id"], expr, attempt=attempt, args_key="expr")
        return self.call_turn(task, sg["id"], expr, attempt=attempt, slip=slip)


# =========================================================================== slip detector

def _num_eq(a, b) -> bool:
    try:
        return eval_arith(str(a)) == eval_arith(str(b))
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return str(a).strip() == str(b).strip()


# =========================================================================== math

def claims_of(turns) -> dict:
    """Sub-goal id -> the value last claimed for it."""
    return {t.sim["sg"]: t.sim["value"] for t in turns if act(t) == "claim"}


def detect_computation(tpl, task, turns, j):
    t, p = turns[j], turns[j - 1]
    if act(t) != "claim" or p.kind != "tool_result":
        return None
    if not p.error and not _num_eq(t.sim["value"], p.content):
        return f"claims {t.sim['value']} where compute returned {p.content.strip()}"
    if p.error and j >= 2 and not p.sim.get("transient"):   # after a fault the call is retried, never worked by hand
        expr = next(iter((turns[j - 2].arguments or {}).values()), None)
        if isinstance(expr, str) and not _num_eq(t.sim["value"], expr):
            return f"claims {t.sim['value']} for {expr} worked by hand"
    return None


def detect_fabricated(tpl, task, turns, j):
    t, p = turns[j], turns[j - 1]
    if act(t) == "claim" and (p.kind != "tool_result" or p.sim.get("transient")):
        return f"states a result for the {tpl.desc(task, t.sim['sg'])} that no compute call produced"
    return None


def _call_problem(tpl, task, turns, j) -> tuple[str, str] | None:
    t = turns[j]
    if act(t) != "call":
        return None
    sg = t.sim["sg"]
    claims = claims_of(turns[:j])
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


detect_entity = one_type(_call_problem, "wrong_entity")
detect_argument = one_type(_call_problem, "wrong_tool_argument")


def detect_verdict(tpl, task, turns, j):
    t = turns[j]
    if act(t) != "verdict":
        return None
    res = next((u for u in reversed(turns[:j]) if u.kind == "tool_result" and u.sim.get("of") == "vcall"), None)
    last_sg = task.data["plan"][-1]["id"]
    claimed = claims_of(turns[:j]).get(last_sg)
    if res is None or res.error or claimed is None:
        return None
    agree = _num_eq(res.content, claimed)
    if t.sim.get("ok") and not agree:
        return f"says CORRECT although the recomputation gives {res.content.strip()}, not {claimed}"
    if not t.sim.get("ok") and (agree or not _num_eq(t.sim.get("expected"), res.content)):
        return f"says INCORRECT (expected {t.sim.get('expected')}) although the recomputation gives {res.content.strip()}"
    return None


def detect_premature(tpl, task, turns, j):
    t = turns[j]
    if t.kind != "final_answer":
        return None
    missing = [p["desc"] for p in task.data["plan"] if p["id"] not in claims_of(turns[:j])]
    if missing:
        return f"answers before finding the {missing[0]}"
    return None


# =========================================================================== injection

def plan_index(task, sg) -> int:
    ids = [p["id"] for p in task.data.get("plan", [])]
    return ids.index(sg) if sg in ids else -1


def _bump(v: str, salt: int) -> str:
    delta = [1, -1, 2, -2, 10][salt % 5]
    return fmt_num(eval_arith(v) + delta)


def corrupt_computation(tpl, task, turns, k, salt):
    t = turns[k]
    return tpl.claim_turn(task, t.sim["sg"], _bump(t.sim["value"], salt))


def corrupt_verdict(tpl, task, turns, k, salt):
    t = turns[k]
    n = sum(act(u) == "verdict" for u in turns[:k])
    return tpl.verdict_turn(task, False, t.sim["expected"], _bump(str(t.sim["expected"]), salt), n)


def _calls_before(turns, sg, k) -> int:
    return sum(act(u) == "call" and u.sim.get("sg") == sg for u in turns[:k])


def corrupt_entity(tpl, task, turns, k, salt):
    t = turns[k]
    plan = task.data["plan"]
    ids = [p["id"] for p in plan]
    sg = plan[plan_index(task, t.sim["sg"])]
    claims = claims_of(turns[:k])
    refs = [j for j, a in enumerate(sg["args"]) if isinstance(a, str)]
    others = [x for x in ids[:plan_index(task, sg["id"])] if refs and x != sg["args"][refs[0]] and x in claims
              and claims[x] != claims.get(sg["args"][refs[0]])]
    if not others:
        return None
    args = [claims.get(a, "0") if isinstance(a, str) else str(a) for a in sg["args"]]
    args[refs[0]] = claims[others[salt % len(others)]]
    expr = sg["template"].format(*args)
    if expr == t.arguments["expression"]:
        return None
    return tpl.call_turn(task, sg["id"], expr, attempt=_calls_before(turns, sg["id"], k))


def corrupt_fabricated(tpl, task, turns, k, salt):
    t = turns[k]
    true = eval_arith(t.arguments["expression"])
    return tpl.claim_turn(task, t.sim["sg"], fmt_num(true + [3, -3, 7, -5][salt % 4]))


def corrupt_argument(tpl, task, turns, k, salt):
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
    return tpl.call_turn(task, t.sim["sg"], new, attempt=_calls_before(turns, t.sim["sg"], k))


def corrupt_premature(tpl, task, turns, k, salt):
    """The final answer where the next call should be, after a Verifier turn (where a final answer
    normally stands: after the verdict), so only what is still missing tells it is premature."""
    claims = claims_of(turns[:k])
    if not claims or turns[k - 1].agent != tpl.partner:
        return None
    return tpl.final_turn(task, list(claims.values())[-1])


DOMAIN = Domain(
    name="math", template=MathTemplate(), generate=generate,
    slips={"computation_slip": detect_computation, "verdict_misread": detect_verdict,
           "wrong_entity": detect_entity, "fabricated_tool_result": detect_fabricated,
           "wrong_tool_argument": detect_argument, "premature_termination": detect_premature},
    targets={"computation_slip": lambda task, t: act(t) == "claim",
             "verdict_misread": lambda task, t: act(t) == "verdict" and bool(t.sim.get("ok")),
             "wrong_entity": lambda task, t: act(t) == "call" and plan_index(task, t.sim.get("sg")) >= 2,
             "fabricated_tool_result": lambda task, t: act(t) == "call",
             "wrong_tool_argument": lambda task, t: act(t) == "call",
             "premature_termination": lambda task, t: act(t) == "call" and plan_index(task, t.sim.get("sg")) >= 1},
    corruptions={"computation_slip": corrupt_computation, "verdict_misread": corrupt_verdict,
                 "wrong_entity": corrupt_entity, "fabricated_tool_result": corrupt_fabricated,
                 "wrong_tool_argument": corrupt_argument, "premature_termination": corrupt_premature},
    pools={"math500": read_math500},
)
