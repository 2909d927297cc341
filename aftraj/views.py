"""Views of a run: the observer view (JSON for people and the API) and the bounded auditor view
the prompt builder uses when a prefix is over its token budget (DESIGN §3).

Auditor view of prefix t: the oldest steps as one aggregate line per fixed block (8, 64, 512 …
steps), then one line per step, then the latest steps verbatim (rendered by `render_step`, so
they split back), with a coverage block between summary and verbatim steps:

    <summary>
    Older steps, summarised deterministically …
    [0-63] 64 steps; agents: "Orchestrator"×30, "WebSurfer"×34; kinds: message×64; 123456 chars
    [64] "WebSurfer" message, 2345 chars: I typed 'Hamilton Beach' into …
    </summary>
    <coverage>steps 0-71 summarised, steps 72 onward verbatim</coverage>
    <step index=72 …> … (verbatim)

The boundaries only ever move forward, a block at a time, and are a deterministic function of
the trajectory, t and the budget, so consecutive prefixes share everything up to the newest
step (prefix caching keeps working) except at the rare recompiles, which still share the
summary's older lines. Nothing disappears without the coverage stamp saying so; if even the
most compact view cannot fit, `PromptBudgetError` says so.

    aftraj inspect ww.jsonl --prompt 120 --budget 8192
    aftraj fold run.jsonl --json          # observer view
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from collections.abc import Callable

import orjson

from aftraj.escape import escape
from aftraj.tokens import PromptBudgetError

BLOCK = 8                 # steps per block at the first aggregate level
FANOUT = 8                # blocks per unit at each further level
MAX_LEVEL = 6             # level 1 = one line per step; level l >= 2: BLOCK * FANOUT**(l-2) steps
HEAD_CHARS = 100          # characters of a step kept on its summary line
VERBATIM_SHARE = 0.4      # when over budget, summarise more steps while verbatim > this share
TARGET_SHARE = 0.6        # ... and recompile until the view uses at most this share (hysteresis)
MARGIN = 8                # tokens kept free for merges across piece boundaries
SUMMARY_HEAD = ("Older steps, summarised deterministically (a line per block of steps, then a "
                "line per step: index, agent, kind, size, opening words):\n")


# --------------------------------------------------------------------------- observer view

def observer_view(state, *, max_tool_calls: int | None = 50) -> dict:
    """A JSON-able picture of a RunState for people and the API (findings with evidence)."""
    calls = state.tool_calls if max_tool_calls is None else state.tool_calls[-max_tool_calls:]
    if max_tool_calls == 0:
        calls = []
    view = {
        "run_id": state.run_id, "category": state.category,
        "policy": {"name": state.policy.name, "revision": state.policy.revision},
        "events": state.n_events, "last_seq": state.last_seq,
        "first_ts": state.first_ts, "last_ts": state.last_ts,
        "events_by_kind": dict(sorted(state.kind_counts.items())),
        "agents": {a: {"events": n, "turns": state.turns_by_agent.get(a, 0),
                       "tool_calls": state.calls_by_agent.get(a, 0)}
                   for a, n in state.events_by_agent.items()},
        "tool_calls": {"total": len(state.tool_calls),
                       "by_tool": dict(sorted(state.calls_by_tool.items())),
                       "open": list(state.open_calls),
                       "orphan_results": state.orphan_results,
                       "outcomes": dict(sorted(Counter(c.outcome for c in state.tool_calls).items())),
                       "recent" if max_tool_calls is not None else "all": [c.to_dict() for c in calls]},
        "errors": state.errors, "max_error_streak": state.max_error_streak,
        "handoffs": [{"event_id": h[0], "pos": h[1], "from": h[2], "to": h[3]} for h in state.handoffs],
        "termination": state.termination, "final_answer": state.final_answer,
        "usage": {"input_tokens": state.input_tokens, "output_tokens": state.output_tokens,
                  "cached_tokens": state.cached_tokens, "total_tokens": state.total_tokens,
                  "cost_usd": round(state.cost_usd, 6), "by_model": state.tokens_by_model,
                  "repeated_usage_records": state.usage_repeats},
        "facts": {"distinct_result_ids": len(state.result_ids_seen),
                  "content_chars": state.content_chars},
        "findings": [f.to_dict() for f in state.findings],
        "alarm": next((f.to_dict() for f in state.findings if f.alarm), None),
        "state_hash": state.state_hash(),
    }
    return orjson.loads(orjson.dumps(view))   # plain JSON, detached from the live state


# --------------------------------------------------------------------------- summary lines

def _one_line(text: str, n: int) -> str:
    s = " ".join(text.split())
    return s if len(s) <= n else s[:n].rstrip() + "…"


def step_line(step) -> str:
    """One deterministic line for one step (escaped: content cannot forge a tag)."""
    bits = [f"[{step.index}]", json.dumps(step.agent, ensure_ascii=False), step.kind]
    if step.tool is not None:
        bits.append(f"tool={json.dumps(step.tool, ensure_ascii=False)}")
    if step.result_ids is not None:
        bits.append(f"results={len(step.result_ids)}")
    if step.error is not None:
        bits.append("error")
    head = _one_line(step.content, HEAD_CHARS)
    line = " ".join(bits) + f", {len(step.content)} chars" + (f": {head}" if head else "")
    return escape(line) + "\n"


def block_line(steps) -> str:
    """One aggregate line for a run of steps."""
    agents = Counter(s.agent for s in steps)
    kinds = Counter(s.kind for s in steps)
    tools = Counter(s.tool for s in steps if s.tool is not None)
    errors = sum(s.error is not None for s in steps)
    parts = [f"[{steps[0].index}-{steps[-1].index}] {len(steps)} steps",
             "agents: " + ", ".join(f"{json.dumps(a, ensure_ascii=False)}×{n}" for a, n in agents.items()),
             "kinds: " + ", ".join(f"{k}×{n}" for k, n in kinds.items())]
    if tools:
        parts.append("tools: " + ", ".join(f"{json.dumps(k, ensure_ascii=False)}×{n}" for k, n in tools.items()))
    if errors:
        parts.append(f"errors: {errors}")
    parts.append(f"{sum(len(s.content) for s in steps)} chars")
    return escape("; ".join(parts)) + "\n"


def _unit(level: int) -> int:
    return 1 if level == 1 else BLOCK * FANOUT ** (level - 2)


# Token counts of rendered pieces, shared across calls (an eval walk renders every prefix).
_COUNT_CACHE: OrderedDict = OrderedDict()
_COUNT_CACHE_MAX = 50_000


def _count(count_tokens: Callable[[str], int], text: str) -> int:
    key = (count_tokens, len(text), hash(text))   # not the text itself: bounded memory
    n = _COUNT_CACHE.get(key)
    if n is None:
        n = count_tokens(text)
        _COUNT_CACHE[key] = n
        if len(_COUNT_CACHE) > _COUNT_CACHE_MAX:
            _COUNT_CACHE.popitem(last=False)
    return n


# --------------------------------------------------------------------------- the plan

class _Plan:
    """Boundaries of the view: ends[l] = end (exclusive) of the level-l region; ends[1] = first
    verbatim step. Level-l region = [ends[l+1], ends[l]), ends[MAX_LEVEL+1] = 0."""

    def __init__(self, steps, count_tokens, render_step, cache=None):
        self.steps, self.ct, self.rs = steps, count_tokens, render_step
        self.ends = [0] * (MAX_LEVEL + 2)   # index 0 unused
        # token counts of pieces: a PrefixCache keeps them from one prefix of the run to the next
        self._verb: dict[int, int] = {} if cache is None else cache.verb
        self._unit_cost: dict[tuple[int, int], int] = {} if cache is None else cache.unit_cost
        self._text: dict[tuple[int, int], str] = {} if cache is None else cache.unit_text

    def verb(self, i: int) -> int:
        c = self._verb.get(i)
        if c is None:
            c = self._verb[i] = _count(self.ct, self.rs(self.steps[i]))
        return c

    def unit_cost(self, level: int, start: int) -> int:
        key = (level, start)
        c = self._unit_cost.get(key)
        if c is None:
            c = self._unit_cost[key] = _count(self.ct, self.unit_text(level, start))
        return c

    def unit_text(self, level: int, start: int) -> str:
        key = (level, start)
        text = self._text.get(key)
        if text is None:
            text = self._text[key] = (step_line(self.steps[start]) if level == 1 else
                                      block_line(self.steps[start:start + _unit(level)]))
        return text

    def keep_shown_text(self) -> None:
        """Forget the summary lines outside the current regions (the boundaries only move
        forward: a cache keeps the lines a run's next prefix shows, not every line it showed)."""
        shown = {(lvl, s) for lvl, lo, hi in self.regions() for s in range(lo, hi, _unit(lvl))}
        for key in [k for k in self._text if k not in shown]:
            del self._text[key]

    def regions(self):
        """(level, start, end) for every non-empty summary region, oldest first."""
        e = self.ends
        out = []
        for lvl in range(MAX_LEVEL, 0, -1):
            lo, hi = (0 if lvl == MAX_LEVEL else e[lvl + 1]), e[lvl]
            if hi > lo:
                out.append((lvl, lo, hi))
        return out

    def summary_cost(self) -> int:
        total = 0
        for lvl, lo, hi in self.regions():
            u = _unit(lvl)
            total += sum(self.unit_cost(lvl, s) for s in range(lo, hi, u))
        return total

    def verbatim_cost(self, t: int) -> int:
        return sum(self.verb(i) for i in range(self.ends[1], t + 1))

    def escalate(self, t: int, avail: int) -> bool:
        """Summarise one more block (or promote one older block a level up). False if nothing is
        left to compress."""
        e = self.ends
        v = e[1]
        if v <= t and self.verbatim_cost(t) > VERBATIM_SHARE * avail:
            e[1] = min((v // BLOCK + 1) * BLOCK, t + 1)
            return True
        for lvl in range(2, MAX_LEVEL + 1):       # promote the oldest lower-level unit
            u = _unit(lvl)
            if e[lvl] + u <= e[lvl - 1] and e[lvl] % u == 0:
                e[lvl] += u
                return True
        if v <= t:
            e[1] = min((v // BLOCK + 1) * BLOCK, t + 1)
            return True
        return False


def _wrap(summary_lines: list[str], first_verbatim: int, t: int) -> tuple[str, str]:
    last_sum = first_verbatim - 1
    if first_verbatim > t:
        inner = f"steps 0-{last_sum} summarised, no step verbatim"
        stamp = f"steps 0-{last_sum} summarised, none verbatim"
    else:
        inner = f"steps 0-{last_sum} summarised, steps {first_verbatim} onward verbatim"
        stamp = f"steps 0-{last_sum} summarised, {first_verbatim}-{t} verbatim"
    head = "<summary>\n" + SUMMARY_HEAD + "".join(summary_lines) + "</summary>\n"
    return head + f"<coverage>{inner}</coverage>\n", stamp


def _overhead(count_tokens, t: int) -> int:
    head, _ = _wrap([], t, t)
    return count_tokens(head) + 2 * MARGIN


def auditor_view(traj, t: int, budget_tokens: int, *, count_tokens: Callable[[str], int],
                 render_step: Callable, cache=None) -> tuple[str, str]:
    """The bounded body for prefix t: (body_text, coverage_stamp). See the module docstring.

    `body_text` replaces the concatenation of `render_step(s)` for steps 0..t and measures at
    most `budget_tokens` with `count_tokens`. `cache` (`aftraj.prompt.PrefixCache`): the walk
    below resumes where the run's previous prefix left it (same result, work per new step)."""
    steps = traj.steps
    if not 0 <= t < len(steps):
        raise IndexError(f"prefix t={t} is out of range for {len(steps)} steps")
    avail = budget_tokens - _overhead(count_tokens, t)
    if avail <= 0:
        raise PromptBudgetError(f"a budget of {budget_tokens} tokens leaves no room for the "
                                f"trajectory of {traj.id!r} (prefix t={t})")
    if cache is not None:
        cache.sync(steps, count_tokens, render_step)
    plan = _Plan(steps, count_tokens, render_step, cache)
    start = 0
    if cache is not None and cache.plan_ends is not None and cache.plan_avail == avail and cache.plan_t <= t:
        plan.ends[:] = cache.plan_ends            # the walk over 0..plan_t, done before
        start = cache.plan_t + 1
    # Walk the prefixes 0..t: the boundaries only move forward, so the plan at t is the one a
    # live run would have reached, and consecutive prefixes share their summary.
    for tt in range(start, t + 1):
        if plan.summary_cost() + plan.verbatim_cost(tt) > avail:
            while plan.summary_cost() + plan.verbatim_cost(tt) > TARGET_SHARE * avail:
                if not plan.escalate(tt, avail):
                    break
    if cache is not None:
        cache.plan_ends, cache.plan_t, cache.plan_avail = list(plan.ends), t, avail
    if plan.ends[1] == 0:       # we are only called when the plain body is over budget
        plan.escalate(t, avail)
    while True:
        body, stamp = _render(plan, t, render_step)
        if count_tokens(body) <= budget_tokens - MARGIN:
            if cache is not None:
                plan.keep_shown_text()
            return body, stamp
        if not plan.escalate(t, avail):
            raise PromptBudgetError(
                f"prefix t={t} of {traj.id!r} does not fit {budget_tokens} tokens even with every "
                f"step summarised ({count_tokens(body)} tokens); raise the budget")


def _render(plan: _Plan, t: int, render_step) -> tuple[str, str]:
    v = plan.ends[1]
    if v == 0:
        body = "".join(render_step(s) for s in plan.steps[: t + 1])
        return body, f"steps 0-{t} verbatim"
    lines = []
    for lvl, lo, hi in plan.regions():
        lines += [plan.unit_text(lvl, s) for s in range(lo, hi, _unit(lvl))]
    head, stamp = _wrap(lines, v, t)
    return head + "".join(render_step(s) for s in plan.steps[v: t + 1]), stamp
