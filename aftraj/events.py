"""Typed run events (the ledger's records) and the lossless mapping between events and steps.

An event is one thing that happened in a run: a message, a thinking trace, a tool call, its
result, a handoff, an error, the final answer, or the termination. On the wire (JSON Lines, the
gateway's POST body) it is one object:

    {"event_id": "r1/7", "seq": 7, "run_id": "r1", "kind": "tool_result", "agent": "search_agent",
     "parent_id": "r1/6", "ts": 1700000000.5,
     "payload": {"content": "…", "tool": "search", "result_ids": ["d1", "d2"]},
     "usage": {"input_tokens": 812, "output_tokens": 40, "model": "qwen2.5-7b", "id": "resp-9"},
     "meta": {}}

`parent_id` links a tool result (or an error) to the call it answers. `fingerprint` (sha256 of the
canonical payload) is computed once on ingest; a record may carry one, and then it must match.
`parse_event(record)` validates without dataclass machinery (it is on the ledger's hot path) and
raises `EventError` naming the field.

Steps <-> events: `steps_to_events` / `events_to_steps` are exact inverses. Event kinds that are
not step kinds map onto the schema's kinds (thinking/handoff/error -> message, termination ->
system), with what a step cannot hold kept under `meta["aftraj_event"]`; a step kind with no
event kind of its own (system) is kept under the event's `meta["aftraj_step_kind"]`.

    python -c "from aftraj.events import trajectory_to_events; help(trajectory_to_events)"
"""

from __future__ import annotations

import hashlib
from math import isfinite as _isfinite
from itertools import repeat as _repeat
from collections.abc import Iterable
from typing import Any

import orjson

from aftraj.schema import MAX_FIELD_CHARS, TERMINATIONS, SchemaError, Step, Trajectory

EVENT_KINDS = ("message", "thinking", "tool_call", "tool_result", "handoff", "error",
               "final_answer", "termination")
RECORD_FIELDS = ("event_id", "seq", "run_id", "kind", "agent", "parent_id", "ts", "payload",
                 "usage", "meta", "fingerprint")
USAGE_FIELDS = ("input_tokens", "output_tokens", "cached_tokens", "model", "id", "cost_usd")

# Payload keys per kind: (required, allowed). Optional keys set to null are dropped on ingest,
# so `{"error": null}` and no `error` key are the same event (and the same fingerprint).
PAYLOAD_KEYS: dict[str, tuple[frozenset, frozenset]] = {
    "message": (frozenset({"content"}), frozenset({"content"})),
    "thinking": (frozenset({"content"}), frozenset({"content"})),
    "final_answer": (frozenset({"content"}), frozenset({"content"})),
    "tool_call": (frozenset({"content", "tool"}), frozenset({"content", "tool", "arguments"})),
    "tool_result": (frozenset({"content"}),
                    frozenset({"content", "tool", "result_ids", "error", "retryable"})),
    "handoff": (frozenset({"content", "to"}), frozenset({"content", "to"})),
    "error": (frozenset({"content", "error"}),
              frozenset({"content", "error", "tool", "retryable"})),
    "termination": (frozenset({"reason"}), frozenset({"reason", "final_answer", "content"})),
}

# Default kind mappings (see the module docstring for the exceptions kept in meta).
EVENT_TO_STEP_KIND = {"message": "message", "thinking": "message", "tool_call": "tool_call",
                      "tool_result": "tool_result", "handoff": "message", "error": "message",
                      "final_answer": "final_answer", "termination": "system"}
STEP_TO_EVENT_KIND = {"message": "message", "tool_call": "tool_call",
                      "tool_result": "tool_result", "final_answer": "final_answer",
                      "system": "message"}

_STEP_PAYLOAD = ("content", "tool", "arguments", "result_ids", "error")
_META_EVENT = "aftraj_event"          # on a step: event fields a step cannot hold
_META_STEP_KIND = "aftraj_step_kind"  # on an event: the step kind, when not the default
_META_GENERATED = "aftraj_generated_id"  # on an event: the step had no event_id
_META_SYNTHETIC = "aftraj_synthetic"  # on an event: made from trajectory fields, not a step

_RESERVED_META = frozenset({_META_EVENT, _META_STEP_KIND, _META_GENERATED, _META_SYNTHETIC})

