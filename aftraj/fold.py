"""The one fold: `fold(state, event) -> state`, single pass, incremental, deterministic.

A run's events (from the ledger, a JSONL file, or a trajectory's steps) are folded one at a time
into a `RunState`: per-agent events and turns, tool calls (name, arguments hash, outcome, result
ids, error), open calls, error streaks, handoffs, termination, final answer, tokens and cost
(a usage record repeated under the same usage id counts once), the result ids seen so far and
running aggregates; the rule detectors (`aftraj.detectors`) run inside the fold. Work per event
is constant in the run's length: nothing rescans history. `state.snapshot()` is plain JSON;
`RunState.restore(snapshot)` then folding the rest equals folding everything (`state_hash`).

    aftraj fold run.jsonl --json
    from aftraj.fold import fold_trajectory
    tf = fold_trajectory(traj)          # tf.visible(t), tf.first_alarm(t), tf.state

A live service (the gateway) keeps one `Folder` over a database (or JSONL) ledger:

    folder = Folder(policy, ledger=SqlLedger("sqlite:///runs/ledger.db"))   # or JsonlLedger(path)
    folder.catch_up()                   # after a restart: fold what the ledger already holds
    folder.ingest(parse_event(record))  # False for an identical duplicate; LedgerError on conflict
    observer_view(folder.states[run_id])  # state + findings with evidence and policy revision
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Iterable

import orjson

from aftraj.detectors import Detectors, Finding, Policy, default_policy
from aftraj.events import Event, EventError, is_synthetic, parse_event, trajectory_to_events
from aftraj.ledger import IngestReport, Ledger, decode_line
from aftraj.schema import Trajectory

SNAPSHOT_VERSION = 1
_NO_LIMIT = 1 << 62   # "no budget": compares like a number, costs no None check
_dumps = orjson.dumps
_SORT = orjson.OPT_SORT_KEYS
_sha256 = hashlib.sha256


class ToolCall:
    """A tool call and, once it arrives, its result. `args_hash` (sha256 of the canonical
    arguments, 16 hex digits) is computed when first read, not on the fold's hot path."""

    __slots__ = ("event_id", "pos", "agent", "tool", "_args", "_args_hash", "outcome",
                 "result_ids", "error", "result_event_id", "result_pos")
    FIELDS = ("event_id", "pos", "agent", "tool", "args_hash", "outcome", "result_ids", "error",
              "result_event_id", "result_pos")

    def __init__(self, event_id, pos, agent, tool, args_hash=None, outcome="open",
                 result_ids=None, error=None, result_event_id=None, result_pos=None, *,
                 arguments=None):
        self.event_id, self.pos, self.agent, self.tool = event_id, pos, agent, tool
        self._args, self._args_hash = arguments, args_hash
        self.outcome, self.result_ids, self.error = outcome, result_ids, error
        self.result_event_id, self.result_pos = result_event_id, result_pos

    @property
    def args_hash(self) -> str | None:
        if self._args_hash is None and self._args is not None:
            self._args_hash = _args_hash(self._args)
            self._args = None
        return self._args_hash

    def to_list(self) -> list:
        return [self.event_id, self.pos, self.agent, self.tool, self.args_hash, self.outcome,
                self.result_ids, self.error, self.result_event_id, self.result_pos]

    def to_dict(self) -> dict:
        return dict(zip(ToolCall.FIELDS, self.to_list(), strict=True))


