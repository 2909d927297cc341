"""The one verdict module (DESIGN §3, §5, §6): what a verdict is, how a completion is parsed into
one, the gold verdict of a prefix, and the rules that decide whether a verdict is right.

Evaluation (`eval.metrics`, `eval.walker`), the heuristic baselines, stage-1 preferences and the
stage-2 reward (`training.reward`) all import from here, and only from here (the prompt builder
no longer re-exports them). It builds on `aftraj.escape` and `aftraj.schema` only.

The parser is total: every input (any string, any size) returns a `Verdict` or a typed
`ParseFailure`, never an exception. Bounds: the completion is at most `MAX_COMPLETION_CHARS`
characters, integers in the answer at most `MAX_INT_DIGITS` digits, JSON nesting at most
`MAX_JSON_DEPTH`; duplicate JSON keys, stray `<think>`/`<answer>` tags and strings that are not
valid UTF-8 (a lone surrogate, raw or escaped as `\\ud83d`) are failures.

Match rules (one place): a step matches by integer equality (never substring, bools are not
steps); an agent matches exactly after trimming and case-folding; a verdict is grounded in
prefix t when its step is <= t and its agent appears among the agents of steps 0..t.

    python -c "from aftraj.verdict import parse_verdict; print(parse_verdict('<think>x</think><answer>{\\"answer\\": \\"SAFE\\", \\"agent\\": null, \\"reason\\": null}</answer>'))"
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aftraj.escape import escape

if TYPE_CHECKING:
    from aftraj.schema import Trajectory

MAX_COMPLETION_CHARS = 1_000_000   # a completion longer than this is refused unread
MAX_INT_DIGITS = 12                # a step index has at most 12 digits
MAX_JSON_DEPTH = 4                 # the answer is a flat object; a little slack for error messages


# --------------------------------------------------------------------------- the verdict

@dataclass(frozen=True)
class Verdict:
    """SAFE (CONTINUE) or UNSAFE (ALARM) at `step` blaming `agent`."""

    decision: str                 # "SAFE" | "UNSAFE"
    step: int | None = None
    agent: str | None = None
    reason: str | None = None
    think: str = ""
    confidence: float | None = None  # P(UNSAFE) where the backend gives log-probabilities

    @property
    def alarm(self) -> bool:
        return self.decision == "UNSAFE"

    def answer_json(self) -> str:
        return json.dumps({"answer": "SAFE" if not self.alarm else self.step,
                           "agent": self.agent, "reason": self.reason},
                          ensure_ascii=False).replace("<", "\\u003c")  # no tag can appear


PARSE_FAILURE_CODES = ("empty", "missing_think", "missing_answer", "multiple_answers",
                       "text_outside_blocks", "malformed_json", "bad_keys", "bad_answer",
                       "negative_step", "step_out_of_range", "empty_agent", "empty_reason",
                       "safe_with_fields",
                       # hardening (issue 14): bounded input, no ambiguity
                       "too_long", "stray_tags", "duplicate_keys", "number_too_large", "too_deep",
                       # lone surrogates (raw or escaped as \udXXX): not UTF-8, unwritable downstream
                       "not_utf8")


@dataclass(frozen=True)
class ParseFailure:
    code: str       # one of PARSE_FAILURE_CODES
    message: str
    raw: str

    alarm = False   # evaluation counts a parse failure as CONTINUE

    def __post_init__(self) -> None:
        if self.code not in PARSE_FAILURE_CODES:
            raise ValueError(f"unknown parse failure code {self.code!r}")


# --------------------------------------------------------------------------- the parser

_FORMAT = re.compile(r"\A\s*<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*\Z",
                     re.DOTALL)


class _Refused(Exception):
    """Raised inside json.loads hooks; carries a parse-failure code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _parse_int(s: str) -> int:
    digits = s.lstrip("-")
    if len(digits) > MAX_INT_DIGITS:
        raise _Refused("number_too_large", f"an integer of {len(digits)} digits (at most {MAX_INT_DIGITS})")
    return int(s)