_MAX_SEQ = 1 << 63
MAX_NAME_CHARS = 512   # ids, agent, tool, handoff target, usage model/id
_MAX_TOKENS = 10**12   # per usage record; run totals then stay far inside JSON's 64-bit integers
_TOP = frozenset(RECORD_FIELDS)
_CONTENT_ONLY = frozenset({"message", "thinking", "final_answer"})
_RESULT_KEYS = PAYLOAD_KEYS["tool_result"][1]
_CALL_KEYS = PAYLOAD_KEYS["tool_call"][1]
_USAGE = frozenset(USAGE_FIELDS)
_USAGE_FAST = frozenset({"input_tokens", "output_tokens", "model", "id"})
_KINDS = frozenset(EVENT_KINDS)
_TERMS = frozenset(TERMINATIONS)
_dumps = orjson.dumps
_SORT = orjson.OPT_SORT_KEYS
_sha256 = hashlib.sha256


class EventError(SchemaError):
    """A record that is not a valid event; names the field (and, from a reader, file and line)."""

    def located(self, source: str | None, line: int | None) -> EventError:
        return EventError(self.message, field=self.field, source=source, line=line)


def _bad(field: str, msg: str):
    raise EventError(msg, field=field)


def fingerprint(payload: dict) -> str:
    """sha256 of the canonical (key-sorted) JSON payload."""
    return _sha256(_dumps(payload, option=_SORT)).hexdigest()


class Event:
    """One validated event. Plain slots, no per-field validation here: build with `parse_event`."""

    __slots__ = ("event_id", "seq", "run_id", "kind", "agent", "parent_id", "ts", "payload",
                 "usage", "meta", "fingerprint")

    def __init__(self, event_id: str, seq: int | None, run_id: str, kind: str, agent: str,
                 parent_id: str | None, ts: Any, payload: dict, usage: dict | None,
                 meta: dict, fp: str):
        self.event_id = event_id
        self.seq = seq
        self.run_id = run_id
        self.kind = kind
        self.agent = agent
        self.parent_id = parent_id
        self.ts = ts
        self.payload = payload
        self.usage = usage
        self.meta = meta
        self.fingerprint = fp

    def to_record(self) -> dict:
        """The wire form (what `parse_event` reads back to an equal event)."""
        d = {"event_id": self.event_id, "seq": self.seq, "run_id": self.run_id,
             "kind": self.kind, "agent": self.agent, "parent_id": self.parent_id, "ts": self.ts,
             "payload": self.payload, "usage": self.usage, "meta": self.meta,
             "fingerprint": self.fingerprint}
        return d

    def dumps(self) -> bytes:
        """The wire form as one JSON line (without newline); EventError if it cannot be
        written (a payload or meta nested deeper than orjson writes)."""
        try:
            return _dumps(self.to_record())
        except TypeError as e:
            raise EventError(f"cannot be written as JSON: {e}", field="<record>") from None

    def __eq__(self, other) -> bool:
        return isinstance(other, Event) and self.to_record() == other.to_record()

    def __repr__(self) -> str:
        return (f"Event({self.event_id!r}, seq={self.seq}, run={self.run_id!r}, {self.kind}, "
                f"agent={self.agent!r})")


