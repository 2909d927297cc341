"""The three multi-agent templates (DESIGN §4): MathSolver + Verifier (tool `compute`),
CodeWriter + CodeTester (tool `run_tests`), Manager + search_agent (tools `search`, `lookup`).

A template owns the environment (tool execution, with stable result ids), the checker, the tool
permissions and argument schemas used by curation, the role prompts of the `openai` backend,
and the behaviour of the `scripted` simulated agents: they solve the task step by step, read
their state from the turns so far (so an injected turn propagates), and slip at seeded decision
slots (`Ctx`), which is what makes natural failures and replays reproducible.

Every agent turn carries the agent's reasoning (a `Thought:` line) and its act, phrased in one of
several ways chosen by a hash of (task, act, slot) (`say`): the injector builds its corrupted
turns with the same `*_turn` helpers, so an injected turn reads like an honest one and only its
content (a value, a name, an argument) is wrong. Run lengths vary with the task (sub-goals, hops,
functions) and with optional acknowledgement turns (`note`), so a position says nothing.

    from aftraj.corpus.templates import TEMPLATES
    tpl = TEMPLATES["math"]
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace

from aftraj.corpus.rollout import Ctx, Turn
from aftraj.corpus.tasks import (Task, check_answer, code_blocks, code_from_text, eval_arith, fmt_num,
                                 full_expression, functions_of, search_docs, suite_tests)

ENV = "environment"
# how the agents name a relation of the document store
PHRASE = {"founder": "founder", "headquarters": "headquarters city", "founded": "founding year",
          "birthplace": "birthplace", "employer": "employer", "born": "birth year"}


def _rid(prefix: str, *parts) -> str:
    return f"{prefix}:" + hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=5).hexdigest()


def _final_text(answer: str) -> str:
    return f"FINAL ANSWER: {answer}"


def say(task: Task, key, options: tuple[str, ...] | list[str]) -> str:
    """One of several phrasings, fixed by (task, key): replays and the injector phrase alike."""
    h = hashlib.blake2b(f"{task.id}\x1f{key}".encode(), digest_size=4).digest()
    return options[int.from_bytes(h, "big") % len(options)]


NOTE_PERCENT = 40     # chance (per slot) of an acknowledgement turn: lengths vary beyond structure
OPENING_PERCENT = 50  # chance of each optional opening turn: the first work step moves by 0 to 2

_FINAL_THOUGHTS = ("Thought: that is everything the task asks for.", "Thought: done; writing the answer down.",
                   "Thought: nothing left to do.", "Thought: wrapping up.")


_FINAL_RE = re.compile(r"FINAL ANSWER:\s*(.+)", re.S | re.I)


class Template:
    name = ""
    domain = ""
    lead = ""
    partner = ""
    tools: dict[str, tuple[str, ...]] = {}        # agent -> permitted tools
    arg_schema: dict[str, dict[str, tuple]] = {}  # tool -> {arg: (type, allowed values or None)}
    acts: tuple[str, ...] = ()                    # sub-goal acts of the scripted agents

    # ------------------------------------------------------------------ shared
    def request_turn(self, task: Task) -> Turn:
        return Turn(agent="User", kind="message", content=task.prompt, sim={"act": "request"})

    def answer_of(self, turn: Turn) -> str:
        if "answer" in turn.sim:
            return str(turn.sim["answer"])
        m = _FINAL_RE.search(turn.content)
        return (m.group(1) if m else turn.content).strip()

    def check(self, task: Task, answer: str | None, sandbox=None) -> tuple[bool, str]:
        return check_answer(task, answer, sandbox)

    def call_problem(self, agent: str, tool: str | None, args) -> str | None:
        """Why a tool call is invalid (unpermitted tool, malformed arguments), or None."""
        if tool not in self.tools.get(agent, ()):
            return f"{agent} may not call {tool!r} (permitted: {', '.join(self.tools.get(agent, ())) or 'none'})"
        if not isinstance(args, dict):
            return f"arguments of {tool} must be a JSON object"
        schema = self.arg_schema[tool]
        missing = [k for k in schema if k not in args]
        if missing:
            return f"{tool} needs argument {missing[0]!r}"
        extra = sorted(set(args) - set(schema))
        if extra:
            return f"{tool} has no argument {extra[0]!r}"
        for k, (typ, allowed) in schema.items():
            if not isinstance(args[k], typ):
                return f"{tool}.{k} must be a {typ.__name__}"
            if allowed is not None and args[k] not in allowed:
                return f"{tool}.{k} must be one of {', '.join(allowed)}"
        return None

    def execute(self, task: Task, turns: list[Turn], sandbox=None) -> Turn:
        call = turns[-1]
        problem = call.error or self.call_problem(call.agent, call.tool, call.arguments)
        if problem:
            return Turn(agent=ENV, kind="tool_result", content=f"ERROR: {problem}", tool=call.tool,
                        result_ids=(), error=problem, sim={"act": "result", "of": call.sim.get("act")})
        return self._run_tool(task, turns, call, sandbox)

    def _run_tool(self, task, turns, call, sandbox) -> Turn:
        raise NotImplementedError

    def scripted_next(self, task: Task, turns: list[Turn], ctx: Ctx) -> Turn:
        raise NotImplementedError

    @staticmethod
    def _redundant(turns: list[Turn], ctx: Ctx) -> Turn | None:
        """A harmless irregularity for curation to catch: the plan said twice, verbatim."""
        last = turns[-1]
        if last.sim.get("act") == "plan" and sum(t.sim.get("act") == "plan" for t in turns) == 1 \
                and ctx.slip("redundant_turn", "redundant"):
            return last
        return None

    # ------------------------------------------------------------------ openai backend
    def speaker(self, turns: list[Turn]) -> str:
        """Turn-taking for free-form agents: a tool result goes back to its caller; a message
        hands over to the other agent."""
        last = turns[-1]
        if last.kind == "tool_result":
            for t in reversed(turns[:-1]):
                if t.kind == "tool_call":
                    return t.agent
        if last.agent == self.lead:
            return self.partner
        return self.lead

    def role_prompt(self, agent: str) -> str:
        raise NotImplementedError

    def tool_specs(self, agent: str) -> list[dict]:
        specs = []
        for tool in self.tools.get(agent, ()):
            props = {k: ({"type": "string", "enum": list(allowed)} if allowed else {"type": "string"})
                     for k, (typ, allowed) in self.arg_schema[tool].items()}
            specs.append({"type": "function", "function": {
                "name": tool, "description": self.tool_doc[tool],
                "parameters": {"type": "object", "properties": props, "required": list(props)}}})
        return specs

    tool_doc: dict[str, str] = {}


# =========================================================================== math

class MathTemplate(Template):
    name, domain, lead, partner = "math_solver_verifier", "math", "MathSolver", "Verifier"
    tools = {"MathSolver": ("compute",), "Verifier": ("compute",)}
    arg_schema = {"compute": {"expression": (str, None)}}
    tool_doc = {"compute": "Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses)."}
    acts = ("request", "plan", "call", "result", "claim", "note", "vcall", "verdict", "final")

    def role_prompt(self, agent: str) -> str:
        if agent == "MathSolver":
            return ("You are MathSolver. Solve the word problem step by step. Use the compute tool for "
                    "every calculation. When the Verifier has checked your result, reply with "
                    "'FINAL ANSWER: <number>'.")
        return ("You are Verifier. Recompute the MathSolver's result independently with the compute "
                "tool and reply 'CORRECT' or 'INCORRECT: expected <number>'.")

    def _run_tool(self, task, turns, call, sandbox):
        expr = call.arguments["expression"]
        try:
            v = fmt_num(eval_arith(expr))
        except (ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
            return Turn(agent=ENV, kind="tool_result", content=f"ERROR: {e}", tool="compute", result_ids=(),
                        error=str(e), sim={"act": "result", "of": call.sim.get("act")})
        return Turn(agent=ENV, kind="tool_result", content=v, tool="compute",
                    result_ids=(_rid("calc", expr),), sim={"act": "result", "of": call.sim.get("act"), "value": v})

    # ------------------------------------------------------------------ turns (shared with the injector)
    @staticmethod
    def desc(task, sg) -> str:
        return next(p["desc"] for p in task.data["plan"] if p["id"] == sg)

    def call_turn(self, task, sg, expr, *, attempt=0, slip=None, args_key="expression") -> Turn:
        d = self.desc(task, sg)
        thought = say(task, ("call-t", sg, attempt), (f"Thought: next, the {d}.", f"Thought: on to the {d}.",
                                                       f"Thought: now I need the {d}; the numbers are in the problem and my last result.",
                                                       f"Thought: the {d} — let the tool do the arithmetic."))
        act = say(task, ("call-a", sg, attempt), (f"Computing the {d}: {expr}.", f"Calling compute for the {d} with {expr}.",
                                                   f"compute({expr}) gives the {d}."))
        return Turn(agent="MathSolver", kind="tool_call", content=f"{thought}\n{act}", tool="compute",
                    arguments={args_key: expr}, sim={"act": "call", "sg": sg}, slip=slip)

    def claim_turn(self, task, sg, v, *, slip=None, by_hand=False) -> Turn:
        d = self.desc(task, sg)
        thought = say(task, ("claim-t", sg), ("Thought: the result is in; recording it.", "Thought: good, that sub-goal is done.",
                                              f"Thought: that settles the {d}."))
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
                                                f"CORRECT: my recomputation also gives {claimed}.", f"CORRECT — {claimed} matches."))
        else:
            act = say(task, ("verdict-no", n), (f"INCORRECT: expected {expected}, not {claimed}.",
                                                f"INCORRECT: the recomputation gives {expected}; the claim was {claimed}.",
                                                f"INCORRECT: I get {expected}, not {claimed}."))
        return Turn(agent="Verifier", kind="message", content=f"{thought}\n{act}",
                    sim={"act": "verdict", "ok": ok, "expected": expected if not ok else claimed}, slip=slip)

    def final_turn(self, task, ans, *, slip=None) -> Turn:
        return Turn(agent="MathSolver", kind="final_answer",
                    content=f"{say(task, 'final', _FINAL_THOUGHTS)}\n{_final_text(ans)}",
                    sim={"act": "final", "answer": ans}, slip=slip)

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
                                       f"Tracking: {v} {d}."))
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
            if a == "plan":
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
        plan = task.data["plan"]
        st = self._state(turns)
        last = turns[-1]
        ids = [sg["id"] for sg in plan]
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
            r = last.sim.get("value")
            claimed = st["claims"].get(ids[-1])
            n = st["verdicts"]
            if r is not None and claimed is not None and eval_arith(r) == eval_arith(claimed):
                if ctx.slip("verdict_misread", "verdict", n):
                    wrong = fmt_num(eval_arith(r) + [1, -1, 3][ctx.pick(3, "vdelta", n)])
                    return self.verdict_turn(task, False, claimed, wrong, n, slip="verdict_misread")
                return self.verdict_turn(task, True, claimed, claimed, n)
            if r is not None and ctx.catches("verdict", n, claimed, r):
                return self.verdict_turn(task, False, claimed, r, n)
            return self.verdict_turn(task, True, claimed, claimed, n, slip="verdict_misread" if r is not None else None)
        if last.kind == "tool_result" and last.sim.get("of") == "call" and last.error:
            caller = next(t for t in reversed(turns) if t.kind == "tool_call")
            expr = (caller.arguments or {}).get("expr")
            if isinstance(expr, str):   # the misnamed argument: works it out by hand, ignoring the error
                return self.claim_turn(task, caller.sim["sg"], fmt_num(eval_arith(expr)), by_hand=True)
        if last.sim.get("act") == "verdict" or (st["verdict"] is not None and last.agent == "Verifier"):
            vd = st["verdict"]
            ans = vd["expected"] if not vd.get("ok") else st["claims"].get(ids[-1], vd.get("expected"))
            return self.final_turn(task, ans)
        if last.sim.get("act") == "claim" and last.sim["sg"] != ids[-1] and last.sim["sg"] not in st["notes"] \
                and ctx.pick(100, "note", last.sim["sg"]) < NOTE_PERCENT:
            return self.note_turn(task, last.sim["sg"], last.sim["value"])
        again = self._redundant(turns, ctx)
        if again is not None:
            return again
        if last.sim.get("act") in ("plan", "note") and last.sim.get("sg") is None and "givens" not in st["notes"] \
                and ctx.pick(100, "opening", len(turns)) < OPENING_PERCENT:
            nums = ", ".join(str(a) for sg in plan for a in sg["args"] if not isinstance(a, str))
            return Turn(agent="MathSolver", kind="message", sim={"act": "note", "sg": "givens"},
                        content="Thought: first, the numbers the problem gives.\n" + say(task, "givens", (
                            f"Givens: {nums}.", f"The problem gives {nums}.", f"Numbers to use: {nums}.")))
        if last.sim.get("act") == "plan" and ctx.pick(100, "prenote") < OPENING_PERCENT:
            return Turn(agent="Verifier", kind="message", sim={"act": "note", "sg": None},
                        content="Thought: I'll check the final figure independently.\n" + say(task, "prenote", (
                            "Fine by me; go ahead.", "Agreed. Post each sub-result as you get it.",
                            "Plan looks complete. I'll recompute at the end.")))
        if not st["plan"]:
            lines = [f"{k + 1}) find the {sg['desc']}" for k, sg in enumerate(plan)]
            thought = say(task, "plan", (f"Thought: {len(plan)} quantities to track; each goes through the calculator.",
                                         f"Thought: I'll break this into {len(plan)} calculations and check each with compute.",
                                         f"Thought: the story has {len(plan)} stages, so {len(plan)} sub-results."))
            return Turn(agent="MathSolver", kind="message", content=f"{thought}\nPlan: " + "; ".join(lines) + ".",
                        sim={"act": "plan"})
        todo = [sg for sg in plan if sg["id"] not in st["claims"]]
        if todo:
            sg = todo[0]
            k = ids.index(sg["id"])
            attempt = st["calls"].get(sg["id"], 0)
            if 0 < k and st["claims"] and ctx.slip("premature_termination", "prem", sg["id"]):
                return self.final_turn(task, st["claims"][ids[k - 1]], slip="premature_termination")
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
        if st["verdict"] is None and st["vcalls"] < 2:
            return self.vcall_turn(task, st["vcalls"])
        return self.final_turn(task, st["claims"][ids[-1]])


# =========================================================================== coding

class CodingTemplate(Template):
    name, domain, lead, partner = "code_writer_tester", "coding", "CodeWriter", "CodeTester"
    tools = {"CodeWriter": (), "CodeTester": ("run_tests",)}
    arg_schema = {"run_tests": {"function": (str, None), "suite": (str, ("public", "smoke"))}}
    tool_doc = {"run_tests": "Run the latest code the CodeWriter posted for a function against a test suite (public or smoke)."}
    acts = ("request", "plan", "code", "tcall", "result", "report", "verdict", "note", "final")
    MAX_ATTEMPTS = 3

    def role_prompt(self, agent: str) -> str:
        if agent == "CodeWriter":
            return ("You are CodeWriter. Write each requested Python function in its own ```python block. "
                    "When the CodeTester has approved every function, reply with 'FINAL ANSWER:' followed by "
                    "one code block per function.")
        return ("You are CodeTester. Call run_tests on the CodeWriter's latest code of a function, then reply "
                "'APPROVE' if every test passed or 'REJECT: <failing tests>' otherwise.")

    @staticmethod
    def _latest_code(turns, fn: str | None = None) -> tuple[str, int | None]:
        """The latest code posted (for `fn`: the latest block defining it, else the latest code
        turn the writer meant for it)."""
        for i in range(len(turns) - 1, -1, -1):
            t = turns[i]
            if t.agent == "CodeWriter" and t.kind in ("message", "final_answer"):
                blocks = code_blocks(t.content) or ([code_from_text(t.content)] if code_from_text(t.content).strip() else [])
                if fn is None:
                    if blocks:
                        return blocks[-1], i
                    continue
                for b in reversed(blocks):
                    if re.search(rf"^def {re.escape(fn)}\(", b, re.M):
                        return b, i
                if t.sim.get("act") == "code" and t.sim.get("function") == fn and blocks:
                    return blocks[-1], i
        return "", None

    def _run_tool(self, task, turns, call, sandbox):
        fn, suite = call.arguments["function"], call.arguments["suite"]
        names = [f["function"] for f in functions_of(task)]
        if fn not in names:
            msg = f"function {fn!r} is not a function under test ({', '.join(map(repr, names))})"
            return Turn(agent=ENV, kind="tool_result", content=f"ERROR: {msg}", tool="run_tests", result_ids=(),
                        error=msg, sim={"act": "result", "of": "tcall"})
        code, at = self._latest_code(turns[:-1], fn)
        if not code:
            return Turn(agent=ENV, kind="tool_result", content=f"ERROR: no code for {fn} has been posted yet",
                        tool="run_tests", result_ids=(), error="no code to test", sim={"act": "result", "of": "tcall"})
        run = sandbox.run(code, suite_tests(task, suite, fn))
        return Turn(agent=ENV, kind="tool_result", content=f"[{suite} suite of {fn} on step {at}] " + run.summary(),
                    tool="run_tests", result_ids=(f"run:{run.key[:12]}",),
                    sim={"act": "result", "of": "tcall", "passed": run.passed, "suite": suite, "function": fn,
                         "failing": [i for i, r in enumerate(run.results) if r != "pass"]})

    # ------------------------------------------------------------------ turns (shared with the injector)
    def code_turn(self, task, fn: str, code: str, attempt: int, slip=None) -> Turn:
        if attempt == 0:
            lead = say(task, ("code", fn), (f"Here is `{fn}`:", f"Implementation of `{fn}`:", f"`{fn}` below."))
            thought = say(task, ("code-t", fn), (f"Thought: following the spec of `{fn}` closely.",
                                                 "Thought: straightforward once the edge cases are clear.",
                                                 f"Thought: `{fn}` — keep it short and handle the empty case."))
        else:
            lead = say(task, ("recode", fn, attempt), (f"Revised `{fn}`:", f"Fixed `{fn}`:", f"New version of `{fn}`:"))
            thought = "Thought: addressing the CodeTester's report."
        return Turn(agent="CodeWriter", kind="message", content=f"{thought}\n{lead}\n```python\n{code}```",
                    sim={"act": "code", "function": fn, "attempt": attempt}, slip=slip)

    def tcall_turn(self, task, fn: str, suite: str, n: int, slip=None, function_arg: str | None = None) -> Turn:
        act = say(task, ("tcall", fn, n), (f"Running the tests on `{fn}`.", f"Testing `{fn}`.",
                                           f"Let's see whether `{fn}` passes."))
        return Turn(agent="CodeTester", kind="tool_call", content=f"Thought: check `{fn}` before moving on.\n{act}",
                    tool="run_tests", arguments={"function": function_arg or fn, "suite": suite},
                    sim={"act": "tcall", "function": fn}, slip=slip)

    def verdict_turn(self, task, fn: str, ok: bool, detail: str, n: int, slip=None) -> Turn:
        if ok:
            act = say(task, ("approve", fn, n), (f"APPROVE: all tests of `{fn}` pass.", f"APPROVE: `{fn}` passes.",
                                                 f"APPROVE — `{fn}` is good."))
        else:
            act = say(task, ("reject", fn, n), (f"REJECT: `{fn}` fails:\n{detail}", f"REJECT: `{fn}` does not pass:\n{detail}"))
        return Turn(agent="CodeTester", kind="message", content=f"Thought: reading the test report.\n{act}",
                    sim={"act": "verdict", "ok": ok, "function": fn}, slip=slip)

    def final_turn(self, task, turns, slip=None) -> Turn:
        blocks = []
        for f in functions_of(task):
            code, _ = self._latest_code(turns, f["function"])
            if code:
                blocks.append(f"```python\n{code}```")
        return Turn(agent="CodeWriter", kind="final_answer",
                    content=f"{say(task, 'final', _FINAL_THOUGHTS)}\nFINAL ANSWER:\n" + "\n".join(blocks),
                    sim={"act": "final"}, slip=slip)

    @staticmethod
    def progress(task, turns) -> dict:
        """Per function: code turns posted, and whether its latest code got an approving verdict."""
        out = {f["function"]: {"codes": 0, "approved": False, "verdicts": 0} for f in functions_of(task)}
        for t in turns:
            fn = t.sim.get("function")
            if fn not in out:
                continue
            if t.sim.get("act") == "code":
                out[fn]["codes"] += 1
                out[fn]["approved"] = False
            elif t.sim.get("act") == "verdict":
                out[fn]["verdicts"] += 1
                out[fn]["approved"] = bool(t.sim.get("ok"))
        return out

    def _next_function(self, task, turns, ctx) -> Turn:
        prog = self.progress(task, turns)
        todo = [f for f in functions_of(task) if prog[f["function"]]["codes"] == 0]
        if not todo:
            return self.final_turn(task, turns)
        f = todo[0]
        fn, V = f["function"], f["variants"]
        last = turns[-1]
        if not (last.sim.get("act") == "note" and last.sim.get("approach") == fn) \
                and ctx.pick(100, "approach", fn) < NOTE_PERCENT + 10:
            return Turn(agent="CodeWriter", kind="message", sim={"act": "note", "approach": fn},
                        content=f"Thought: think before typing.\n" + say(task, ("approach", fn), (
                            f"Approach for `{fn}`: read the spec line by line, mind the empty input.",
                            f"For `{fn}` the examples pin down the edge cases; writing it now.",
                            f"`{fn}` next; the tests will tell.")))
        bugs = sorted(k for k in V if k.startswith("bug:"))
        if ctx.slip("computation_slip", "code", fn, 0) and bugs:
            return self.code_turn(task, fn, V[bugs[ctx.pick(len(bugs), "bug", fn, 0)]], 0, "computation_slip")
        if ctx.slip("wrong_entity", "name", fn, 0):
            return self.code_turn(task, fn, V["wrong_name"], 0, "wrong_entity")
        return self.code_turn(task, fn, V["correct"], 0)

    def scripted_next(self, task, turns, ctx):
        funcs = {f["function"]: f for f in functions_of(task)}
        last = turns[-1]
        again = self._redundant(turns, ctx)
        if again is not None:
            return again
        if not any(t.sim.get("act") == "plan" for t in turns):
            names = [f"`{n}`" for n in funcs]
            thought = say(task, "plan", (f"Thought: {len(names)} function(s); I'll write and test them one at a time.",
                                         "Thought: one function at a time, each tested before the next.",
                                         f"Thought: {len(names)} piece(s) of code; test each as it lands."))
            return Turn(agent="CodeWriter", kind="message", sim={"act": "plan"},
                        content=f"{thought}\nPlan: implement {', '.join(names)} in order; CodeTester runs the public tests after each.")
        act = last.sim.get("act")
        prog = self.progress(task, turns)
        if act == "plan" and ctx.pick(100, "opening") < OPENING_PERCENT:
            return Turn(agent="CodeTester", kind="message", sim={"act": "note"},
                        content="Thought: I'll run the public tests after each function.\n" + say(task, "ack", (
                            "Ready to test each function as it comes.", "Fine. Post them one at a time.",
                            "OK; I'll report per function.")))
        if act == "code":
            fn = last.sim["function"]
            attempt = last.sim.get("attempt", 0)
            if ctx.slip("premature_termination", "prem", fn, attempt):
                return self.final_turn(task, turns, slip="premature_termination")
            suite, slip = "public", None
            if ctx.slip("wrong_tool_argument", "targ", fn, attempt):
                suite, slip = "smoke", "wrong_tool_argument"
            return self.tcall_turn(task, fn, suite, prog[fn]["verdicts"], slip=slip)
        if last.kind == "tool_result" and last.sim.get("of") == "tcall" or act == "report":
            fn = last.sim.get("function") or next((t.sim.get("function") for t in reversed(turns) if t.sim.get("function")), None)
            passed = bool(last.sim.get("passed")) and not last.error
            n = prog[fn]["verdicts"] if fn in prog else 0
            detail = last.content.split("\n", 1)[-1] if "\n" in last.content else last.content
            if passed:
                if ctx.slip("verdict_misread", "verdict", fn, n):
                    return self.verdict_turn(task, fn, False, "FAIL test_0: fails on the edge case", n, slip="verdict_misread")
                return self.verdict_turn(task, fn, True, "", n)
            if ctx.catches("verdict", fn, n, last.content):
                return self.verdict_turn(task, fn, False, detail, n)
            return self.verdict_turn(task, fn, True, "", n, slip="verdict_misread")
        if act == "verdict":
            fn = last.sim["function"]
            attempt = prog[fn]["codes"]
            if last.sim.get("ok") or attempt >= self.MAX_ATTEMPTS:
                if any(p["codes"] == 0 for p in prog.values()) and ctx.pick(100, "note", fn) < NOTE_PERCENT:
                    left = sum(p["codes"] == 0 for p in prog.values())
                    return Turn(agent="CodeWriter", kind="message", sim={"act": "note", "function": fn},
                                content="Thought: one down.\n" + say(task, ("note", fn), (
                                    f"`{fn}` done; {left} to go.", f"Good, `{fn}` is in. Next.", f"`{fn}` approved; moving on.")))
                return self._next_function(task, turns, ctx)
            V = funcs[fn]["variants"]
            bugs = sorted(k for k in V if k.startswith("bug:"))
            # Is the rejection backed by a real failing run of the latest code?
            real = False
            for t in reversed(turns):
                if t.sim.get("act") == "code":
                    break
                if t.sim.get("of") == "tcall" and t.kind == "tool_result":
                    real = (not t.sim.get("passed")) or bool(t.error)
                    break
            if real:
                if ctx.slip("computation_slip", "code", fn, attempt) and bugs:
                    return self.code_turn(task, fn, V[bugs[ctx.pick(len(bugs), "bug", fn, attempt)]], attempt, "computation_slip")
                return self.code_turn(task, fn, V["correct"], attempt)
            # following a report that no real run backs: the "fix" breaks working code
            b = bugs[ctx.pick(len(bugs), "bogusfix", fn, attempt)] if bugs else "stub"
            return self.code_turn(task, fn, V[b], attempt)
        return self._next_function(task, turns, ctx)

    def answer_of(self, turn: Turn) -> str:
        return turn.content


# =========================================================================== agentic

class AgenticTemplate(Template):
    name, domain, lead, partner = "manager_search_agent", "agentic", "Manager", "search_agent"
    tools = {"Manager": (), "search_agent": ("search", "lookup")}
    arg_schema = {"search": {"query": (str, None)}, "lookup": {"doc_id": (str, None)}}
    tool_doc = {"search": "Search the local document store; returns up to 3 (doc id, title) hits.",
                "lookup": "Return the full text of one document by its id."}
    acts = ("request", "plan", "search", "lookup", "result", "claim", "note", "redo", "confirm", "final")

    def role_prompt(self, agent: str) -> str:
        if agent == "Manager":
            return ("You are Manager. Break the question into hops, ask search_agent for each fact, "
                    "check its evidence, and finish with 'FINAL ANSWER: <answer>'.")
        return ("You are search_agent. Use search to find documents and lookup to read them; report "
                "each fact with the id of the document it came from.")

    def _run_tool(self, task, turns, call, sandbox):
        docs = task.data["docs"]
        if call.tool == "search":
            hits = search_docs(docs, call.arguments["query"])
            body = "\n".join(f"{d['id']} | {d['title']}" for d in hits) or "no results"
            return Turn(agent=ENV, kind="tool_result", content=body, tool="search",
                        result_ids=tuple(d["id"] for d in hits),
                        sim={"act": "result", "of": "search", "hits": [d["id"] for d in hits]})
        did = call.arguments["doc_id"]
        doc = next((d for d in docs if d["id"] == did), None)
        if doc is None:
            return Turn(agent=ENV, kind="tool_result", content=f"ERROR: no document {did!r}", tool="lookup",
                        result_ids=(), error=f"no document {did!r}", sim={"act": "result", "of": "lookup"})
        return Turn(agent=ENV, kind="tool_result", content=f"{doc['title']}: {doc['text']}", tool="lookup",
                    result_ids=(doc["id"],), sim={"act": "result", "of": "lookup", "doc_id": doc["id"]})

    @staticmethod
    def _doc(task, did):
        return next((d for d in task.data["docs"] if d["id"] == did), None)

    # ------------------------------------------------------------------ turns (shared with the injector)
    def claim_turn(self, task, hop, subj, value, did, att, slip=None) -> Turn:
        rel = PHRASE[task.data["hops"][hop]["relation"]]
        thought = say(task, ("claim-t", hop, att), ("Thought: the document states it directly.",
                                                    f"Thought: that answers hop {hop + 1}.", "Thought: found the fact."))
        act = say(task, ("claim-a", hop, att), (f"The {rel} of {subj} is {value} (source: {did}).",
                                                f"{did} says the {rel} of {subj} is {value}.",
                                                f"Found it: {rel} of {subj} = {value} (source {did})."))
        return Turn(agent="search_agent", kind="message", content=f"{thought}\n{act}",
                    sim={"act": "claim", "hop": hop, "value": value, "doc_id": did}, slip=slip)

    def lookup_turn(self, task, hop, did, subj, att, slip=None) -> Turn:
        doc = self._doc(task, did)
        title = doc["title"] if doc else did
        thought = say(task, ("lookup-t", hop, att), (f"Thought: {did} should be the page for {subj}.",
                                                     f"Thought: the best hit for {subj} is {did}.",
                                                     f"Thought: {did} matches {subj}."))
        act = say(task, ("lookup-a", hop, att), (f"Reading {did} ({title}).", f"Opening {did}, titled {title}."))
        return Turn(agent="search_agent", kind="tool_call", content=f"{thought}\n{act}", tool="lookup",
                    arguments={"doc_id": did}, sim={"act": "lookup", "hop": hop}, slip=slip)

    def search_turn(self, task, hop, subj, att) -> Turn:
        rel = PHRASE[task.data["hops"][hop]["relation"]]
        thought = say(task, ("search-t", hop, att), (f"Thought: I need the {rel} of {subj}.",
                                                     f"Thought: next fact: {subj}'s {rel}."))
        act = say(task, ("search-a", hop, att), (f"Searching for the {rel} of {subj}.", f"Looking up {subj} in the store."))
        return Turn(agent="search_agent", kind="tool_call", content=f"{thought}\n{act}", tool="search",
                    arguments={"query": f"{subj} {rel}"}, sim={"act": "search", "hop": hop})

    def confirm_turn(self, task, value, n, slip=None) -> Turn:
        act = say(task, ("confirm", n), (f"Evidence checked. The answer is {value}.",
                                         f"Every hop is backed by a document; the answer is {value}.",
                                         f"The chain holds: {value}."))
        return Turn(agent="Manager", kind="message", content=f"Thought: checking each claim against the documents read.\n{act}",
                    sim={"act": "confirm", "value": value}, slip=slip)

    def final_turn(self, task, ans, slip=None) -> Turn:
        return Turn(agent="Manager", kind="final_answer", content=f"{say(task, 'final', _FINAL_THOUGHTS)}\n{_final_text(ans)}",
                    sim={"act": "final", "answer": ans}, slip=slip)

    def _claims(self, turns) -> tuple[dict, dict]:
        """Current claims per hop (a redo of hop i drops claims of hops >= i) and attempts per hop."""
        claims: dict[int, dict] = {}
        attempts: dict[int, int] = {}
        for t in turns:
            a = t.sim.get("act")
            if a == "claim":
                claims[t.sim["hop"]] = t.sim
            elif a == "redo":
                h = t.sim["hop"]
                attempts[h] = attempts.get(h, 0) + 1
                for k in [k for k in claims if k >= h]:
                    del claims[k]
        return claims, attempts

    def _subject(self, task, claims, hop) -> str:
        return task.data["hops"][0]["subject"] if hop == 0 else str(claims.get(hop - 1, {}).get("value", ""))

    def _check_chain(self, task, turns, claims) -> int | None:
        """The Manager's evidence check: first hop whose claim no looked-up document backs."""
        hops = task.data["hops"]
        looked = {t.sim.get("doc_id") for t in turns if t.kind == "tool_result" and t.sim.get("of") == "lookup"}
        for h in range(len(hops)):
            c = claims.get(h)
            if c is None:
                return h
            doc = self._doc(task, c.get("doc_id")) if c.get("doc_id") in looked else None
            subj = self._subject(task, claims, h)
            if doc is None or doc["title"] != subj or str(doc["facts"].get(hops[h]["relation"])) != str(c["value"]):
                return h
        return None

    def scripted_next(self, task, turns, ctx):
        hops = task.data["hops"]
        last = turns[-1]
        claims, attempts = self._claims(turns)
        n_checks = sum(1 for t in turns if t.sim.get("act") in ("redo", "confirm"))
        again = self._redundant(turns, ctx)
        if again is not None:
            return again
        if not any(t.sim.get("act") == "plan" for t in turns):
            parts = [f"hop {i + 1}: the {PHRASE[h['relation']]} of " + ("'" + h["subject"] + "'" if i == 0 else "that")
                     for i, h in enumerate(hops)]
            thought = say(task, "plan", (f"Thought: a {len(hops)}-hop question; one fact per hop.",
                                         f"Thought: {len(hops)} facts to chain, each from a document.",
                                         "Thought: follow the chain one document at a time."))
            return Turn(agent="Manager", kind="message", sim={"act": "plan"},
                        content=f"{thought}\nsearch_agent, please find " + "; ".join(parts) + ". Cite document ids.")
        if last.sim.get("act") in ("plan", "note") and last.sim.get("hop") is None and last.agent == "search_agent" \
                and ctx.pick(100, "opening") < OPENING_PERCENT:
            return Turn(agent="Manager", kind="message", sim={"act": "note", "hop": "rules"},
                        content="Thought: the evidence matters more than speed.\n" + say(task, "rules", (
                            "Remember: cite the document id for every fact.", "Good. One document per fact, please.",
                            "Fine; I will check every claim against its document.")))
        if last.sim.get("act") == "plan" and ctx.pick(100, "prenote") < OPENING_PERCENT:
            return Turn(agent="search_agent", kind="message", sim={"act": "note", "hop": None},
                        content="Thought: one hop at a time, citing each document.\n" + say(task, "prenote", (
                            f"Understood; starting with {hops[0]['subject']}.", "On it.",
                            f"Starting the chain at {hops[0]['subject']}.")))
        if last.sim.get("act") == "confirm":
            return self.final_turn(task, last.sim["value"])
        hop = next((h for h in range(len(hops)) if h not in claims), None)
        att = attempts.get(hop, 0) if hop is not None else 0
        if last.kind == "tool_result" and last.sim.get("of") == "search" and hop is not None:
            hits = list(last.sim.get("hits") or [])
            subj = self._subject(task, claims, hop)
            exact = [d for d in hits if (self._doc(task, d) or {}).get("title") == subj]
            pick = exact[0] if exact else (hits[0] if hits else "d01")
            slip = None
            others = [d for d in hits if d != pick]
            if others and ctx.slip("wrong_tool_argument", "lk", hop, att):
                pick, slip = others[ctx.pick(len(others), "lkpick", hop, att)], "wrong_tool_argument"
            return self.lookup_turn(task, hop, pick, subj, att, slip=slip)
        if last.kind == "tool_result" and last.sim.get("of") == "lookup" and hop is not None:
            rel = hops[hop]["relation"]
            doc = self._doc(task, last.sim.get("doc_id")) if not last.error else None
            value = str(doc["facts"].get(rel, "unknown")) if doc else "unknown"
            did = doc["id"] if doc else None
            slip = None
            subj = self._subject(task, claims, hop)
            distract = [d for d in task.data["docs"] if d["title"] != subj and d["title"].startswith(subj.split(" ")[0])
                        and rel in d["facts"] and str(d["facts"][rel]) != value]
            if distract and ctx.slip("wrong_entity", "ent", hop, att):
                value, slip = str(distract[0]["facts"][rel]), "wrong_entity"
            elif value.isdigit() and ctx.slip("computation_slip", "num", hop, att):
                value, slip = str(int(value) + [1, -1, 10][ctx.pick(3, "numd", hop, att)]), "computation_slip"
            return self.claim_turn(task, hop, subj, value, did, att, slip=slip)
        if hop is not None:
            if last.sim.get("act") == "claim" and last.sim["hop"] < len(hops) - 1 and \
                    ctx.slip("premature_termination", "prem", last.sim["hop"], att):
                return self.final_turn(task, last.sim["value"], slip="premature_termination")
            if last.sim.get("act") == "claim" and ctx.pick(100, "note", last.sim["hop"], att) < NOTE_PERCENT:
                v = last.sim["value"]
                return Turn(agent="Manager", kind="message", sim={"act": "note", "hop": last.sim["hop"]},
                            content="Thought: one more link of the chain.\n" + say(task, ("note", last.sim["hop"], att), (
                                f"Got it: {v}. Next hop.", f"Noted ({v}); continue.", f"OK, {v}. Keep going.")))
            subj = self._subject(task, claims, hop)
            return self.search_turn(task, hop, subj, att)
        # every hop has a claim: the Manager checks the evidence chain
        bad = self._check_chain(task, turns, claims)
        final = str(claims[len(hops) - 1]["value"])
        if bad is not None and sum(attempts.values()) < 2:
            if ctx.catches("check", bad, n_checks, str(claims[bad]["value"]) if bad in claims else "-"):
                return Turn(agent="Manager", kind="message", sim={"act": "redo", "hop": bad},
                            content=f"Thought: a claim does not match its document.\nThe evidence for hop {bad + 1} "
                                    f"does not hold up; search_agent, redo hop {bad + 1}.")
            return self.confirm_turn(task, final, n_checks, slip="verdict_misread")
        if bad is None and ctx.slip("verdict_misread", "verdict", n_checks):
            wrong = self._subject(task, claims, len(hops) - 1)
            return self.confirm_turn(task, wrong, n_checks, slip="verdict_misread")
        return self.confirm_turn(task, final, n_checks)


TEMPLATES: dict[str, Template] = {"math": MathTemplate(), "coding": CodingTemplate(), "agentic": AgenticTemplate()}


def template_for(domain: str) -> Template:
    if domain not in TEMPLATES:
        raise ValueError(f"no template for domain {domain!r}")
    return TEMPLATES[domain]

