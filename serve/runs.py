"""A run's state in the gateway: `Run` (its fold state, steps and lock), the events that reach
it (`parse_body`, `parse_batch`: every check that can refuse an event, before anything is
stored), folding them (`fold_new`, `catch_up` from the ledger), the run as a `Trajectory`, and
`RunCache`, the bounded cache of runs.

    cache = RunCache(cfg.limits, metrics, on_drop=lambda r: ...)
    events = parse_batch(run_id, body, key, max_events=cfg.limits.max_events_per_batch)

Run state is a bounded cache: at most `limits.max_cached_runs` runs and
`limits.max_cached_bytes` of step content, idle runs evicted after `limits.run_idle_s`; an
evicted run is rebuilt from the ledger when it is next used. A run whose ledger holds an event
this version cannot fold (written by an older one) answers 409 naming that event, every time.
Steps and events: seq 0 of every run is its `run_started` event; step t is the t-th
non-synthetic event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict

import orjson

from aftraj.events import EventError, check_foldable, event_to_step, is_synthetic, parse_event
from aftraj.fold import RunState, fold
from aftraj.prompt import PrefixCache
from aftraj.schema import Label, SchemaError, Trajectory
from serve.errors import GatewayError

log = logging.getLogger("aftraj.gateway")

STEP_OVERHEAD = 400        # bytes a folded step costs beyond its strings (the cache's estimate)


class Run:
    __slots__ = ("key", "run_id", "owner", "task", "agents", "category", "state", "steps", "step_at", "lock",
                 "subscribers", "used", "size", "counted", "broken", "prompts", "traj", "agents_seen",
                 "alarm_stored")

    def __init__(self, key, run_id, owner, task, agents, category, policy):
        self.key, self.run_id, self.owner, self.task = key, run_id, owner, task
        self.agents, self.category = agents, category
        self.state = RunState(key, category=category, policy=policy)
        self.steps: list = []
        self.step_at: list[int | None] = []    # fold position -> step index (None: synthetic)
        self.lock = asyncio.Lock()
        self.subscribers: set[asyncio.Queue] = set()
        self.used = time.monotonic()
        self.size = len(task) + STEP_OVERHEAD      # estimated bytes held (grows on the threads)
        self.counted = 0                           # of which the cache's total holds (the loop's)
        self.broken: GatewayError | None = None
        self.prompts = PrefixCache()               # what rendering the last prefix learnt (under the lock)
        self.traj: Trajectory | None = None        # the first validated Trajectory (its fixed fields)
        self.agents_seen: set[str] | None = None   # agents in aftraj_run_agents (None: not read yet)
        self.alarm_stored = False                  # an ALARM of this run is in aftraj_alarms


# --------------------------------------------------------------------------- events in

def parse_body(body: bytes) -> list:
    """The POST body (bytes) -> its list of events; 422 naming what is wrong."""
    try:
        d = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise GatewayError(422, f"body: not valid JSON (NaN, Infinity and lone surrogates are not JSON): {e}"
                           ) from None
    if type(d) is not dict:
        raise GatewayError(422, "body: must be an object {\"events\": [...]}")
    extra = sorted(k for k in d if k != "events")
    if extra:
        raise GatewayError(422, f"{extra[0]}: extra inputs are not permitted", field=extra[0])
    items = d.get("events")
    if type(items) is not list or not items:
        raise GatewayError(422, "events: must be a non-empty list of event objects", field="events")
    return items


def _scoped(i: int, d, run_id: str, key: str, eid):
    """Event `d` of the batch with its run id the storage key (422 for another run's id)."""
    if isinstance(d, dict):
        if "run_id" not in d or d["run_id"] == run_id:
            return {**d, "run_id": key}
        if d["run_id"] != key:
            raise GatewayError(422, f"event {i} ({eid}): run_id: {d['run_id']!r}"[:300]
                               + f" is not this run ({run_id!r})", event_index=i, event_id=eid, field="run_id")
    return d


def parse_batch(run_id: str, items: list | bytes, key: str | None = None, checked: dict | None = None,
                start: int = 0, *, max_events: int) -> list:
    """Validate a batch (blocking: runs on the threads): every check that can refuse an
    event runs here, before anything is stored. `checked`, if given, collects each event's
    step as `check_foldable` built it at step index `start + i` (where it folds when
    nothing comes in between), for `fold_new`."""
    if isinstance(items, (bytes, bytearray, memoryview)):
        items = parse_body(bytes(items))
    if len(items) > max_events:
        raise GatewayError(413, f"batch of {len(items)} events is over the limit of {max_events}", field="events")
    key = key or run_id
    events = []
    for i, d in enumerate(items):
        eid = d.get("event_id") if isinstance(d, dict) else None
        eid = eid if isinstance(eid, str) and len(eid) <= 512 else None
        d = _scoped(i, d, run_id, key, eid)
        try:
            ev = parse_event(d)
            step = check_foldable(ev, start + len(events), key)
        except EventError as e:
            raise GatewayError(422, f"event {i} ({eid or 'no event_id'}): {e.field}: {e.message}",
                               event_index=i, event_id=eid, field=e.field) from None
        if ev.seq == 0 or is_synthetic(ev):
            raise GatewayError(422, f"event {i} ({eid}): seq 0 and synthetic events are the gateway's "
                                    f"(run_started); a run's events take seq >= 1",
                               event_index=i, event_id=eid, field="seq" if ev.seq == 0 else "meta")
        if checked is not None:
            checked[(id(ev), start + len(events), ev.seq)] = step   # the ledger may assign a seq
        events.append(ev)
    return events


# --------------------------------------------------------------------------- folding

class _Unfoldable(Exception):
    def __init__(self, seq, event_id, err):
        self.seq, self.event_id, self.err = seq, event_id, err


def _grow(r: Run, steps) -> None:
    r.size += sum(len(s.content) + len(s.agent) + STEP_OVERHEAD for s in steps)


def fold_new(r: Run, events, checked: dict | None = None) -> None:
    """Fold `events` onto the run. `checked`: {(id(event), index, seq): step} that
    `check_foldable` built at parse time, reused where the step index and the event's seq
    (the ledger assigns a missing one) are those it was built with."""
    new = []
    for ev in events:
        fold(r.state, ev)
        r.step_at.append(len(r.steps))
        step = checked.get((id(ev), len(r.steps), ev.seq)) if checked else None
        if step is None:
            step = event_to_step(ev, len(r.steps), r.key)
        r.steps.append(step)
        new.append(step)
    _grow(r, new)


def _fold_stored(r: Run, rows, new: list) -> None:
    for seq, eid, rec in rows:
        try:
            ev = parse_event(orjson.loads(rec))
            step = None if is_synthetic(ev) else event_to_step(ev, len(r.steps), r.key)
            fold(r.state, ev)
        except (SchemaError, ValueError, TypeError, KeyError, IndexError) as e:
            raise _Unfoldable(seq, eid, e) from None
        if step is None:
            r.step_at.append(None)
        else:
            r.step_at.append(len(r.steps))
            r.steps.append(step)
            new.append(step)


def catch_up(r: Run, store) -> None:
    """Fold what the ledger holds beyond the run's state (events any process stored).
    Blocking. An event the fold cannot take marks the run broken, naming the event."""
    if r.broken is not None:
        raise r.broken
    new: list = []
    try:
        with store.ledger.reader.connect() as conn:
            _fold_stored(r, conn.execute(store.events_after(r.key, r.state.last_seq)), new)
    except _Unfoldable as u:
        field = getattr(u.err, "field", None)
        msg = getattr(u.err, "message", None) or f"{type(u.err).__name__}: {u.err}"
        r.broken = GatewayError(
            409, f"run_unreadable: run {r.run_id!r} holds event {u.event_id!r} (seq {u.seq}) that this "
                 f"gateway cannot fold ({field + ': ' if field else ''}{msg[:300]}); its events are kept in "
                 f"the ledger, the run cannot be audited further", event_id=u.event_id, field=field)
        log.error("run %s: %s", r.key, r.broken.detail)
        _grow(r, new)
        raise r.broken from None
    _grow(r, new)


_TRAJ_FIELDS = tuple(f.name for f in dataclasses.fields(Trajectory) if f.name != "steps")


def trajectory(r: Run, *, as_id: str | None = None) -> Trajectory:
    """The run so far as a Trajectory. The first one is built (and validated) by the
    schema's constructor; later ones copy its fields with the longer steps tuple and skip
    the per-step re-validation (O(run length) a request): the gateway's steps are built by
    `event_to_step` with contiguous indices, so the checks it skips always hold. `as_id`: one
    copy under another id (the in-process auditor's view: serve.auditing)."""
    base = r.traj
    if base is None or not r.steps:
        traj = Trajectory(id=r.run_id, family_id=r.run_id,
                          domain=r.category if r.category in ("math", "coding", "agentic") else "external",
                          source="gateway", task=r.task, steps=tuple(r.steps),
                          label=Label("SAFE", "external"))
        r.traj = traj
        if as_id is None:
            return traj
        base = traj
    traj = object.__new__(Trajectory)
    for f in _TRAJ_FIELDS:
        object.__setattr__(traj, f, getattr(base, f))
    object.__setattr__(traj, "steps", tuple(r.steps))
    if as_id is not None:
        object.__setattr__(traj, "id", as_id)
    return traj


# --------------------------------------------------------------------------- the bounded cache

class RunCache:
    """Runs by storage key, least recently used first, within `limits.max_cached_runs` runs and
    `limits.max_cached_bytes` of their steps; `on_drop(run)` is told of every run that leaves."""

    def __init__(self, limits, metrics, on_drop=None):
        self.lim, self.metrics, self.on_drop = limits, metrics, on_drop
        self.runs: OrderedDict[str, Run] = OrderedDict()
        self.cached_bytes = 0

    def cache(self, r: Run) -> Run:
        have = self.runs.get(r.key)
        if have is not None:          # loaded twice at once: the first one stays
            return have
        self.runs[r.key] = r
        self.resize(r)
        self.sweep()
        return r

    def use(self, r: Run) -> None:
        r.used = time.monotonic()
        if r.key in self.runs:
            self.runs.move_to_end(r.key)

    def resize(self, r: Run) -> None:
        if self.runs.get(r.key) is r:
            self.cached_bytes += r.size - r.counted
            r.counted = r.size

    def drop(self, r: Run) -> None:
        if self.runs.get(r.key) is r:
            del self.runs[r.key]
            self.cached_bytes -= r.counted
            r.counted = 0
            if self.on_drop is not None:
                self.on_drop(r)

    def sweep(self) -> None:
        """Evict least recently used runs past the cache's bounds, and idle ones (never a run
        with a request or a stream on it)."""
        lim = self.lim
        now = time.monotonic()
        for key in list(self.runs):
            r = self.runs[key]
            over = len(self.runs) > lim.max_cached_runs or self.cached_bytes > lim.max_cached_bytes
            if not over and now - r.used < lim.run_idle_s:
                break
            if r.lock.locked() or r.subscribers:
                continue
            self.drop(r)
            self.metrics.inc("aftraj_gateway_runs_evicted_total")


__all__ = ["Run", "RunCache", "catch_up", "fold_new", "parse_batch", "parse_body", "trajectory"]