def _check_payload(kind: str, p: dict) -> dict:
    req, allowed = PAYLOAD_KEYS[kind]
    keys = p.keys()
    if not keys <= allowed:
        extra = sorted(k for k in keys if k not in allowed)
        _bad(f"payload.{extra[0]}", f"is not a payload field of a {kind} event "
                                    f"(allowed: {', '.join(sorted(allowed))})")
    if None in p.values():
        p = {k: v for k, v in p.items() if v is not None}
        keys = p.keys()
    if not req <= keys:
        missing = sorted(req - keys)
        _bad(f"payload.{missing[0]}", f"is required in a {kind} event")
    c = p.get("content")
    if c is not None and (type(c) is not str or len(c) > MAX_FIELD_CHARS):
        _bad("payload.content", "must be a string" if type(c) is not str else
             f"is {len(c)} characters, over the limit of {MAX_FIELD_CHARS}")
    if len(p) > 1:  # kinds with more than a content field
        v = p.get("tool")
        if v is not None and (type(v) is not str or not v.strip() or len(v) > MAX_NAME_CHARS):
            _bad("payload.tool", f"must be a non-empty string of at most {MAX_NAME_CHARS} characters")
        v = p.get("arguments")
        if v is not None and type(v) is not dict:
            _bad("payload.arguments", f"must be an object, got {type(v).__name__}")
        v = p.get("result_ids")
        if v is not None:
            if type(v) is not list:
                _bad("payload.result_ids",
                     f"must be a list of strings (or null = unknown), got {type(v).__name__}")
            for i, x in enumerate(v):
                if type(x) is not str:
                    _bad(f"payload.result_ids[{i}]", f"must be a string, got {type(x).__name__}")
        v = p.get("error")
        if v is not None and (type(v) is not str or len(v) > MAX_FIELD_CHARS):
            _bad("payload.error", "must be a string")
        v = p.get("retryable")
        if v is not None and type(v) is not bool:
            _bad("payload.retryable", "must be true or false")
        v = p.get("to")
        if v is not None and (type(v) is not str or not v.strip() or len(v) > MAX_NAME_CHARS):
            _bad("payload.to", f"must be a non-empty agent name of at most {MAX_NAME_CHARS} characters")
        v = p.get("reason")
        if v is not None and (type(v) is not str or v not in _TERMS):
            _bad("payload.reason", f"must be one of {', '.join(TERMINATIONS)}; got {v!r}")
        v = p.get("final_answer")
        if v is not None and (type(v) is not str or len(v) > MAX_FIELD_CHARS):
            _bad("payload.final_answer", "must be a string")
    elif kind == "termination":
        if type(p["reason"]) is not str or p["reason"] not in _TERMS:
            _bad("payload.reason", f"must be one of {', '.join(TERMINATIONS)}; got {p['reason']!r}")
    return p


def _check_usage(u: Any) -> dict | None:
    if u is None:
        return None
    if type(u) is not dict:
        _bad("usage", f"must be an object, got {type(u).__name__}")
    if not u.keys() <= _USAGE:
        extra = sorted(k for k in u if k not in _USAGE)
        _bad(f"usage.{extra[0]}", f"is not a usage field (allowed: {', '.join(USAGE_FIELDS)})")
    for k in ("input_tokens", "output_tokens", "cached_tokens"):
        v = u.get(k)
        if v is not None and (type(v) is not int or not 0 <= v < _MAX_TOKENS):
            _bad(f"usage.{k}", f"must be a non-negative integer below {_MAX_TOKENS:.0e}, got {_r(v)}")
    v = u.get("cost_usd")
    if v is not None and (type(v) not in (int, float) or not 0 <= v < 1e12):
        _bad("usage.cost_usd", f"must be a non-negative number, got {v!r}")
    for k in ("model", "id"):
        v = u.get(k)
        if v is not None and (type(v) is not str or len(v) > MAX_NAME_CHARS):
            _bad(f"usage.{k}", f"must be a string of at most {MAX_NAME_CHARS} characters, got {_r(v)}")
    return u


