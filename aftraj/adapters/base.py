"""What every framework adapter shares: `RunBuilder` turns a framework's records into our typed
events (aftraj/events.py) one at a time, then into a `Trajectory` through the one steps <-> events
mapping; `AdapterError` names the source file and the field that does not fit; `load_json`.

    from aftraj.adapters.base import RunBuilder
    rb = RunBuilder("run-1", source="smolagents")
    call = rb.tool_call("searcher", "web_search", {"q": "x"}, call_id="call_1")
    rb.tool_result("searcher", "3 hits", tool="web_search", call_id="call_1")
    traj = rb.trajectory(task="…")

What a source does not record stays None (unknown): no invented usage, times or labels. Where it
records them, token usage and start times become the events' `usage` and `ts`. Result ids are the
one exception, because the fold's loop, stall and cycle detectors need them and no framework
records them: a successful tool result gets one id derived from its call (tool and canonical
arguments) and its text (`derived_result_ids`; the event's `meta["result_ids"]` says "derived"),
so the same call answering the same text twice is the same result, and anything new is new.
Framework boilerplate around a tool's error ("Please try again", `strip_boilerplate`) is kept in
the content, not in the error the fold judges. A handoff with no text of its own is rendered as
"handoff to X". Sequence numbers come from one counter (`next_seq`), the termination included, so
an event after the termination (AG2 delivers messages after TERMINATE) still follows it.
The schema requires a label; an imported run carries the placeholder SAFE/`external` label with
`provenance["unlabeled"] = True` (and `meta["unlabeled"] = True`), which no evaluation may read as
a gold verdict.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from aftraj.boundary import UNLABELED
from aftraj.events import Event, EventError, events_to_steps, make_event
from aftraj.schema import SchemaError, Trajectory

class AdapterError(SchemaError):
    """A framework record that cannot be read; names the file (or object) and the field."""


# What frameworks wrap around a tool's error for the model; it says nothing about the error itself
# ("try again" is one of the policy's retryable markers, so left in, every error would read as a
# transient one).
_BOILERPLATE = (
    re.compile(r"\s*Please try again or (?:use another tool|request to another team member)\.?\s*$",
               re.I),                                                              # smolagents
    re.compile(r"\s*Please try again\.?", re.I),                                 # Agents SDK default
    re.compile(r"^\s*An error occurred while running the tool\.?\s*", re.I),    # Agents SDK default
)


def strip_boilerplate(error: str) -> str:
    """A framework's tool error without the advice it adds for the model (see `_BOILERPLATE`)."""
    out = str(error)
    for rx in _BOILERPLATE:
        out = rx.sub(" ", out).strip()
    return out or str(error).strip()


def derived_result_ids(tool: str | None, arguments: Any, text: str) -> list[str]:
    """One result id for a tool result whose framework records none: sha256 of the tool, its
    canonical arguments and the result text (16 hex digits). Equal call and equal text: the same
    id (a repeat); any other result: a new id."""
    canon = json.dumps(arguments, sort_keys=True, default=str, ensure_ascii=False)
    h = hashlib.sha256(f"{tool or ''}\x00{canon}\x00{text}".encode("utf-8", "surrogatepass")).hexdigest()
    return [f"h:{h[:16]}"]


def fail(field: str, msg: str, source: str | None = None):
    raise AdapterError(msg, field=field, source=source)


MAX_SPANS = 200_000        # spans (observations) one file may hold (10^6 spans took 3.9 GB and crashed a reader)


def check_size(path: str | Path, what: str = "a trace export") -> None:
    """Refuse a file over `aftraj.schema.MAX_RECORD_BYTES` before it is parsed (it is parsed whole)."""
    from aftraj.schema import MAX_RECORD_BYTES
    p = Path(path)
    if p.is_file() and p.stat().st_size > MAX_RECORD_BYTES:
        fail("<file>", f"is {p.stat().st_size:,} bytes, over the {MAX_RECORD_BYTES:,} {what} may hold "
                       f"(parsed whole): split it (one trace a file)", str(path))


_OTEL_IDS = re.compile(r"[0-9a-f]{32}/[0-9a-f]{16}")


def span_context(trace_id: Any, span_id: Any) -> dict | None:
    """{"trace_id", "span_id"} in lowercase hex when both are OTel ids (32 and 16 hex digits), else None."""
    if not (isinstance(trace_id, str) and isinstance(span_id, str)):
        return None
    t, s = trace_id.lower(), span_id.lower()
    return {"trace_id": t, "span_id": s} if _OTEL_IDS.fullmatch(f"{t}/{s}") else None


