"""Rule detectors over the fold, and their versioned policy (YAML under configs/policies/).

Each detector is incremental: the fold (`aftraj.fold`) calls it with the event it just folded
and it updates a small bounded state, so a finding costs O(1) per event and is visible at the
event that completes its evidence. Every finding carries its `kind`, the evidence `event_ids`
(and their positions in the run, `steps`), the `policy_revision` it was judged under and a
`reason` a person can read.

Kinds (`FINDING_KINDS`):
- repeated_result_loop: >= loop.min_calls consecutive calls of one tool whose adjacent results
  overlap (|A∩B| / min(|A|,|B|)) by >= loop.overlap_threshold. An unknown result list (null)
  in such a window gives insufficient_loop_evidence instead (an evidence gap, not a loop); an
  observed empty list repeats nothing; an error result ends the chain (a retry is not a loop);
  pagination with new ids has overlap 0.
- step_limit_without_answer: the run terminated at its step limit with no non-empty answer.
  run_cancelled and terminated_on_tool_error are separate kinds.
- tool_not_permitted: a call to a tool outside the task category's permitted tools (evidence:
  only the offending call).
- error_streak: error_streak.max_consecutive failed tool interactions in a row.
- state_cycle: tools alternating with a period of 2..cycle.max_period, repeated cycle.repeats
  times, with no new result ids after the first result of the window, each call returning what
  the call one period earlier returned (overlap >= loop.overlap_threshold): search, rank,
  search, rank going round the same state.
- stall: stall.max_results_without_new consecutive tool results that bring no new result ids.
- budget_exceeded: tokens, cost or events over budget.* (once per budget).

    aftraj fold run.jsonl --policy configs/policies/default.yaml
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from aftraj.config import ConfigError, build, is_int, need, read_yaml

FINDING_KINDS = ("repeated_result_loop", "insufficient_loop_evidence",
                 "step_limit_without_answer", "run_cancelled", "terminated_on_tool_error",
                 "tool_not_permitted", "error_streak", "state_cycle", "stall", "budget_exceeded")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_POLICY_PATH = REPO_ROOT / "configs" / "policies" / "default.yaml"


# --------------------------------------------------------------------------- policy
# A policy file that does not validate is a ConfigError (aftraj.config) naming the file and key.


@dataclass(frozen=True)
class LoopPolicy:
    min_calls: int = 3
    overlap_threshold: float = 0.8

    def __post_init__(self):
        need(is_int(self.min_calls) and self.min_calls >= 2, "min_calls",
             f"must be an integer >= 2, got {self.min_calls!r}")
        need(isinstance(self.overlap_threshold, (int, float)) and not isinstance(self.overlap_threshold, bool)
             and 0 < self.overlap_threshold <= 1, "overlap_threshold",
             f"must be a number in (0, 1], got {self.overlap_threshold!r}")


@dataclass(frozen=True)
class ErrorStreakPolicy:
    max_consecutive: int = 3

    def __post_init__(self):
        need(is_int(self.max_consecutive) and self.max_consecutive >= 1,
             "max_consecutive", f"must be an integer >= 1, got {self.max_consecutive!r}")


@dataclass(frozen=True)
class CyclePolicy:
    max_period: int = 3
    repeats: int = 2

    def __post_init__(self):
        need(is_int(self.max_period) and 2 <= self.max_period <= 8, "max_period",
             f"must be an integer in 2..8, got {self.max_period!r}")
        need(is_int(self.repeats) and 2 <= self.repeats <= 8, "repeats",
             f"must be an integer in 2..8, got {self.repeats!r}")


@dataclass(frozen=True)
class StallPolicy:
    max_results_without_new: int = 8

    def __post_init__(self):
        need(is_int(self.max_results_without_new) and self.max_results_without_new >= 2,
             "max_results_without_new",
             f"must be an integer >= 2, got {self.max_results_without_new!r}")


@dataclass(frozen=True)
class BudgetPolicy:
    max_tokens: int | None = None
    max_cost_usd: float | None = None
    max_events: int | None = None

    def __post_init__(self):
        for name in ("max_tokens", "max_events"):
            v = getattr(self, name)
            need(v is None or (is_int(v) and v > 0), name,
                 f"must be a positive integer or null, got {v!r}")
        v = self.max_cost_usd
        need(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0),
             "max_cost_usd", f"must be a positive number or null, got {v!r}")


@dataclass(frozen=True)
class Policy:
    """What the detectors fire on. `revision` goes into every finding; bump it on any change."""

    revision: int = 1
    name: str = "default"
    loop: LoopPolicy = field(default_factory=LoopPolicy)
    retryable_errors: tuple[str, ...] = ("timeout", "timed out", "rate limit", "429", "502",
                                         "503", "temporarily unavailable", "connection reset",
                                         "try again")
    error_streak: ErrorStreakPolicy = field(default_factory=ErrorStreakPolicy)
    cycle: CyclePolicy = field(default_factory=CyclePolicy)
    stall: StallPolicy = field(default_factory=StallPolicy)
    budget: BudgetPolicy = field(default_factory=lambda: BudgetPolicy(2_000_000, 50.0, 2000))
    # task category (the trajectory's domain) -> the tools it may call; categories not listed
    # are not checked.
    permitted_tools: dict = field(default_factory=dict)
    # finding kinds that make the `rules` auditor raise an alarm (the others are reported only)
    alarm_on: tuple[str, ...] = ("repeated_result_loop", "step_limit_without_answer",
                                 "terminated_on_tool_error", "tool_not_permitted", "error_streak",
                                 "state_cycle", "stall", "budget_exceeded")

    def __post_init__(self):
        need(is_int(self.revision) and self.revision >= 1, "revision",
             f"must be an integer >= 1, got {self.revision!r}")
        need(isinstance(self.name, str) and bool(self.name.strip()), "name", "must be a non-empty string")
        for key, cls in (("loop", LoopPolicy), ("error_streak", ErrorStreakPolicy),
                         ("cycle", CyclePolicy), ("stall", StallPolicy), ("budget", BudgetPolicy)):
            need(isinstance(getattr(self, key), cls), key, f"must be a {cls.__name__}")
        if isinstance(self.retryable_errors, list):
            object.__setattr__(self, "retryable_errors", tuple(self.retryable_errors))
        need(isinstance(self.retryable_errors, tuple)
             and all(isinstance(s, str) and s.strip() for s in self.retryable_errors),
             "retryable_errors", "must be a list of non-empty strings")
        object.__setattr__(self, "retryable_errors", tuple(s.lower() for s in self.retryable_errors))
        need(isinstance(self.permitted_tools, dict), "permitted_tools",
             "must map a task category to a list of tool names")
        norm = {}
        for cat, tools in self.permitted_tools.items():
            need(isinstance(cat, str) and cat.strip(), "permitted_tools", f"bad category {cat!r}")
            need(isinstance(tools, (list, tuple)) and all(isinstance(t, str) and t.strip() for t in tools),
                 f"permitted_tools.{cat}", "must be a list of tool names")
            norm[cat] = frozenset(tools)
        object.__setattr__(self, "permitted_tools", norm)
        if isinstance(self.alarm_on, list):
            object.__setattr__(self, "alarm_on", tuple(self.alarm_on))
        need(isinstance(self.alarm_on, tuple), "alarm_on", "must be a list of finding kinds")
        for k in self.alarm_on:
            need(k in FINDING_KINDS, "alarm_on", f"unknown finding kind {k!r} "
                                                  f"(known: {', '.join(FINDING_KINDS)})")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["permitted_tools"] = {k: sorted(v) for k, v in sorted(self.permitted_tools.items())}
        d["retryable_errors"] = list(self.retryable_errors)
        d["alarm_on"] = list(self.alarm_on)
        return d

    @classmethod
    def from_dict(cls, d: Any, source: str | Path | None = None) -> Policy:
        """From a mapping (a policy file, a fold snapshot's `policy`), by the one config layer;
        `revision` must be given (policies are versioned)."""
        if isinstance(d, dict) and "revision" not in d and not (set(d) - {f.name for f in fields(cls)}):
            raise ConfigError("is required (policies are versioned)", key="revision", source=source)
        if isinstance(d, dict) and d.get("permitted_tools", {}) is None:
            d = {**d, "permitted_tools": {}}
        return build(cls, d, source=source, what="policy")


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy YAML; errors name the file and the key."""
    return Policy.from_dict(read_yaml(path), path)


def default_policy() -> Policy:
    """The built-in policy; configs/policies/default.yaml holds the same values (a test checks)."""
    return Policy()


# --------------------------------------------------------------------------- findings

class Finding:
    """One detector finding with its evidence. `seen_at`: position of the event that made it visible."""

    __slots__ = ("kind", "event_ids", "steps", "policy_revision", "reason", "alarm", "seen_at",
                 "detail")

    def __init__(self, kind: str, event_ids: tuple, steps: tuple, policy_revision: int,
                 reason: str, alarm: bool, seen_at: int, detail: dict | None = None):
        self.kind = kind
        self.event_ids = tuple(event_ids)
        self.steps = tuple(steps)
        self.policy_revision = policy_revision
        self.reason = reason
        self.alarm = alarm
        self.seen_at = seen_at
        self.detail = detail or {}

    @property
    def first_step(self) -> int:
        return min(self.steps)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "event_ids": list(self.event_ids), "steps": list(self.steps),
                "policy_revision": self.policy_revision, "reason": self.reason,
                "alarm": self.alarm, "seen_at": self.seen_at, "detail": self.detail}

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        return cls(d["kind"], tuple(d["event_ids"]), tuple(d["steps"]), d["policy_revision"],
                   d["reason"], d["alarm"], d["seen_at"], d.get("detail") or {})

    def __repr__(self) -> str:
        return f"Finding({self.kind}, steps={list(self.steps)}, {self.reason!r})"