def _diagnose(d: Any) -> dict:
    """The detailed (slow) validation: raises EventError naming the field; returns the payload."""
    if type(d) is not dict:
        _bad("<record>", f"an event must be a JSON object, got {type(d).__name__}")
    if not d.keys() <= _TOP:
        extra = sorted(k for k in d if k not in _TOP)
        _bad(extra[0], f"is not a field of an event (allowed: {', '.join(RECORD_FIELDS)})")
    eid = d.get("event_id")
    if type(eid) is not str or not eid or len(eid) > 512:
        _bad("event_id", "is required: a non-empty string of at most 512 characters")
    run = d.get("run_id")
    if type(run) is not str or not run or len(run) > 512:
        _bad("run_id", "is required: a non-empty string of at most 512 characters")
    kind = d.get("kind")
    if type(kind) is not str or kind not in _KINDS:
        _bad("kind", f"must be one of {', '.join(EVENT_KINDS)}; got {_r(kind)}")
    agent = d.get("agent")
    if type(agent) is not str or not agent.strip() or len(agent) > 512:
        _bad("agent", "is required: a non-empty string of at most 512 characters")
    seq = d.get("seq")
    if seq is not None and (type(seq) is not int or not 0 <= seq < _MAX_SEQ):
        _bad("seq", f"must be a non-negative integer (or absent), got {_r(seq)}")
    parent = d.get("parent_id")
    if parent is not None and (type(parent) is not str or not parent or len(parent) > 512):
        _bad("parent_id", "must be a non-empty string (at most 512 characters) or null")
    ts = d.get("ts")
    if ts is not None and type(ts) not in (int, float, str):
        _bad("ts", f"must be a number (epoch seconds) or an ISO-8601 string, got {type(ts).__name__}")
    if type(ts) is float and not _isfinite(ts):
        _bad("ts", f"must be a finite number, got {ts!r}")
    if type(ts) is str and len(ts) > 64:
        _bad("ts", "is longer than 64 characters")
    payload = d.get("payload")
    if type(payload) is not dict:
        _bad("payload", "is required: an object" if payload is None
             else f"must be an object, got {type(payload).__name__}")
    payload = _check_payload(kind, payload)
    _check_usage(d.get("usage"))
    meta = d.get("meta")
    if meta is not None and type(meta) is not dict:
        _bad("meta", f"must be an object, got {type(meta).__name__}")
    if meta and _META_EVENT in meta:
        _bad(f"meta.{_META_EVENT}", "is reserved (it holds event fields on a step)")
    if meta and _META_STEP_KIND in meta and (type(meta[_META_STEP_KIND]) is not str
                                             or meta[_META_STEP_KIND] not in STEP_TO_EVENT_KIND):
        _bad(f"meta.{_META_STEP_KIND}", f"must be a step kind ({', '.join(sorted(STEP_TO_EVENT_KIND))}), "
                                        f"got {_r(meta[_META_STEP_KIND])}")
    for k in (_META_GENERATED, _META_SYNTHETIC):
        if meta and k in meta and type(meta[k]) is not bool:
            _bad(f"meta.{k}", f"must be true or false, got {_r(meta[k])}")
    given = d.get("fingerprint")
    if given is not None and type(given) is not str:
        _bad("fingerprint", "must be a hex string")
    return payload


