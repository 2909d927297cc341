"""The three multi-agent templates (DESIGN §4): MathSolver + Verifier (tool `compute`),
CodeWriter + CodeTester (tool `run_tests`), Manager + search_agent (tools `search`, `lookup`).

A template owns the environment (tool execution, with stable result ids), the checker, the tool
permissions and argument schemas used by curation, the role prompts of the `openai` backend,
and the behaviour of the `scripted` simulated agents: they solve the task step by step, read
their state from the turns so far (so an injected turn propagates), and slip at seeded decision
slots (`Ctx`), which is what makes natural failures and replays reproducible.

    from aftraj.corpus.templates import TEMPLATES
    tpl = TEMPLATES["math"]
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace

from aftraj.corpus.rollout import Ctx, Turn
from aftraj.corpus.tasks import (Task, check_answer, code_from_text, eval_arith, fmt_num,
                                 full_expression, search_docs, suite_tests)

ENV = "environment"
# how the agents name a relation of the document store
PHRASE = {"founder": "founder", "headquarters": "headquarters city", "founded": "founding year",
          "birthplace": "birthplace", "employer": "employer", "born": "birth year"}


def _rid(prefix: str, *parts) -> str:
    return f"{prefix}:" + hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=5).hexdigest()


def _final_text(answer: str) -> str:
    return f"FINAL ANSWER: {answer}"


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
    acts = ("request", "plan", "call", "result", "claim", "vcall", "verdict", "final")

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

    @staticmethod
    def _state(turns):
        st = {"plan": False, "claims": {}, "calls": {}, "vcalls": 0, "verdict": None, "verdicts": 0}
        for t in turns:
            a = t.sim.get("act")
            if a == "plan":
                st["plan"] = True
            elif a == "call":
                st["calls"][t.sim["sg"]] = st["calls"].get(t.sim["sg"], 0) + 1
            elif a == "claim":
                st["claims"][t.sim["sg"]] = t.sim["value"]
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
            desc = next(p["desc"] for p in plan if p["id"] == sg)
            return Turn(agent="MathSolver", kind="message", content=f"So the {desc} come to {v}.",
                        sim={"act": "claim", "sg": sg, "value": v}, slip=slip)
        if last.kind == "tool_result" and last.sim.get("of") == "vcall":
            r = last.sim.get("value")
            claimed = st["claims"].get(ids[-1])
            n = st["verdicts"]
            if r is not None and claimed is not None and eval_arith(r) == eval_arith(claimed):
                if ctx.slip("verdict_misread", "verdict", n):
                    wrong = fmt_num(eval_arith(r) + [1, -1, 3][ctx.pick(3, "vdelta", n)])
                    return Turn(agent="Verifier", kind="message",
                                content=f"INCORRECT: I get {wrong}, not {claimed}.",
                                sim={"act": "verdict", "ok": False, "expected": wrong}, slip="verdict_misread")
                return Turn(agent="Verifier", kind="message", content=f"CORRECT: the result {claimed} checks out.",
                            sim={"act": "verdict", "ok": True, "expected": claimed})
            if r is not None and ctx.catches("verdict", n, claimed, r):
                return Turn(agent="Verifier", kind="message", content=f"INCORRECT: expected {r}, not {claimed}.",
                            sim={"act": "verdict", "ok": False, "expected": r})
            return Turn(agent="Verifier", kind="message", content=f"CORRECT: the result {claimed} checks out.",
                        sim={"act": "verdict", "ok": True, "expected": claimed},
                        slip="verdict_misread" if r is not None else None)
        if last.kind == "tool_result" and last.sim.get("of") == "call" and last.error:
            caller = next(t for t in reversed(turns) if t.kind == "tool_call")
            expr = (caller.arguments or {}).get("expr")
            if isinstance(expr, str):   # the misnamed argument: works it out by hand, ignoring the error
                sg = caller.sim["sg"]
                v = fmt_num(eval_arith(expr))
                desc = next(p["desc"] for p in plan if p["id"] == sg)
                return Turn(agent="MathSolver", kind="message", content=f"By hand, then: the {desc} come to {v}.",
                            sim={"act": "claim", "sg": sg, "value": v})
        if last.sim.get("act") == "verdict" or (st["verdict"] is not None and last.agent == "Verifier"):
            vd = st["verdict"]
            ans = vd["expected"] if not vd.get("ok") else st["claims"].get(ids[-1], vd.get("expected"))
            how = "as verified" if vd.get("ok") else "corrected after the Verifier's check"
            return Turn(agent="MathSolver", kind="final_answer", content=f"{_final_text(ans)} ({how})",
                        sim={"act": "final", "answer": ans})
        again = self._redundant(turns, ctx)
        if again is not None:
            return again
        if not st["plan"]:
            lines = [f"{k + 1}) find the {sg['desc']}" for k, sg in enumerate(plan)]
            return Turn(agent="MathSolver", kind="message", content="Plan: " + "; ".join(lines) + ".",
                        sim={"act": "plan"})
        todo = [sg for sg in plan if sg["id"] not in st["claims"]]
        if todo:
            sg = todo[0]
            k = ids.index(sg["id"])
            attempt = st["calls"].get(sg["id"], 0)
            if 0 < k and st["claims"] and ctx.slip("premature_termination", "prem", sg["id"]):
                ans = st["claims"][ids[k - 1]]
                return Turn(agent="MathSolver", kind="final_answer", content=f"{_final_text(ans)} (that should be it)",
                            sim={"act": "final", "answer": ans}, slip="premature_termination")
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
                    if other != sg["args"][refs[0]] and other in st["claims"]:
                        args[refs[0]] = st["claims"][other]
                        slip = "wrong_entity"
            expr = sg["template"].format(*args)
            if slip is None and attempt == 0 and ctx.slip("tool_misuse", "misuse", sg["id"]):
                return Turn(agent="MathSolver", kind="tool_call", content=f"Computing the {sg['desc']}.",
                            tool="compute", arguments={"expr": expr},
                            sim={"act": "call", "sg": sg["id"]})
            return Turn(agent="MathSolver", kind="tool_call", content=f"Computing the {sg['desc']}.",
                        tool="compute", arguments={"expression": expr}, sim={"act": "call", "sg": sg["id"]},
                        slip=slip)
        if st["verdict"] is None and st["vcalls"] < 2:
            return Turn(agent="Verifier", kind="tool_call", content="Recomputing the whole problem from the givens.",
                        tool="compute", arguments={"expression": full_expression(plan)}, sim={"act": "vcall"})
        ans = st["claims"][ids[-1]]
        return Turn(agent="MathSolver", kind="final_answer", content=_final_text(ans), sim={"act": "final", "answer": ans})


# =========================================================================== coding

class CodingTemplate(Template):
    name, domain, lead, partner = "code_writer_tester", "coding", "CodeWriter", "CodeTester"
    tools = {"CodeWriter": (), "CodeTester": ("run_tests",)}
    arg_schema = {"run_tests": {"function": (str, None), "suite": (str, ("public", "smoke"))}}
    tool_doc = {"run_tests": "Run the latest code the CodeWriter posted against a test suite (public or smoke)."}
    acts = ("request", "plan", "code", "tcall", "result", "report", "verdict", "final")
    MAX_ATTEMPTS = 3

    def role_prompt(self, agent: str) -> str:
        if agent == "CodeWriter":
            return ("You are CodeWriter. Write the requested Python function in one ```python block. "
                    "When the CodeTester approves, reply with 'FINAL ANSWER:' followed by the final code block.")
        return ("You are CodeTester. Call run_tests on the CodeWriter's latest code, then reply "
                "'APPROVE' if every test passed or 'REJECT: <failing tests>' otherwise.")

    @staticmethod
    def _latest_code(turns) -> tuple[str, int | None]:
        for i in range(len(turns) - 1, -1, -1):
            t = turns[i]
            if t.agent == "CodeWriter" and t.kind in ("message", "final_answer"):
                code = code_from_text(t.content)
                if code.strip():
                    return code, i
        return "", None

    def _run_tool(self, task, turns, call, sandbox):
        fn, suite = call.arguments["function"], call.arguments["suite"]
        code, at = self._latest_code(turns[:-1])
        if not code:
            return Turn(agent=ENV, kind="tool_result", content="ERROR: no code has been posted yet",
                        tool="run_tests", result_ids=(), error="no code to test", sim={"act": "result", "of": "tcall"})
        if fn != task.data["function"]:
            msg = f"function {fn!r} is not the function under test ({task.data['function']!r})"
            return Turn(agent=ENV, kind="tool_result", content=f"ERROR: {msg}", tool="run_tests", result_ids=(),
                        error=msg, sim={"act": "result", "of": "tcall"})
        tests = suite_tests(task, suite)
        run = sandbox.run(code, tests)
        return Turn(agent=ENV, kind="tool_result", content=f"[{suite} suite on step {at}] " + run.summary(),
                    tool="run_tests", result_ids=(f"run:{run.key[:12]}",),
                    sim={"act": "result", "of": "tcall", "passed": run.passed, "suite": suite,
                         "failing": [i for i, r in enumerate(run.results) if r != "pass"]})

    @staticmethod
    def _code_turn(code: str, variant: str, attempt: int, slip: str | None) -> Turn:
        lead = "Here is my implementation:" if attempt == 0 else "Revised implementation:"
        return Turn(agent="CodeWriter", kind="message", content=f"{lead}\n```python\n{code}```",
                    sim={"act": "code", "attempt": attempt}, slip=slip)

    def scripted_next(self, task, turns, ctx):
        V = task.data["variants"]
        bugs = sorted(k for k in V if k.startswith("bug:"))
        last = turns[-1]
        codes = [t for t in turns if t.sim.get("act") == "code"]
        attempt = len(codes)
        again = self._redundant(turns, ctx)
        if again is not None:
            return again
        if not any(t.sim.get("act") == "plan" for t in turns):
            return Turn(agent="CodeWriter", kind="message", sim={"act": "plan"},
                        content=f"I'll implement `{task.data['function']}` directly, then ask CodeTester to run the public tests.")
        if not codes:
            if ctx.slip("computation_slip", "code", 0) and bugs:
                b = bugs[ctx.pick(len(bugs), "bug", 0)]
                return self._code_turn(V[b], b, 0, "computation_slip")
            if ctx.slip("wrong_entity", "name", 0):
                return self._code_turn(V["wrong_name"], "wrong_name", 0, "wrong_entity")
            return self._code_turn(V["correct"], "correct", 0, None)
        code, _ = self._latest_code(turns)
        if last.sim.get("act") == "code":
            if ctx.slip("premature_termination", "prem", attempt):
                return Turn(agent="CodeWriter", kind="final_answer", slip="premature_termination",
                            content=f"FINAL ANSWER: (no need to test)\n```python\n{code}```", sim={"act": "final"})
            suite = "public"
            slip = None
            if ctx.slip("wrong_tool_argument", "targ", attempt):
                suite, slip = "smoke", "wrong_tool_argument"
            return Turn(agent="CodeTester", kind="tool_call", content="Running the tests.", tool="run_tests",
                        arguments={"function": task.data["function"], "suite": suite}, sim={"act": "tcall"}, slip=slip)
        if last.kind == "tool_result" and last.sim.get("of") == "tcall" or last.sim.get("act") == "report":
            passed = bool(last.sim.get("passed")) and not last.error
            n = sum(1 for t in turns if t.sim.get("act") == "verdict")
            if passed:
                if ctx.slip("verdict_misread", "verdict", n):
                    return Turn(agent="CodeTester", kind="message", content="REJECT: test_0 fails on the edge case.",
                                sim={"act": "verdict", "ok": False}, slip="verdict_misread")
                return Turn(agent="CodeTester", kind="message", content="APPROVE: all tests pass.",
                            sim={"act": "verdict", "ok": True})
            if ctx.catches("verdict", n, last.content):
                return Turn(agent="CodeTester", kind="message",
                            content="REJECT: the tests fail:\n" + last.content.split("\n", 1)[-1],
                            sim={"act": "verdict", "ok": False})
            return Turn(agent="CodeTester", kind="message", content="APPROVE: all tests pass.",
                        sim={"act": "verdict", "ok": True}, slip="verdict_misread")
        if last.sim.get("act") == "verdict":
            if last.sim.get("ok") or attempt >= self.MAX_ATTEMPTS:
                return Turn(agent="CodeWriter", kind="final_answer", content=f"FINAL ANSWER:\n```python\n{code}```",
                            sim={"act": "final"})
            # Is the rejection backed by a real failing run of the latest code?
            real = False
            for t in reversed(turns):
                if t.sim.get("act") == "code":
                    break
                if t.sim.get("of") == "tcall" and t.kind == "tool_result":
                    real = (not t.sim.get("passed")) or bool(t.error)
                    break
            if real:
                if ctx.slip("computation_slip", "code", attempt) and bugs:
                    b = bugs[ctx.pick(len(bugs), "bug", attempt)]
                    return self._code_turn(V[b], b, attempt, "computation_slip")
                return self._code_turn(V["correct"], "correct", attempt, None)
            # following a report that no real run backs: the "fix" breaks working code
            b = bugs[ctx.pick(len(bugs), "bogusfix", attempt)] if bugs else "stub"
            return self._code_turn(V[b], b, attempt, None)
        return Turn(agent="CodeWriter", kind="final_answer", content=f"FINAL ANSWER:\n```python\n{code}```",
                    sim={"act": "final"})

    def answer_of(self, turn: Turn) -> str:
        return turn.content


# =========================================================================== agentic

class AgenticTemplate(Template):
    name, domain, lead, partner = "manager_search_agent", "agentic", "Manager", "search_agent"
    tools = {"Manager": (), "search_agent": ("search", "lookup")}
    arg_schema = {"search": {"query": (str, None)}, "lookup": {"doc_id": (str, None)}}
    tool_doc = {"search": "Search the local document store; returns up to 3 (doc id, title) hits.",
                "lookup": "Return the full text of one document by its id."}
    acts = ("request", "plan", "search", "lookup", "result", "claim", "redo", "confirm", "final")

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
            return Turn(agent="Manager", kind="message", sim={"act": "plan"},
                        content="search_agent, please find " + "; ".join(parts) + ". Cite document ids.")
        if last.sim.get("act") == "confirm":
            ans = last.sim["value"]
            return Turn(agent="Manager", kind="final_answer", content=_final_text(ans), sim={"act": "final", "answer": ans})
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
            return Turn(agent="search_agent", kind="tool_call", content=f"Reading {pick}.", tool="lookup",
                        arguments={"doc_id": pick}, sim={"act": "lookup", "hop": hop}, slip=slip)
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
            return Turn(agent="search_agent", kind="message",
                        content=f"The {PHRASE[rel]} of {subj} is {value} (source: {did}).",
                        sim={"act": "claim", "hop": hop, "value": value, "doc_id": did}, slip=slip)
        if hop is not None:
            if last.sim.get("act") == "claim" and last.sim["hop"] < len(hops) - 1 and \
                    ctx.slip("premature_termination", "prem", last.sim["hop"], att):
                ans = last.sim["value"]
                return Turn(agent="Manager", kind="final_answer", content=f"{_final_text(ans)} (enough evidence)",
                            sim={"act": "final", "answer": ans}, slip="premature_termination")
            subj = self._subject(task, claims, hop)
            return Turn(agent="search_agent", kind="tool_call", content=f"Searching for the {PHRASE[hops[hop]['relation']]} of {subj}.",
                        tool="search", arguments={"query": f"{subj} {PHRASE[hops[hop]['relation']]}"},
                        sim={"act": "search", "hop": hop})
        # every hop has a claim: the Manager checks the evidence chain
        bad = self._check_chain(task, turns, claims)
        final = str(claims[len(hops) - 1]["value"])
        if bad is not None and sum(attempts.values()) < 2:
            if ctx.catches("check", bad, n_checks, str(claims[bad]["value"]) if bad in claims else "-"):
                return Turn(agent="Manager", kind="message", sim={"act": "redo", "hop": bad},
                            content=f"The evidence for hop {bad + 1} does not hold up; search_agent, redo hop {bad + 1}.")
            return Turn(agent="Manager", kind="message", sim={"act": "confirm", "value": final},
                        content=f"Evidence checked. The answer is {final}.", slip="verdict_misread")
        if bad is None and ctx.slip("verdict_misread", "verdict", n_checks):
            wrong = self._subject(task, claims, len(hops) - 1)
            return Turn(agent="Manager", kind="message", sim={"act": "confirm", "value": wrong},
                        content=f"Evidence checked. The answer is {wrong}.", slip="verdict_misread")
        return Turn(agent="Manager", kind="message", sim={"act": "confirm", "value": final},
                    content=f"Evidence checked. The answer is {final}.")


TEMPLATES: dict[str, Template] = {"math": MathTemplate(), "coding": CodingTemplate(), "agentic": AgenticTemplate()}


def template_for(domain: str) -> Template:
    if domain not in TEMPLATES:
        raise ValueError(f"no template for domain {domain!r}")
    return TEMPLATES[domain]