def cycle_error(parent_of: dict, left: list, field_of, what: str, source: str | None):
    """AdapterError naming one span (observation) of a parent cycle, and the cycle itself:
    `left` are the ids no root reaches; `field_of(id)` their field path."""
    start = left[0]
    chain, seen, cur = [], set(), start
    while cur is not None and cur not in seen and len(chain) < 10_000_000:
        seen.add(cur)
        chain.append(cur)
        cur = parent_of.get(cur)
    loop = chain[chain.index(cur):] if cur in seen else chain
    shown = " -> ".join(str(x) for x in loop[:6]) + (" -> …" if len(loop) > 6 else "") + f" -> {loop[0]}"
    fail(field_of(start), f"{len(left)} {what} have parents that form a cycle (or descend from one): "
                          f"{shown}; no root to read them from", source)


def load_json(path: str | Path) -> Any:
    """A JSON document, or JSON Lines (one object a line) when the file is not one document."""
    p = Path(path)
    if not p.is_file():
        raise AdapterError("no such file", field="<file>", source=str(p))
    text = p.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as whole:
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                if n == 1:
                    raise AdapterError(f"invalid JSON: {whole}", field="<file>", source=str(p)) from None
                raise AdapterError(f"invalid JSON on line {n}: {e}", field="<record>",
                                   source=str(p), line=n) from None
        return out


def text_of(content: Any) -> str:
    """A message content as text: a string, a list of parts ({"type": "text", "text": …}), or
    any other JSON value written as JSON; None is ''."""
    if content is None:
        return ""
    if isinstance(content, str):
        return str(content)        # a str subclass (as some instrumentors' attribute values are) as a str
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts = [p.get("text") if isinstance(p.get("text"), str) else json.dumps(p, default=str)
                 for p in content]
        return "\n".join(parts)
    return json.dumps(content, default=str, ensure_ascii=False)


def arguments_of(args: Any, field: str, source: str | None = None) -> dict | None:
    """Tool-call arguments as an object: a dict, a JSON-object string, or None (unknown). Any
    other value (a bare string a code agent sends, a list) is kept as {"input": value}."""
    if args is None:
        return None
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            return {"input": args}
        args = parsed
    if isinstance(args, dict):
        try:
            return json.loads(json.dumps(args, default=str))
        except (TypeError, ValueError) as e:
            fail(field, f"arguments are not JSON: {e}", source)
    return {"input": json.loads(json.dumps(args, default=str))}