def _r(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


_STR = str
_isinstance = isinstance


def _fast_payload(kind: str, p: dict) -> bool:
    """True when the payload is certainly valid and needs no normalising (the common case)."""
    n = len(p)
    c = p.get("content")
    if type(c) is not _STR or len(c) > MAX_FIELD_CHARS:
        return False
    if n == 1:
        return kind in _CONTENT_ONLY
    if kind == "tool_result":
        if not p.keys() <= _RESULT_KEYS:
            return False
        v = p.get("result_ids")
        if v is not None and (type(v) is not list or not all(map(_isinstance, v, _repeat(_STR)))):
            return False
        v = p.get("tool")
        if v is not None and (type(v) is not _STR or not v or v.isspace() or len(v) > 512):
            return False
        v = p.get("error")
        if v is not None and (type(v) is not _STR or len(v) > MAX_FIELD_CHARS):
            return False
        v = p.get("retryable")
        if v is not None and type(v) is not bool:
            return False
        return None not in p.values()
    if kind == "tool_call":
        if not p.keys() <= _CALL_KEYS:
            return False
        v = p.get("tool")
        if type(v) is not _STR or not v or v.isspace() or len(v) > 512:
            return False
        v = p.get("arguments")
        return v is None and "arguments" not in p or type(v) is dict
    return False


def parse_event(d: Any) -> Event:
    """Validate one decoded record and build the Event (fingerprint computed here, once).

    A fast path accepts the common valid shapes with few checks; anything else goes through
    `_diagnose`, which either names the bad field or returns the normalised payload."""
    if type(d) is dict:
        g = d.get
        eid = g("event_id")
        run = g("run_id")
        kind = g("kind")
        agent = g("agent")
        payload = g("payload")
        seq = g("seq")
        parent = g("parent_id")
        ts = g("ts")
        usage = g("usage")
        meta = g("meta")
        if (type(eid) is _STR and type(run) is _STR and type(kind) is _STR
                and type(agent) is _STR and type(payload) is dict
                and 0 < len(eid) <= 512 and 0 < len(run) <= 512 and 0 < len(agent) <= 512
                and kind in _KINDS and not agent.isspace()
                and (type(seq) is int and 0 <= seq < _MAX_SEQ or seq is None)
                and (parent is None or type(parent) is _STR and 0 < len(parent) <= 512)
                and (ts is None or type(ts) is float and _isfinite(ts) or type(ts) is int
                     or type(ts) is _STR and len(ts) <= 64)
                and (meta is None or type(meta) is dict and (not meta or meta.keys().isdisjoint(_RESERVED_META)))
                and d.keys() <= _TOP
                and (type(c := payload.get("content")) is _STR and len(c) <= MAX_FIELD_CHARS
                     and len(payload) == 1 if kind in _CONTENT_ONLY
                     else _fast_payload(kind, payload))):
            if usage is not None:
                # the common usage record: token counts, model, id; anything else: full check
                if type(usage) is dict and usage.keys() <= _USAGE_FAST:
                    ug = usage.get
                    i, o = ug("input_tokens", 0), ug("output_tokens", 0)
                    m, uid = ug("model", ""), ug("id", "")
                    if not (type(i) is int and type(o) is int and 0 <= i < _MAX_TOKENS
                            and 0 <= o < _MAX_TOKENS and type(m) is _STR and type(uid) is _STR
                            and len(m) <= MAX_NAME_CHARS and len(uid) <= MAX_NAME_CHARS):
                        usage = _check_usage(usage)
                else:
                    usage = _check_usage(usage)
            if meta is None:
                meta = {}
            try:
                fp = _sha256(_dumps(payload, option=_SORT)).hexdigest()
            except TypeError as e:      # orjson.JSONEncodeError: nested too deep to write
                _bad_deep(e)
            given = g("fingerprint")
            if given is not None and given != fp:
                _bad_fp(given, fp)
            return Event(eid, seq, run, kind, agent, parent, ts, payload, usage, meta, fp)
    payload = _diagnose(d)
    meta = d.get("meta")
    try:
        fp = _sha256(_dumps(payload, option=_SORT)).hexdigest()
    except TypeError as e:
        _bad_deep(e)
    given = d.get("fingerprint")
    if given is not None and given != fp:
        _bad_fp(given, fp)
    return Event(d["event_id"], d.get("seq"), d["run_id"], d["kind"], d["agent"],
                 d.get("parent_id"), d.get("ts"), payload, _check_usage(d.get("usage")),
                 {} if meta is None else meta, fp)


_ID_FIELDS = ("event_id", "run_id", "agent", "parent_id")


def check_foldable(ev: Event, index: int = 0, run_id: str | None = None) -> Step:
    """Everything a store and the fold will need of `ev`, checked before it is stored (the
    gateway's rule: what is committed always folds). Returns the step it built,
    `event_to_step(ev, index, run_id or ev.run_id)` (a caller that knows where the event will
    fold reuses it instead of building it twice). Raises EventError naming the field:
    a NUL or a lone surrogate in an id or the agent (PostgreSQL and UTF-8 refuse them), meta or
    payload that cannot be written as JSON (a lone surrogate, nesting orjson cannot write), or
    an event the step conversion refuses (meta nested deeper than 32 levels, a non-finite
    number in meta or arguments)."""
    for f in _ID_FIELDS:
        v = getattr(ev, f)
        if v is None:
            continue
        if "\x00" in v:
            _bad(f, "must not contain a NUL character")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            _bad(f, f"is not valid Unicode text (a lone surrogate at character {e.start})")
    for f in ("meta", "payload", "usage"):
        try:
            _dumps(getattr(ev, f))
        except TypeError as e:      # orjson.JSONEncodeError: a surrogate, or nested too deep
            _bad(f, f"cannot be written as JSON: {e}")
    try:
        return event_to_step(ev, index, run_id or ev.run_id)
    except SchemaError as e:
        field = e.field
        if field.startswith("step."):
            field = field[len("step."):]
            if field.startswith(f"meta.{_META_EVENT}."):
                field = field[len(f"meta.{_META_EVENT}."):]
            elif field in ("content", "tool", "arguments", "error") or field.startswith(("arguments", "result_ids")):
                field = "payload." + field
        raise EventError(e.message, field=field) from None


def _bad_deep(e: Exception):
    _bad("payload", f"cannot be written back as JSON ({e})")


def _bad_fp(given: Any, fp: str):
    _bad("fingerprint", f"does not match the payload (given {_r(given)[:20]}, computed {fp[:16]}…)")


def make_event(*, event_id: str, run_id: str, kind: str, agent: str, payload: dict,
               seq: int | None = None, parent_id: str | None = None, ts: Any = None,
               usage: dict | None = None, meta: dict | None = None) -> Event:
    """Build a validated event from Python values (same checks as the wire form)."""
    return parse_event({"event_id": event_id, "seq": seq, "run_id": run_id, "kind": kind,
                        "agent": agent, "parent_id": parent_id, "ts": ts, "payload": payload,
                        "usage": usage, "meta": meta})


# --------------------------------------------------------------------------- steps <-> events

def step_to_event(step: Step, run_id: str) -> Event:
    """One step as one event (exact inverse of `event_to_step`)."""
    meta = dict(step.meta)
    for k in (_META_STEP_KIND, _META_GENERATED, _META_SYNTHETIC):
        if k in meta:
            raise EventError(f"is reserved for events (step {step.index})", field=f"meta.{k}")
    extra = meta.pop(_META_EVENT, None) or {}
    kind = extra.get("kind") or STEP_TO_EVENT_KIND[step.kind]
    ev_meta = dict(meta)
    if EVENT_TO_STEP_KIND[kind] != step.kind:
        ev_meta[_META_STEP_KIND] = step.kind
    eid = step.event_id
    if eid is None:
        eid = f"{run_id}/{step.index}"
        ev_meta[_META_GENERATED] = True
    payload: dict = {} if extra.get("no_content") else {"content": step.content}
    if step.tool is not None:
        payload["tool"] = step.tool
    if step.arguments is not None:
        payload["arguments"] = step.arguments
    if step.result_ids is not None:
        payload["result_ids"] = list(step.result_ids)
    if step.error is not None:
        payload["error"] = step.error
    payload.update(extra.get("payload") or {})
    return make_event(event_id=eid, run_id=extra.get("run_id", run_id), kind=kind,
                      agent=step.agent, payload=payload, seq=extra.get("seq", step.index),
                      parent_id=extra.get("parent_id"), ts=extra.get("ts"),
                      usage=extra.get("usage"), meta=ev_meta)


def event_to_step(ev: Event, index: int, run_id: str | None = None) -> Step:
    """One event as one step; whatever a step cannot hold goes under meta['aftraj_event']."""
    meta = dict(ev.meta)
    step_kind = meta.pop(_META_STEP_KIND, None) or EVENT_TO_STEP_KIND[ev.kind]
    generated = meta.pop(_META_GENERATED, False)
    extra: dict = {}
    if STEP_TO_EVENT_KIND[step_kind] != ev.kind:
        extra["kind"] = ev.kind
    if ev.seq != index:
        extra["seq"] = ev.seq
    if run_id is not None and ev.run_id != run_id:
        extra["run_id"] = ev.run_id
    for k in ("parent_id", "ts", "usage"):
        v = getattr(ev, k)
        if v is not None:
            extra[k] = v
    p = ev.payload
    if "content" not in p:
        extra["no_content"] = True
    rest = {k: v for k, v in p.items() if k not in _STEP_PAYLOAD}
    if rest:
        extra["payload"] = rest
    if extra:
        meta[_META_EVENT] = extra
    rids = p.get("result_ids")
    return Step(index=index, agent=ev.agent, kind=step_kind, content=p.get("content", ""),
                tool=p.get("tool"), arguments=p.get("arguments"),
                result_ids=None if rids is None else tuple(rids), error=p.get("error"),
                event_id=None if generated else ev.event_id, meta=meta)


def steps_to_events(steps: Iterable[Step], run_id: str) -> list[Event]:
    return [step_to_event(s, run_id) for s in steps]


def events_to_steps(events: Iterable[Event], run_id: str | None = None) -> list[Step]:
    return [event_to_step(e, i, run_id) for i, e in enumerate(events)]


def termination_event(traj: Trajectory) -> Event:
    """The run's end as an event, from the trajectory's termination and final_answer fields."""
    payload = {"reason": traj.termination}
    if traj.final_answer is not None:
        payload["final_answer"] = traj.final_answer
    return make_event(event_id=f"{traj.id}/termination", run_id=traj.id, kind="termination",
                      agent="system", payload=payload, seq=len(traj.steps),
                      meta={_META_SYNTHETIC: True})


def trajectory_to_events(traj: Trajectory, *, termination: bool = True) -> list[Event]:
    """Every step as an event, then (unless the last step already is one) a termination event
    carrying `traj.termination` and `traj.final_answer`, marked synthetic in its meta."""
    events = steps_to_events(traj.steps, traj.id)
    if termination and events[-1].kind != "termination":
        events.append(termination_event(traj))
    return events


def is_synthetic(ev: Event) -> bool:
    return bool(ev.meta.get(_META_SYNTHETIC))