class RunState:
    """Everything the fold knows about one run. Mutated in place by `fold` (and returned)."""

    __slots__ = ("run_id", "category", "policy", "det", "n_events", "last_seq", "first_ts",
                 "last_ts", "kind_counts", "events_by_agent", "turns_by_agent", "last_agent",
                 "tool_calls", "open_calls", "calls_by_tool", "calls_by_agent", "errors",
                 "max_error_streak", "orphan_results", "handoffs", "termination", "final_answer",
                 "input_tokens", "output_tokens", "cached_tokens", "cost_usd", "tokens_by_model",
                 "usage_ids", "usage_repeats", "result_ids_seen", "content_chars", "last_ref",
                 "max_events", "max_tokens")

    def __init__(self, run_id: str, *, category: str | None = None, policy: Policy | None = None):
        self.run_id = run_id
        self.category = category
        self.policy = policy or default_policy()
        self.det = Detectors(self.policy)
        self.n_events = 0
        self.last_seq = -1
        self.first_ts = self.last_ts = None
        self.kind_counts: dict[str, int] = {}
        self.events_by_agent: dict[str, int] = {}
        self.turns_by_agent: dict[str, int] = {}
        self.last_agent: str | None = None
        self.tool_calls: list[ToolCall] = []
        self.open_calls: dict[str, ToolCall] = {}
        self.calls_by_tool: dict[str, int] = {}
        self.calls_by_agent: dict[str, int] = {}
        self.errors = 0
        self.max_error_streak = 0
        self.orphan_results = 0
        self.handoffs: list[list] = []
        self.termination: str | None = None
        self.final_answer: str | None = None
        self.input_tokens = self.output_tokens = self.cached_tokens = 0
        self.cost_usd = 0.0
        self.tokens_by_model: dict[str, int] = {}
        self.usage_ids: set[str] = set()
        self.usage_repeats = 0
        self.result_ids_seen: set[str] = set()
        self.content_chars = 0
        self.last_ref: tuple | None = None  # (event_id, pos) of the last non-termination event
        b = self.policy.budget
        self.max_events = _NO_LIMIT if b.max_events is None else b.max_events
        self.max_tokens = _NO_LIMIT if b.max_tokens is None else b.max_tokens

    # ---- read-only views
    @property
    def findings(self) -> list[Finding]:
        return self.det.findings

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    # ---- snapshot / restore
    def snapshot(self) -> dict:
        """Plain JSON, deterministic (sets sorted), a deep copy: later folding does not change
        it. `restore` gives back an equal state."""
        return orjson.loads(_dumps(self._view()))

    def _view(self) -> dict:
        """The snapshot's content, sharing the state's own containers (read it, don't keep it)."""
        return {
            "snapshot_version": SNAPSHOT_VERSION, "run_id": self.run_id,
            "category": self.category, "policy": self.policy.to_dict(),
            "n_events": self.n_events, "last_seq": self.last_seq, "first_ts": self.first_ts,
            "last_ts": self.last_ts, "kind_counts": self.kind_counts,
            "events_by_agent": self.events_by_agent, "turns_by_agent": self.turns_by_agent,
            "last_agent": self.last_agent, "tool_calls": [c.to_list() for c in self.tool_calls],
            "open_calls": list(self.open_calls), "calls_by_tool": self.calls_by_tool,
            "calls_by_agent": self.calls_by_agent, "errors": self.errors,
            "max_error_streak": self.max_error_streak, "orphan_results": self.orphan_results,
            "handoffs": self.handoffs, "termination": self.termination,
            "final_answer": self.final_answer, "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens, "cached_tokens": self.cached_tokens,
            "cost_usd": self.cost_usd, "tokens_by_model": self.tokens_by_model,
            "usage_ids": sorted(self.usage_ids), "usage_repeats": self.usage_repeats,
            "result_ids_seen": sorted(self.result_ids_seen), "content_chars": self.content_chars,
            "last_ref": None if self.last_ref is None else list(self.last_ref), "detectors": self.det.snapshot(),
        }

    @classmethod
    def restore(cls, snap: dict) -> RunState:
        if snap.get("snapshot_version") != SNAPSHOT_VERSION:
            raise ValueError(f"snapshot_version {snap.get('snapshot_version')!r} is not "
                             f"{SNAPSHOT_VERSION}")
        snap = orjson.loads(orjson.dumps(snap))  # a private copy
        policy = Policy.from_dict(snap["policy"])
        s = cls(snap["run_id"], category=snap["category"], policy=policy)
        for k in ("n_events", "last_seq", "first_ts", "last_ts", "kind_counts", "events_by_agent",
                  "turns_by_agent", "last_agent", "calls_by_tool", "calls_by_agent", "errors",
                  "max_error_streak", "orphan_results", "handoffs", "termination", "final_answer",
                  "input_tokens", "output_tokens", "cached_tokens", "cost_usd", "tokens_by_model",
                  "usage_repeats", "content_chars", "last_ref"):
            setattr(s, k, snap[k])
        s.tool_calls = [ToolCall(*c) for c in snap["tool_calls"]]
        by_id = {c.event_id: c for c in s.tool_calls}
        s.open_calls = {eid: by_id[eid] for eid in snap["open_calls"]}
        s.usage_ids = set(snap["usage_ids"])
        s.result_ids_seen = set(snap["result_ids_seen"])
        s.det = Detectors.restore(snap["detectors"], policy)
        s.last_ref = None if s.last_ref is None else tuple(s.last_ref)
        return s

    def state_hash(self) -> str:
        return _sha256(_dumps(self._view(), option=_SORT)).hexdigest()