def _parse_float(s: str) -> float:
    if len(s) > 64:
        raise _Refused("number_too_large", f"a number of {len(s)} characters")
    return float(s)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _Refused("duplicate_keys", f"key {k!r} appears more than once")
        out[k] = v
    return out


def _json_depth(s: str) -> int:
    """Maximum bracket nesting outside strings (a scan, no recursion)."""
    depth = best = 0
    in_str = esc = False
    for ch in s:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _writable(s: str) -> str:
    """`s` with lone surrogates spelled as backslash escapes (a failure's raw text must be writable)."""
    return s if _is_utf8(s) else s.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_verdict(text: str, t: int | None = None) -> Verdict | ParseFailure:
    """Strictly parse `<think>…</think><answer>{…}</answer>`; `t` bounds the step (k <= t).
    Total: returns a `ParseFailure` for anything else, never raises."""
    if not isinstance(text, str):
        return ParseFailure("empty", f"the completion is not text ({type(text).__name__})", repr(text)[:200])

    def fail(code: str, msg: str) -> ParseFailure:
        return ParseFailure(code, msg, _writable(text))

    if not text or not text.strip():
        return fail("empty", "the completion is empty")
    if len(text) > MAX_COMPLETION_CHARS:
        return ParseFailure("too_long", f"the completion has {len(text)} characters "
                                        f"(at most {MAX_COMPLETION_CHARS})", _writable(text[:MAX_COMPLETION_CHARS]))
    if not _is_utf8(text):
        return fail("not_utf8", "the completion holds a lone surrogate (not valid UTF-8)")
    n_answer = text.count("<answer>")
    if n_answer > 1 or text.count("</answer>") > 1:
        return fail("multiple_answers", f"found {n_answer} <answer> blocks; exactly one is allowed")
    if "<answer>" not in text or "</answer>" not in text:
        return fail("missing_answer", "no <answer>…</answer> block")
    if "<think>" not in text or "</think>" not in text:
        return fail("missing_think", "no <think>…</think> block before the answer")
    if text.count("<think>") > 1 or text.count("</think>") > 1:
        return fail("stray_tags", f"found {text.count('<think>')} <think> and {text.count('</think>')} "
                                  f"</think> tags; exactly one of each is allowed")
    m = _FORMAT.match(text)
    if not m:
        return fail("text_outside_blocks", "only whitespace may surround the <think> and <answer> blocks")
    raw = m.group("answer")
    if _json_depth(raw) > MAX_JSON_DEPTH:
        return fail("too_deep", f"the answer nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        obj = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float,
                         object_pairs_hook=_no_duplicates)
    except _Refused as e:
        return fail(e.code, f"the answer block is refused: {e}")
    except (ValueError, RecursionError) as e:   # JSONDecodeError is a ValueError
        return fail("malformed_json", f"the answer block is not JSON: {e}")
    if not isinstance(obj, dict) or set(obj) != {"answer", "agent", "reason"}:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        return fail("bad_keys", f'the answer must be an object with keys answer, agent, reason; got {got}')
    ans, agent, reason = obj["answer"], obj["agent"], obj["reason"]
    if any(isinstance(x, str) and not _is_utf8(x) for x in (ans, agent, reason)):
        return fail("not_utf8", "the answer escapes a lone surrogate (\\udXXX without its pair): not valid UTF-8")
    think = m.group("think").strip()
    if ans == "SAFE":
        if agent is not None or reason is not None:
            return fail("safe_with_fields", "a SAFE answer needs null agent and reason")
        return Verdict("SAFE", think=think)
    if isinstance(ans, bool) or not isinstance(ans, int):
        return fail("bad_answer", f'answer must be "SAFE" or an integer step, got {str(ans)[:80]!r}')
    if ans < 0:
        return fail("negative_step", f"step {ans} is negative")
    if t is not None and ans > t:
        return fail("step_out_of_range", f"step {ans} is after the last step shown ({t})")
    if not isinstance(agent, str) or not agent.strip():
        return fail("empty_agent", "an UNSAFE answer needs a non-empty agent")
    if not isinstance(reason, str) or not reason.strip():
        return fail("empty_reason", "an UNSAFE answer needs a non-empty reason")
    return Verdict("UNSAFE", step=ans, agent=agent.strip(), reason=reason.strip(), think=think)