class RunBuilder:
    """Accumulates one run's events in order (seq 1, 2, …); tool results and errors link to the
    call they answer by `parent_id` when the framework gave a call id."""

    def __init__(self, run_id: str, *, source: str, origin: str | None = None):
        if not isinstance(run_id, str) or not run_id.strip():
            fail("run_id", "must be a non-empty string", origin)
        self.run_id, self.source, self.origin = run_id, source, origin
        self.events: list[Event] = []
        self.calls: dict[str, str] = {}          # framework call id -> our event id
        self.call_of: dict[str, tuple[str, Any]] = {}   # our call event id -> (tool, arguments)
        self.next_seq = 1                        # the seq of the next event (termination included)
        self._end: Event | None = None
        self.ts: float | str | None = None       # the time of the record being read (events' `ts`)
        # the span of the record being read, {"trace_id", "span_id"} (hex): each event's meta["otel"],
        # where a verdict emitted for the step lands (aftraj/adapters/emit.py)
        self.span: dict | None = None
        self.termination: str | None = None
        self.termination_note: str | None = None   # what ended the run, as the termination's content
        self.final_answer: str | None = None
        self._ids: set[str] = set()

    def _eid(self, want: str | None) -> str:
        eid = f"{self.run_id}/{want}" if want else f"{self.run_id}/{len(self.events) + 1}"
        while eid in self._ids:
            eid += "'"
        self._ids.add(eid)
        return eid

    def _add(self, kind: str, agent: str | None, payload: dict, *, field: str, want_id: str | None = None,
             parent_id: str | None = None, ts: Any = None, usage: dict | None = None,
             meta: dict | None = None) -> Event:
        if not isinstance(agent, str) or not agent.strip():
            fail(f"{field}.agent", f"names no agent (got {agent!r})", self.origin)
        try:
            ev = make_event(event_id=self._eid(want_id), run_id=self.run_id, kind=kind, agent=agent,
                            payload=payload, seq=self.next_seq, parent_id=parent_id,
                            ts=ts if ts is not None else self.ts,
                            usage=usage or None, meta={"source": self.source,
                                                       **({"otel": dict(self.span)} if self.span else {}),
                                                       **(meta or {})})
        except EventError as e:
            raise AdapterError(e.message, field=f"{field} ({e.field})", source=self.origin) from None
        self.next_seq += 1
        self.events.append(ev)
        return ev

    def message(self, agent, content, *, field="message", **kw) -> Event:
        return self._add("message", agent, {"content": text_of(content)}, field=field, **kw)

    def thinking(self, agent, content, *, field="thinking", **kw) -> Event:
        return self._add("thinking", agent, {"content": text_of(content)}, field=field, **kw)

    def tool_call(self, agent, tool, arguments, *, call_id=None, content="", field="tool_call", **kw) -> Event:
        if not isinstance(tool, str) or not tool.strip():
            fail(f"{field}.tool", f"names no tool (got {tool!r})", self.origin)
        ev = self._add("tool_call", agent, {"content": text_of(content), "tool": tool,
                                            "arguments": arguments_of(arguments, f"{field}.arguments", self.origin)},
                       field=field, want_id=call_id, **kw)
        if call_id:
            self.calls[call_id] = ev.event_id
        self.call_of[ev.event_id] = (tool, ev.payload.get("arguments"))
        return ev

    def tool_result(self, agent, content, *, tool=None, call_id=None, result_ids=None, error=None,
                    field="tool_result", **kw) -> Event:
        """A tool's result; with no `result_ids` from the source, a successful result gets the
        derived one (`derived_result_ids`: its call's tool and arguments, where known, and its text)."""
        given = kw.pop("parent_id", None)
        parent = (self.calls.get(call_id) if call_id else None) or given
        want = f"{call_id}/result" if call_id else None
        text = text_of(content)
        meta = kw.pop("meta", None)
        if result_ids is None and error is None:
            ctool, cargs = self.call_of.get(parent, (tool, None)) if parent else (tool, None)
            result_ids = derived_result_ids(tool or ctool, cargs, text)
            meta = {**(meta or {}), "result_ids": "derived"}
        return self._add("tool_result", agent, {"content": text, "tool": tool,
                                                "result_ids": None if result_ids is None else list(result_ids),
                                                "error": error},
                         field=field, want_id=want, parent_id=parent, meta=meta, **kw)

    def handoff(self, agent, to, content="", *, field="handoff", **kw) -> Event:
        """A handoff; its step reads "handoff to X" (then the text handed over, if any), so the
        prompt shows a real step, not an empty message."""
        text = text_of(content).strip()
        if not isinstance(to, str) or not to.strip():
            fail(f"{field}.to", f"names no agent to hand off to (got {to!r})", self.origin)
        shown = f"handoff to {to}" + (f": {text}" if text else "")
        return self._add("handoff", agent, {"content": shown, "to": to}, field=field, **kw)

    def error(self, agent, error, *, content="", tool=None, call_id=None, field="error", **kw) -> Event:
        parent = self.calls.get(call_id) if call_id else None
        return self._add("error", agent, {"content": text_of(content), "error": str(error) or "error",
                                          "tool": tool}, field=field, parent_id=parent, **kw)

    def final(self, agent, content, *, field="final_answer", **kw) -> Event:
        self.final_answer = text_of(content)
        return self._add("final_answer", agent, {"content": self.final_answer}, field=field, **kw)

    def terminate(self, reason: str, final_answer: str | None = None, note: str | None = None) -> None:
        self.termination = reason
        if note:
            self.termination_note = note
        if final_answer is not None:
            self.final_answer = final_answer

    def termination_event(self) -> Event | None:
        """The run's end as an event, when the source recorded it. Built once, at the first call:
        it takes the next seq then, and events added later (a message after AG2's TERMINATE)
        follow it."""
        if self.termination is None:
            return None
        if self._end is None:
            p = {"reason": self.termination}
            if self.final_answer is not None:
                p["final_answer"] = self.final_answer
            if self.termination_note:
                p["content"] = self.termination_note
            self._end = make_event(event_id=f"{self.run_id}/termination", run_id=self.run_id, kind="termination",
                                   agent="system", payload=p, seq=self.next_seq, meta={"source": self.source})
            self.next_seq += 1
        return self._end

    def all_events(self) -> list[Event]:
        """The run's events in seq order, with the termination event when the source recorded
        the end (at the end, or where a live hook posted it)."""
        end = self.termination_event()
        return sorted(self.events + ([end] if end is not None else []), key=lambda e: e.seq)

    def trajectory(self, task: str | None = None, *, meta: dict | None = None) -> Trajectory:
        """The run as a trajectory (domain `external`, unlabeled). The termination is held in
        `termination` (`completed` where the source did not record one: see meta["termination_recorded"])."""
        if not self.events:
            fail("<record>", "holds no step (no message, tool call or answer)", self.origin)
        steps = events_to_steps(self.events, self.run_id)
        m = {"unlabeled": True, "framework": self.source, "termination_recorded": self.termination is not None,
             "task_recorded": task is not None, **(meta or {})}
        return Trajectory(id=self.run_id, family_id=self.run_id, domain="external", source=self.source,
                          task=task or "", steps=steps, label=UNLABELED, final_answer=self.final_answer,
                          termination=self.termination or "completed", outcome="unknown", meta=m)