# --------------------------------------------------------------------------- the fold

def _args_hash(args: dict | None) -> str | None:
    if args is None:
        return None
    return _sha256(_dumps(args, option=_SORT)).hexdigest()[:16]


def _on_tool_call(s: RunState, ev: Event, pos: int) -> None:
    p = ev.payload
    tool = p["tool"]
    call = ToolCall(ev.event_id, pos, ev.agent, tool, arguments=p.get("arguments"))
    s.tool_calls.append(call)
    s.open_calls[ev.event_id] = call
    s.calls_by_tool[tool] = s.calls_by_tool.get(tool, 0) + 1
    s.calls_by_agent[ev.agent] = s.calls_by_agent.get(ev.agent, 0) + 1
    s.det.on_tool_call(ev, pos, s.category)


def _match_call(s: RunState, ev: Event, tool: str | None) -> ToolCall | None:
    """The call a result answers: by parent_id, else the latest open call (of the same tool)."""
    oc = s.open_calls
    if ev.parent_id is not None:
        return oc.pop(ev.parent_id, None)
    if not oc:
        return None
    for i, eid in enumerate(reversed(oc)):
        if i >= 8:
            break
        if tool is None or oc[eid].tool == tool:
            return oc.pop(eid)
    return None


def _on_tool_result(s: RunState, ev: Event, pos: int) -> None:
    p = ev.payload
    call = _match_call(s, ev, p.get("tool"))
    tool = p.get("tool") or (call.tool if call is not None else None)
    if call is None:
        s.orphan_results += 1
        call_eid = call_pos = None
    else:
        call_eid, call_pos = call.event_id, call.pos
        call.result_event_id, call.result_pos = ev.event_id, pos
    err = p.get("error")
    ids = p.get("result_ids")
    if err is not None:
        s.errors += 1
        if call is not None:
            retry = p.get("retryable")
            if retry is None:
                retry = s.det.retryable(err)
            call.outcome = "retryable_error" if retry else "error"
            call.error, call.result_ids = err, ids
        s.det.on_error_result(call_eid, call_pos, ev.event_id, pos, tool, ev.agent, err)
        if len(s.det.streak) > s.max_error_streak:
            s.max_error_streak = len(s.det.streak)
        return
    if ids is None:
        n_new = None
        outcome = "unknown"
    else:
        seen = s.result_ids_seen
        n_new = 0
        for r in ids:
            if r not in seen:
                seen.add(r)
                n_new += 1
        outcome = "ok" if ids else "empty"
    if call is not None:
        call.outcome, call.result_ids = outcome, ids
    s.det.on_tool_result(call_eid, call_pos, ev.event_id, pos, tool, ids, n_new, ev.agent)


def _on_error(s: RunState, ev: Event, pos: int) -> None:
    p = ev.payload
    s.errors += 1
    if ev.parent_id is not None:
        call = s.open_calls.pop(ev.parent_id, None)
        if call is not None:
            retry = p.get("retryable")
            if retry is None:
                retry = s.det.retryable(p["error"])
            call.outcome = "retryable_error" if retry else "error"   # as for an errored result
            call.error = p["error"]
            call.result_event_id, call.result_pos = ev.event_id, pos
    s.det.on_failure(ev.event_id, pos, ev.agent, p["error"])
    s.det.cycle_win.clear()
    s.det.cycle_fired = False
    if len(s.det.streak) > s.max_error_streak:
        s.max_error_streak = len(s.det.streak)