# --------------------------------------------------------------------------- gold verdicts

def format_completion(verdict: Verdict) -> str:
    """The canonical two-block text for a verdict (the released model's layout)."""
    return f"<think>\n{escape(verdict.think)}\n</think>\n<answer>\n{verdict.answer_json()}\n</answer>"


def canonical_verdict(t: int, step: int | None = None, agent: str | None = None) -> Verdict:
    """The one wording of every trained or scored verdict on prefix t (DESIGN §5, amended
    2026-12-01): SAFE when `step` is None, else ALARM at `step` blaming `agent`, with the templated
    reasoning and reason. The warm-up targets, the stage-1 pairs (chosen and rejected), the gold
    completions and the boundary probe all come from here, so the probe scores what training
    trained. A label's free-text reason is never a target: no model can guess it from the prefix,
    and a margin over it measures the wording, not the decision."""
    if step is None:
        return Verdict("SAFE", think=safe_think(t))
    if agent is None:
        raise ValueError("an ALARM verdict names its agent")
    return Verdict("UNSAFE", step=step, agent=agent, reason=alarm_reason(step, agent),
                   think=alarm_think(step, agent))


def canonical_completion(t: int, step: int | None = None, agent: str | None = None) -> str:
    """`format_completion(canonical_verdict(t, step, agent))`: the text a verdict is trained as."""
    return format_completion(canonical_verdict(t, step, agent))


def gold_verdict(traj: Trajectory, t: int) -> Verdict:
    """The optimal verdict for prefix t, in the one wording (`canonical_verdict`): SAFE before k*,
    UNSAFE (k*, a*) from k* on. The label's own reason stays in `traj.label.reason`."""
    lb = traj.label
    if not lb.unsafe or t < lb.decisive_step:
        return canonical_verdict(t)
    return canonical_verdict(t, lb.decisive_step, lb.decisive_agent)


def safe_think(t: int) -> str:
    """The canonical reasoning of a SAFE verdict on prefix t: one short sentence (~10 tokens), so a
    canonical SAFE completion is ~40 tokens and an ALARM ~60 (a CPU budget of 128 holds both)."""
    return f"Steps 0 to {t} show no decisive error."


def alarm_think(k: int, agent: str) -> str:
    """The canonical reasoning of an ALARM at step k blaming `agent` (the reason follows in the answer)."""
    return f"Step {k} by {agent} is the first decisive error."


def alarm_reason(k: int, agent: str) -> str:
    """The canonical reason of an ALARM that names no label's reason (a boundary error, a probe)."""
    return f"{agent} made the decisive error at step {k}."


def gold_completion(traj: Trajectory, t: int) -> str:
    return format_completion(gold_verdict(traj, t))


# --------------------------------------------------------------------------- match rules

def norm_agent(name: str) -> str:
    """The agent key every match uses: trimmed and case-folded."""
    return name.strip().casefold()


def agent_match(pred: str | None, gold: str | None) -> bool:
    """Exact after trimming and case-folding."""
    return pred is not None and gold is not None and norm_agent(pred) == norm_agent(gold)


def step_match(pred, gold) -> bool:
    """Integer equality (bools are not steps)."""
    return (isinstance(pred, int) and isinstance(gold, int) and not isinstance(pred, bool)
            and not isinstance(gold, bool) and pred == gold)


def grounded(step: int, agent: str, t: int, visible_agents: Iterable[str]) -> bool:
    """An UNSAFE verdict on prefix t is grounded when its step is one the auditor was shown
    (0 <= step <= t) and its agent appears among the agents of steps 0..t."""
    return 0 <= step <= t and any(agent_match(agent, a) for a in visible_agents)


def verdict_outcome(pred: Verdict, gold: Verdict) -> str:
    """'correct', 'wrong_decision', 'wrong_step' or 'wrong_agent' of a parsed verdict against gold."""
    if pred.decision != gold.decision:
        return "wrong_decision"
    if gold.alarm:
        if not step_match(pred.step, gold.step):
            return "wrong_step"
        if not agent_match(pred.agent, gold.agent):
            return "wrong_agent"
    return "correct"
