"""What every corpus domain shares (DESIGN §4): the task, the multi-agent template's base class
and its turn-phrasing helpers, the reading of local pool files, and the `Domain` entry that
each domain module (`math`, `coding`, `agentic`) fills and `aftraj.corpus.domains.DOMAINS`
registers.

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
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aftraj.corpus.rollout import Ctx, Turn
from aftraj.schema import SchemaError


@dataclass(frozen=True)
class Task:
    """One task (= one family). `data` holds what the templates and checkers need."""

    id: str
    domain: str            # math | coding | agentic
    source: str            # generated | humaneval (a coding task with a HumanEval function) | math500 | …
    prompt: str
    reference: str         # the reference answer (math value, reference code, answer string)
    data: dict = field(default_factory=dict)

    @property
    def scripted(self) -> bool:
        """Whether the scripted agents know how to solve it (generated tasks carry a plan)."""
        return bool(self.data.get("plan") or self.data.get("variants") or self.data.get("hops"))


# =========================================================================== templates

ENV = "environment"


def rid(prefix: str, *parts) -> str:
    """A stable tool-result id: the prefix and a hash of the parts."""
    return f"{prefix}:" + hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=5).hexdigest()


def final_text(answer: str) -> str:
    return f"FINAL ANSWER: {answer}"


def say(task: Task, key, options: tuple[str, ...] | list[str]) -> str:
    """One of several phrasings, fixed by (task, key): replays and the injector phrase alike."""
    h = hashlib.blake2b(f"{task.id}\x1f{key}".encode(), digest_size=4).digest()
    return options[int.from_bytes(h, "big") % len(options)]


NOTE_PERCENT = 40     # chance (per slot) of an acknowledgement turn: lengths vary beyond structure
OPENING_PERCENT = 50  # chance of each optional opening turn: the first work step moves by 0 to 2
OPTIONAL_UNTIL = 30   # optional turns (precalls, detours, faults) only before this step: runs stay under the cap
PRECALL_PERCENT = 40  # chance (per call) that the caller first says what it will call: a message where a
                      # call could stand, as a fabricated result is (so the step kind alone tells nothing)

FINAL_THOUGHTS = ("Thought: that is everything the task asks for.", "Thought: done; writing the answer down.",
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
        """The task's deterministic checker: (passed, reason)."""
        if answer is None or not str(answer).strip():
            return False, "no final answer"
        return self.check_answer(task, answer, sandbox)

    def check_answer(self, task: Task, answer: str, sandbox) -> tuple[bool, str]:
        """The domain's checker of a non-empty final answer."""
        raise NotImplementedError

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


# =========================================================================== local pool files

def jsonl_rows(path: Path):
    """(line number, object) of every non-blank line of a local JSONL pool file."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as e:
                raise SchemaError(f"invalid JSON: {e}", source=str(path), line=lineno) from None
            if not isinstance(row, dict):
                raise SchemaError("must be a JSON object", source=str(path), line=lineno)
            yield lineno, row


def need(row: dict, key: str, path: Path, lineno: int) -> Any:
    """row[key], or a SchemaError naming the file, line and field."""
    if key not in row or row[key] is None:
        raise SchemaError("is missing", field=key, source=str(path), line=lineno)
    return row[key]


# =========================================================================== the domain entry

def act(t: Turn) -> str | None:
    """The simulator's reading of a turn's act (plan, call, claim, verdict, …)."""
    return t.sim.get("act")


Predicate = Callable[..., "str | None"]       # (template, task, turns, j) -> why step j is a slip, or None
Target = Callable[[Task, Turn], bool]          # (task, turn) -> whether a type can be injected at the turn
Corruption = Callable[..., "Turn | None"]      # (template, task, turns, k, salt) -> the corrupted turn k


def one_type(problem: Callable[..., "tuple[str, str] | None"], etype: str) -> Predicate:
    """The predicate of one error type out of a check that tells two types apart: `problem`
    returns (type, reason) or None."""
    def predicate(tpl, task, turns, j):
        r = problem(tpl, task, turns, j)
        return r[1] if r and r[0] == etype else None

    predicate.__name__ = f"{etype}_of_{problem.__name__.lstrip('_')}"
    return predicate


@dataclass(frozen=True)
class Domain:
    """One domain of the corpus: everything the builder, the injector and the slip detector ask of
    it, each keyed by error type where it is typed (`aftraj.corpus.config.ERROR_TYPES`)."""

    name: str
    template: Template                                  # agents, tools, checker, scripted behaviour
    generate: Callable[..., list[Task]]                 # (n, seed, **options) -> n generated tasks
    slips: Mapping[str, Predicate]                      # the slip detector's predicates
    targets: Mapping[str, Target]                       # where each type can be injected
    corruptions: Mapping[str, Corruption]               # how each type corrupts a turn
    pools: Mapping[str, Callable[..., list[Task]]] = field(default_factory=dict)   # kind -> reader(path, limit)