def _on_handoff(s: RunState, ev: Event, pos: int) -> None:
    s.handoffs.append([ev.event_id, pos, ev.agent, ev.payload["to"]])


def _on_final_answer(s: RunState, ev: Event, pos: int) -> None:
    s.final_answer = ev.payload["content"]
    s.det.on_success()


def _on_termination(s: RunState, ev: Event, pos: int) -> None:
    p = ev.payload
    s.termination = p["reason"]
    fa = p.get("final_answer")
    if fa is not None:
        s.final_answer = fa
    answered = bool(s.final_answer and s.final_answer.strip())
    prev = s.last_ref
    s.det.on_termination(ev, pos, prev, answered)


_HANDLERS = {"tool_call": _on_tool_call, "tool_result": _on_tool_result, "error": _on_error,
             "handoff": _on_handoff, "final_answer": _on_final_answer,
             "termination": _on_termination}


def _on_usage(s: RunState, ev: Event, pos: int) -> None:
    u = ev.usage
    g = u.get
    uid = g("id")
    if uid is not None:
        ids = s.usage_ids
        if uid in ids:
            s.usage_repeats += 1
            return
        ids.add(uid)
    i = g("input_tokens") or 0
    o = g("output_tokens") or 0
    s.input_tokens += i
    s.output_tokens += o
    model = g("model")
    if model is not None:
        tm = s.tokens_by_model
        tm[model] = tm.get(model, 0) + i + o
    if "cached_tokens" in u or "cost_usd" in u:      # the rarer fields
        ct = g("cached_tokens")
        if ct:
            s.cached_tokens += ct
        c = g("cost_usd")
        if c:
            s.cost_usd += c
            b = s.policy.budget.max_cost_usd
            if b is not None:
                s.det.check_budget("cost_usd", round(s.cost_usd, 6), b, ev.event_id, pos)
    b = s.max_tokens
    if s.input_tokens + s.output_tokens > b:
        s.det.check_budget("tokens", s.input_tokens + s.output_tokens, b, ev.event_id, pos)


def fold(state: RunState, ev: Event) -> RunState:
    """Fold one event into the state (in place) and return it. O(1) in the run's length."""
    if ev.run_id != state.run_id:
        raise ValueError(f"event {ev.event_id!r} belongs to run {ev.run_id!r}, not {state.run_id!r}")
    pos = state.n_events
    state.n_events = pos + 1
    seq = ev.seq
    if seq is not None:
        state.last_seq = seq
    kind = ev.kind
    kc = state.kind_counts
    kc[kind] = kc.get(kind, 0) + 1
    ts = ev.ts
    if ts is not None:
        if state.first_ts is None:
            state.first_ts = ts
        state.last_ts = ts
    c = ev.payload.get("content")
    if c is not None:
        state.content_chars += len(c)
    if ev.usage is not None:
        _on_usage(state, ev, pos)
    h = _HANDLERS.get(kind)
    if kind != "termination":
        agent = ev.agent
        ea = state.events_by_agent
        ea[agent] = ea.get(agent, 0) + 1
        if agent != state.last_agent:
            ta = state.turns_by_agent
            ta[agent] = ta.get(agent, 0) + 1
            state.last_agent = agent
        if h is not None:
            h(state, ev, pos)
        state.last_ref = (ev.event_id, pos)
        if pos >= state.max_events:
            state.det.check_budget("events", pos + 1, state.max_events, ev.event_id, pos)
    else:
        # the run's end is not activity: it never trips the events budget (a trajectory's
        # synthetic termination sits one past the last step, so such a finding would blame none)
        h(state, ev, pos)
    return state


def fold_events(events: Iterable[Event], state: RunState | None = None, *,
                run_id: str | None = None, policy: Policy | None = None,
                category: str | None = None) -> RunState:
    """Fold a stream of one run's events (all at once, or continuing `state`)."""
    for ev in events:
        if state is None:
            state = RunState(run_id or ev.run_id, category=category, policy=policy)
        fold(state, ev)
    if state is None:
        state = RunState(run_id or "<empty>", category=category, policy=policy)
    return state


# --------------------------------------------------------------------------- trajectories