# --------------------------------------------------------------------------- detector state

def overlap(a: frozenset, b: frozenset) -> float:
    """Overlap coefficient |A∩B| / min(|A|,|B|); 0 when either is empty (empty repeats nothing)."""
    if not a or not b:
        return 0.0
    return len(a & b) / min(len(a), len(b))


class Detectors:
    """All detectors' bounded state for one run. Driven by `aftraj.fold.fold`."""

    __slots__ = ("policy", "findings", "loop_chain", "loop_tool", "loop_fired", "gap_fired",
                 "cycle_win", "cycle_fired", "streak", "streak_fired", "stall", "stall_fired",
                 "budget_fired", "_alarm_on", "_theta", "_n", "_retry", "_min_cycle")

    def __init__(self, policy: Policy):
        self.policy = policy
        self.findings: list[Finding] = []
        # loop: the current chain of consecutive results of one tool:
        # [call_eid, result_eid, call_pos, result_pos, ids (frozenset|None), link (float|None)]
        self.loop_chain: deque = deque(maxlen=policy.loop.min_calls)
        self.loop_tool: str | None = None
        self.loop_fired = False
        self.gap_fired = False
        # cycle: the last results [tool, n_new (int|None), call_eid, result_eid, call_pos, result_pos]
        self.cycle_win: deque = deque(maxlen=policy.cycle.max_period * policy.cycle.repeats)
        self.cycle_fired = False
        self.streak: list = []          # [eid, pos] of the current error streak
        self.streak_fired = False
        self.stall: deque = deque(maxlen=policy.stall.max_results_without_new)
        self.stall_fired = False
        self.budget_fired: list[str] = []
        self._alarm_on = frozenset(policy.alarm_on)
        self._theta = policy.loop.overlap_threshold - 1e-9
        self._n = policy.loop.min_calls
        self._retry = policy.retryable_errors
        self._min_cycle = 2 * policy.cycle.repeats

    # ---- helpers
    def emit(self, kind: str, evidence: list, reason: str, seen_at: int, detail=None) -> Finding:
        """evidence: [(event_id, position), …] in run order."""
        ev = sorted(set(evidence), key=lambda x: (x[1], x[0]))
        f = Finding(kind, tuple(e for e, _ in ev), tuple(p for _, p in ev), self.policy.revision,
                    reason, kind in self._alarm_on, seen_at, detail)
        self.findings.append(f)
        return f

    def retryable(self, error: str) -> bool:
        e = error.lower()
        return any(s in e for s in self._retry)

    # ---- events
    def on_tool_call(self, ev, pos: int, category: str | None) -> None:
        allowed = self.policy.permitted_tools.get(category) if category else None
        if allowed is not None:
            tool = ev.payload["tool"]
            if tool not in allowed:
                self.emit("tool_not_permitted", [(ev.event_id, pos)],
                          f"{ev.agent} called tool {tool!r}, which the {category!r} task category "
                          f"does not permit (permitted: {', '.join(sorted(allowed)) or 'none'})",
                          pos, {"tool": tool, "category": category})

    def on_failure(self, eid: str, pos: int, agent: str, error: str) -> None:
        """An errored tool result or an error event: extends the error streak, ends loop chains."""
        self.loop_chain.clear()
        self.loop_tool = None
        self.loop_fired = self.gap_fired = False
        self.streak.append((eid, pos))
        n = self.policy.error_streak.max_consecutive
        if len(self.streak) >= n and not self.streak_fired:
            self.streak_fired = True
            self.emit("error_streak", self.streak[-n:],
                      f"{n} failed tool interactions in a row; last error by {agent}: "
                      f"{_short(error)}", pos, {"length": len(self.streak)})

    def on_success(self) -> None:
        if self.streak:
            self.streak = []
            self.streak_fired = False

    def on_tool_result(self, call_eid: str | None, call_pos: int | None, eid: str, pos: int,
                       tool: str | None, ids: list | None, n_new: int | None, agent: str) -> None:
        """A result without error. `n_new`: result ids not seen before in the run (None: unknown)."""
        if self.streak:
            self.streak = []
            self.streak_fired = False
        fs = None if ids is None else frozenset(ids)
        # -- repeated-result loop
        chain = self.loop_chain
        if tool is None or tool != self.loop_tool or not chain:
            chain.clear()
            self.loop_tool = tool
            self.loop_fired = self.gap_fired = False
            link = None
        else:
            prev = chain[-1][4]
            if prev is None or fs is None:
                link = None            # unknown: neither a repeat nor a break
            elif not prev or not fs:
                link = 0.0             # an observed empty list repeats nothing
            else:
                link = len(prev & fs) / (len(prev) if len(prev) < len(fs) else len(fs))
            if link is not None and link < self._theta:
                chain.clear()
                self.loop_fired = self.gap_fired = False
                link = None
        chain.append((call_eid, eid, call_pos, pos, fs, link))
        if tool is not None and len(chain) >= self._n and not self.loop_fired:
            self._loop_check(tool)
        # -- state cycle
        win = self.cycle_win
        if tool is None:
            win.clear()
            self.cycle_fired = False
        else:
            if n_new:
                self.cycle_fired = False
            win.append((tool, n_new, call_eid, eid, call_pos, pos, fs))
            if n_new == 0 and not self.cycle_fired and len(win) >= self._min_cycle:
                self._cycle_check()
        # -- stall
        if n_new is not None:
            if n_new > 0:
                if self.stall:
                    self.stall.clear()
                    self.stall_fired = False
            else:
                self._stall(eid, pos)

    def on_error_result(self, call_eid, call_pos, eid, pos, tool, agent, error) -> None:
        self.on_failure(eid, pos, agent, error)
        self.cycle_win.clear()
        self.cycle_fired = False

    def _loop_check(self, tool: str) -> None:
        chain = list(self.loop_chain)
        links = [c[5] for c in chain[1:]]
        evidence = [(c[0], c[2]) for c in chain if c[0] is not None] + [(c[1], c[3]) for c in chain]
        pos = chain[-1][3]
        if all(x is not None for x in links):
            self.loop_fired = True
            self.emit("repeated_result_loop", evidence,
                      f"{len(chain)} consecutive {tool!r} calls returned overlapping results "
                      f"(adjacent overlap {', '.join(f'{x:.2f}' for x in links)} >= "
                      f"{self.policy.loop.overlap_threshold}); the agent is repeating itself",
                      pos, {"tool": tool, "overlaps": links})
        elif not self.gap_fired:
            self.gap_fired = True
            self.emit("insufficient_loop_evidence", evidence,
                      f"{len(chain)} consecutive {tool!r} calls look repetitive, but "
                      f"{sum(x is None for x in links)} of the adjacent result lists are unknown, "
                      f"so a loop cannot be established", pos, {"tool": tool})

    def _cycle_check(self) -> None:
        reps = self.policy.cycle.repeats
        w = list(self.cycle_win)
        for p in range(2, self.policy.cycle.max_period + 1):
            L = p * reps
            if len(w) < L:
                break
            x = w[-L:]
            if len({e[0] for e in x[:p]}) < 2:
                continue
            if any(x[i][0] != x[i - p][0] for i in range(p, L)):
                continue
            if any(e[1] is None or e[1] > 0 for e in x[1:]):
                continue
            # the same state recurs: each call returns what the call one period earlier returned
            if any(x[i][6] is None or x[i - p][6] is None
                   or overlap(x[i][6], x[i - p][6]) < self._theta for i in range(p, L)):
                continue
            self.cycle_fired = True
            tools = ", ".join(e[0] for e in x[:p])
            evidence = [(e[2], e[4]) for e in x if e[2] is not None] + [(e[3], e[5]) for e in x]
            self.emit("state_cycle", evidence,
                      f"the tools cycle ({tools}) {reps} times with no new results: the agents "
                      f"are going round in circles", x[-1][5],
                      {"period": p, "tools": [e[0] for e in x[:p]]})
            return

    def _stall(self, eid, pos) -> None:
        self.stall.append((eid, pos))
        n = self.policy.stall.max_results_without_new
        if len(self.stall) >= n and not self.stall_fired:
            self.stall_fired = True
            self.emit("stall", list(self.stall),
                      f"{n} tool results in a row brought no new result ids: the run is stalled", pos)

    def on_termination(self, ev, pos: int, prev: tuple | None, answered: bool) -> None:
        reason = ev.payload["reason"]
        evidence = [(ev.event_id, pos)] + ([prev] if prev else [])
        if reason == "step_limit" and not answered:
            self.emit("step_limit_without_answer", evidence,
                      "the run hit its step limit without producing a non-empty answer", pos)
        elif reason == "cancelled":
            self.emit("run_cancelled", evidence, "the run was cancelled before it finished", pos)
        elif reason == "tool_error":
            self.emit("terminated_on_tool_error", evidence,
                      "the run ended on a tool error", pos)

    def check_budget(self, what: str, value, limit, eid: str, pos: int) -> None:
        if limit is not None and value > limit and what not in self.budget_fired:
            self.budget_fired.append(what)
            self.emit("budget_exceeded", [(eid, pos)],
                      f"{what} reached {value}, over the budget of {limit}", pos,
                      {"budget": what, "value": value, "limit": limit})

    # ---- snapshot
    def snapshot(self) -> dict:
        def ids(fs):
            return None if fs is None else sorted(fs)
        return {
            "findings": [f.to_dict() for f in self.findings],
            "loop_chain": [[c[0], c[1], c[2], c[3], ids(c[4]), c[5]] for c in self.loop_chain],
            "loop_tool": self.loop_tool, "loop_fired": self.loop_fired, "gap_fired": self.gap_fired,
            "cycle_win": [list(c[:6]) + [ids(c[6])] for c in self.cycle_win],
            "cycle_fired": self.cycle_fired,
            "streak": [list(s) for s in self.streak], "streak_fired": self.streak_fired,
            "stall": [list(s) for s in self.stall], "stall_fired": self.stall_fired,
            "budget_fired": list(self.budget_fired),
        }

    @classmethod
    def restore(cls, d: dict, policy: Policy) -> Detectors:
        s = cls(policy)
        s.findings = [Finding.from_dict(f) for f in d["findings"]]
        for c in d["loop_chain"]:
            s.loop_chain.append((c[0], c[1], c[2], c[3], None if c[4] is None else frozenset(c[4]), c[5]))
        s.loop_tool, s.loop_fired, s.gap_fired = d["loop_tool"], d["loop_fired"], d["gap_fired"]
        for c in d["cycle_win"]:
            s.cycle_win.append(tuple(c[:6]) + (None if c[6] is None else frozenset(c[6]),))
        s.cycle_fired = d["cycle_fired"]
        s.streak = [tuple(x) for x in d["streak"]]
        s.streak_fired = d["streak_fired"]
        for x in d["stall"]:
            s.stall.append(tuple(x))
        s.stall_fired = d["stall_fired"]
        s.budget_fired = list(d["budget_fired"])
        return s


def _short(s: str, n: int = 160) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"