class TrajectoryFolder:
    """Folds a trajectory one step at a time; the findings visible at prefix t cost O(1) per step.

    The synthetic termination event (from `traj.termination` / `traj.final_answer`) is folded
    together with the last step, so it is visible from prefix N-1 on; every finding's evidence
    includes a real step, so `finding.first_step` is always a step index of the trajectory.
    """

    def __init__(self, traj: Trajectory, policy: Policy | None = None):
        self.traj = traj
        self.events = trajectory_to_events(traj)
        self.state = RunState(traj.id, category=traj.domain, policy=policy)
        self.t = -1                      # last step folded
        self._n_steps = len(traj.steps)
        self._first_alarm: Finding | None = None
        self._visible_upto: list[int] = []   # number of findings visible after step t

    def advance(self) -> list[Finding]:
        """Fold step t+1 (and, at the last step, the termination); return the new findings."""
        if self.t + 1 >= self._n_steps:
            raise IndexError(f"trajectory {self.traj.id!r} has only {self._n_steps} steps")
        self.t += 1
        before = len(self.state.findings)
        fold(self.state, self.events[self.t])
        if self.t == self._n_steps - 1:
            for ev in self.events[self._n_steps:]:
                fold(self.state, ev)
        new = self.state.findings[before:]
        if self._first_alarm is None:
            for f in new:
                if f.alarm:
                    self._first_alarm = f
                    break
        self._visible_upto.append(len(self.state.findings))
        return new

    def advance_to(self, t: int) -> None:
        while self.t < t:
            self.advance()

    def visible(self, t: int | None = None) -> list[Finding]:
        """Findings visible at prefix t (default: the last folded step)."""
        t = self.t if t is None else t
        self.advance_to(t)
        return self.state.findings[: self._visible_upto[t]]

    def first_alarm(self, t: int | None = None) -> Finding | None:
        """The first alarm-raising finding visible at prefix t, or None."""
        t = self.t if t is None else t
        self.advance_to(t)
        f = self._first_alarm
        if f is None:
            return None
        return f if min(f.seen_at, self._n_steps - 1) <= t else None


def fold_trajectory(traj: Trajectory, policy: Policy | None = None) -> TrajectoryFolder:
    """Fold a whole trajectory; query `visible(t)` / `first_alarm(t)` for any prefix."""
    tf = TrajectoryFolder(traj, policy)
    tf.advance_to(len(traj.steps) - 1)
    return tf


# --------------------------------------------------------------------------- ledgers

class Folder:
    """Ledger + fold for many runs: `ingest(event)` admits it (dedupe, order) and folds it."""

    def __init__(self, policy: Policy | None = None, *, ledger: Ledger | None = None,
                 category: str | None = None, run: str | None = None):
        self.policy = policy or default_policy()
        self.ledger = ledger if ledger is not None else Ledger()
        self.category = category
        self.run = run
        self.states: dict[str, RunState] = {}

    def state(self, run_id: str) -> RunState:
        s = self.states.get(run_id)
        if s is None:
            cat = self.category
            s = self.states[run_id] = RunState(run_id, category=cat, policy=self.policy)
        return s

    def ingest(self, ev: Event) -> bool:
        """True if the event was folded: new, or stored but not yet folded into its run's state
        (a folder resuming over a ledger it did not write this session); False for a duplicate."""
        if not self.ledger.append(ev) and not self._unfolded_duplicate(ev):
            return False
        run = ev.run_id
        s = self.states.get(run)
        if s is None:
            s = self.state(run)
        if s.category is None:
            _take_category(s, ev)
        fold(s, ev)
        return True

    def _unfolded_duplicate(self, ev: Event) -> bool:
        """An identical duplicate the ledger holds under a seq above its run's folded state: it
        is folded under that seq, so resuming over a stored ledger never skips it."""
        seq = self.ledger.stored_seq(ev.event_id)
        s = self.states.get(ev.run_id)
        if seq is None or seq <= (s.last_seq if s is not None else -1):
            return False
        ev.seq = seq
        return True

    def catch_up(self) -> int:
        """Fold what a stored ledger (database or JSONL) holds beyond each run's state (after a
        restart, or after restoring snapshots into `self.states`): resumes every run from its
        last seq. Returns the number of events folded."""
        iter_stored = getattr(self.ledger, "iter_stored", None)
        if iter_stored is not None:         # a JSONL ledger: one pass over the file
            n = 0
            states = self.states
            for ev in iter_stored(lambda run: states[run].last_seq if run in states else -1):
                s = self.state(ev.run_id)
                if s.category is None:
                    _take_category(s, ev)
                fold(s, ev)
                n += 1
            return n
        iter_run = getattr(self.ledger, "iter_run", None)
        if iter_run is None:
            raise TypeError(f"{type(self.ledger).__name__} holds no stored events to replay; use ingest_file")
        n = 0
        for run in self.ledger.runs():
            s = self.state(run)
            for ev in iter_run(run, s.last_seq):
                if s.category is None:
                    _take_category(s, ev)
                fold(s, ev)
                n += 1
        return n

    def ingest_file(self, path, offset: int = 0, *, first_line: int = 1,
                    report: IngestReport | None = None) -> IngestReport:
        """Read a JSONL ledger from byte `offset`, fold every valid record, report every bad one
        (file, line, field). `report.next_offset` / `next_line` say where to resume; an
        unfinished last line (no newline, not valid JSON) is left for that later read
        (`report.pending_bytes`), never rejected in halves.

        The cyclic garbage collector is paused while the file is read: the fold creates no
        reference cycles (reference counting frees everything), and GC passes over the growing
        run state cost about a fifth of the ingest time (benchmarks/fold_throughput.py)."""
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._ingest_file(path, offset, first_line, report)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _ingest_file(self, path, offset: int, first_line: int,
                     report: IngestReport | None) -> IngestReport:
        report = report if report is not None else IngestReport()
        src = str(path)
        report.source = src
        run = self.run
        ledger = self.ledger
        append = ledger.admit if type(ledger) is Ledger else ledger.append
        states = self.states
        loads, JSONError = orjson.loads, orjson.JSONDecodeError
        n_rec = n_app = n_dup = n_filt = pending = 0
        line = first_line - 1
        with open(path, "rb") as fh:
            fh.seek(offset)
            for raw in fh:
                line += 1
                offset += len(raw)
                n_rec += 1
                try:
                    try:
                        ev = parse_event(loads(raw))
                    except JSONError:
                        if not raw.strip():     # a blank line is not a record
                            n_rec -= 1
                            continue
                        if not raw.endswith(b"\n"):   # torn: a writer is mid-append
                            n_rec -= 1
                            line -= 1
                            offset -= len(raw)
                            pending = len(raw)
                            break
                        decode_line(raw)   # raises the EventError that names the problem
                        raise
                    if run is not None and ev.run_id != run:
                        n_filt += 1
                        continue
                    if not append(ev) and not self._unfolded_duplicate(ev):
                        n_dup += 1
                        continue
                except EventError as e:
                    report.reject(e.located(src, line))
                    continue
                s = states.get(ev.run_id)
                if s is None:
                    s = self.state(ev.run_id)
                if s.category is None:      # _take_category, inlined on the hot path
                    cat = ev.meta.get("category")
                    if type(cat) is str:
                        s.category = cat
                fold(s, ev)
                n_app += 1
        report.n_records += n_rec
        report.n_appended += n_app
        report.n_duplicates += n_dup
        report.n_filtered += n_filt
        report.next_offset, report.next_line, report.pending_bytes = offset, line + 1, pending
        return report


def _take_category(s: RunState, ev: Event) -> None:
    """A run without a category (none given to the Folder) takes the first `meta.category` one
    of its events carries: the same rule for live ingest, file ingest and database catch-up."""
    cat = ev.meta.get("category")
    if isinstance(cat, str):
        s.category = cat


def fold_file(path, *, run: str | None = None, policy: Policy | None = None,
              category: str | None = None) -> tuple[Folder, IngestReport]:
    """Fold a JSONL ledger file: (folder with one RunState per run, ingest report)."""
    f = Folder(policy, category=category, run=run)
    return f, f.ingest_file(path)


__all__ = ["RunState", "ToolCall", "fold", "fold_events", "TrajectoryFolder", "fold_trajectory",
           "Folder", "fold_file", "is_synthetic"]
