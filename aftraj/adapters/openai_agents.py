"""OpenAI Agents SDK traces -> our events/steps.

    aftraj convert --from openai-agents trace.jsonl --out runs.jsonl

The file holds the SDK's own export records (`Trace.export()` and `Span.export()`, what a
TracingProcessor or a file exporter writes), as JSON Lines or one JSON list; one run per
`trace_id`. Spans are read in start order: a `generation` span's output messages are the
agent's messages and tool calls (with their call ids); a `function` span is the tool's result
(linked to the oldest open call of that tool by the same agent; the SDK's function span has no
call id of its own) and its `error` an error result; a `handoff` span is a handoff from
`from_agent` to `to_agent`. The agent of a span is its nearest `agent` span's name. An
error on an agent span whose message says max turns ends the run with `step_limit`; a trace
record (the trace ended) without such an error ends it with `completed`, and then the last text
the last agent said without calling a tool is the final answer (the SDK's final output for a
text-output agent). Result ids: the SDK records none; each result gets one derived from its call
and text (aftraj/adapters/base.py).

The Responses-API model (the SDK's default, `OpenAIResponsesModel`) traces a `response` span
holding only the response id: such a trace gives tool calls (function spans), results and
handoffs, but no task, no agent text and no final answer. Reading one warns (`ContentMissing`,
naming what is missing and how to get it) and says so in the trajectory's
`meta["content_missing"]`.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from aftraj.adapters.base import AdapterError, RunBuilder, fail, load_json, text_of
from aftraj.schema import Trajectory


class ContentMissing(UserWarning):
    """A trace that holds no model text (Responses-API model: response spans hold only an id)."""


HOW_TO_GET_CONTENT = (
    "use a chat-completions model, which traces generation spans with the model's messages "
    "(`set_default_openai_api('chat_completions')`, or `OpenAIChatCompletionsModel(...)` as the agent's "
    "model), keep `RunConfig(trace_include_sensitive_data=True)` (the default), or post the run live "
    "with `aftraj.adapters.hooks.openai_agents_hooks`, which reads each model answer itself")


def _content_missing(spans, trace_id) -> str | None:
    types = [s["span_data"].get("type") for _, s in spans]
    n_resp = types.count("response")
    if n_resp == 0 or "generation" in types:
        return None
    return (f"trace {trace_id}: {n_resp} response span(s) and no generation span: the Responses-API model "
            f"records only response ids, so the task, the agents' messages and the final answer are missing "
            f"(tool calls, results and handoffs are read from function and handoff spans); to keep them, "
            + HOW_TO_GET_CONTENT)


def _agent_of(span: dict, by_id: dict[str, dict]) -> str | None:
    seen = set()
    cur = span
    while cur is not None and cur.get("id") not in seen:
        seen.add(cur.get("id"))
        d = cur.get("span_data") or {}
        if d.get("type") == "agent":
            return d.get("name")
        if d.get("type") == "custom" and isinstance(d.get("data"), dict) and d["data"].get("agent_name"):
            return d["data"]["agent_name"]
        cur = by_id.get(cur.get("parent_id"))
    return None


def _check_records(records: list[dict], origin: str | None) -> tuple[list[tuple[int, dict]], dict | None]:
    """The span exports (with their record index) and the trace export (None: not there)."""
    spans, trace = [], None
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            fail(f"records[{i}]", f"must be an object, got {type(r).__name__}", origin)
        obj = r.get("object")
        if obj == "trace":
            trace = r
        elif obj == "trace.span":
            if not isinstance(r.get("span_data"), dict):
                fail(f"records[{i}].span_data", "is missing (a span export is {object, id, trace_id, "
                                                "parent_id, started_at, ended_at, span_data, error})", origin)
            spans.append((i, r))
        else:
            fail(f"records[{i}].object", f"must be 'trace' or 'trace.span', got {obj!r}", origin)
    return spans, trace


@dataclass
class _Reading:
    """One trace's reading so far, what the span readers below share."""
    rb: RunBuilder
    origin: str | None
    open_calls: dict[tuple[str, str], list[str]] = field(default_factory=lambda: defaultdict(list))
    task: str | None = None
    last_text: tuple | None = None   # (event index, agent, text) of the newest text with no tool call in its generation
    step_limit: bool = False


def _generation(st: _Reading, f: str, d: dict, agent: str | None, err: dict | None) -> None:
    """The model's messages and tool calls (and the task: the first user message it was given)."""
    rb = st.rb
    if st.task is None and isinstance(d.get("input"), list):
        first = next((m for m in d["input"] if isinstance(m, dict) and m.get("role") == "user"), None)
        st.task = text_of(first.get("content")) if first else None
    usage = d.get("usage") if isinstance(d.get("usage"), dict) else None
    usage = {k: usage[k] for k in ("input_tokens", "output_tokens") if isinstance((usage or {}).get(k), int)} or None
    for j, m in enumerate(d.get("output") or []):
        if not isinstance(m, dict):
            fail(f"{f}.span_data.output[{j}]", "must be a message object", st.origin)
        calls = m.get("tool_calls") or []
        if text_of(m.get("content")).strip():
            ev = rb.message(agent, m.get("content"), field=f"{f}.span_data.output[{j}]", usage=usage,
                            meta={"model": d.get("model")} if d.get("model") else None)
            usage = None
            st.last_text = (len(rb.events) - 1, agent, ev.payload["content"]) if not calls else None
        for c, tc in enumerate(calls):
            fn = (tc or {}).get("function") or {}
            rb.tool_call(agent, fn.get("name"), fn.get("arguments"), call_id=tc.get("id"),
                         field=f"{f}.span_data.output[{j}].tool_calls[{c}]", usage=usage)
            usage = None
            st.open_calls[(agent, fn.get("name"))].append(tc.get("id"))
            st.last_text = None


def _function(st: _Reading, f: str, d: dict, agent: str | None, err: dict | None) -> None:
    """A tool's result (or error), answering the oldest open call of that tool by the same agent."""
    name = d.get("name")
    pending = st.open_calls.get((agent, name))
    cid = pending.pop(0) if pending else None
    parent = None
    if cid is None:   # the model's generation was not traced: the call is known from the span
        parent = st.rb.tool_call(agent, name, d.get("input"), field=f"{f}.span_data").event_id
    error = (err or {}).get("message") if err else None
    st.rb.tool_result(agent, d.get("output") if d.get("output") is not None else "", tool=name, call_id=cid,
                      error=error, field=f"{f}.span_data", parent_id=parent)
    st.last_text = None


def _handoff(st: _Reading, f: str, d: dict, agent: str | None, err: dict | None) -> None:
    frm, to = d.get("from_agent"), d.get("to_agent")
    if not to:
        fail(f"{f}.span_data.to_agent", "is missing on a handoff span", st.origin)
    pending = st.open_calls.get((frm, f"transfer_to_{to}"))
    parent = st.rb.calls.get(pending.pop(0)) if pending else None
    st.rb.handoff(frm or agent, to, "", field=f"{f}.span_data", parent_id=parent)
    st.last_text = None


def _error(st: _Reading, f: str, d: dict, agent: str | None, err: dict) -> None:
    """An error on another span: an error event; max turns ends the run with step_limit."""
    msg = str(err.get("message") or "error")
    st.rb.error(agent or d.get("name") or "system", msg, content=text_of(err.get("data")), field=f"{f}.error")
    if "max turns" in msg.lower():
        st.step_limit = True


_SPAN_READERS = {"generation": _generation, "function": _function, "handoff": _handoff}
_ERROR_SPANS = ("agent", "guardrail", "custom", "response")


def _terminate(st: _Reading, trace: dict | None) -> None:
    rb = st.rb
    if st.step_limit:
        rb.terminate("step_limit")
    elif trace is not None and st.last_text is not None and st.last_text[0] == len(rb.events) - 1:
        rb.terminate("completed", final_answer=st.last_text[2])
    elif trace is not None:
        rb.terminate("completed")


def from_records(records: list[dict], *, run_id: str | None = None, origin: str | None = None) -> Trajectory:
    """One trace's records (the trace export, if present, and its span exports) as a trajectory."""
    spans, trace = _check_records(records, origin)
    rid = run_id or (trace or {}).get("id") or (spans[0][1].get("trace_id") if spans else None)
    rb = RunBuilder(rid or "openai-agents-run", source="openai-agents", origin=origin)
    by_id = {s["id"]: s for _, s in spans if s.get("id")}
    st = _Reading(rb, origin)
    for i, s in sorted(spans, key=lambda x: (str(x[1].get("started_at") or ""), x[0])):
        d, t, err = s["span_data"], s["span_data"].get("type"), s.get("error")
        rb.ts = s.get("started_at") if isinstance(s.get("started_at"), str) and len(s["started_at"]) <= 64 else None
        agent = _agent_of(s, by_id)
        if t in _SPAN_READERS:
            _SPAN_READERS[t](st, f"records[{i}]", d, agent, err)
        elif err and t in _ERROR_SPANS:
            _error(st, f"records[{i}]", d, agent, err)
    _terminate(st, trace)
    meta = {"workflow_name": trace.get("workflow_name")} if trace and trace.get("workflow_name") else {}
    missing = _content_missing(spans, rid)
    if missing:
        warnings.warn(missing, ContentMissing, stacklevel=2)
        meta["content_missing"] = missing
    if not rb.events and missing:
        fail("<record>", missing, origin)
    return rb.trajectory(st.task, meta=meta or None)


def read(path: str | Path) -> list[Trajectory]:
    doc = load_json(path)
    src = str(path)
    if isinstance(doc, dict):
        doc = doc.get("data") if isinstance(doc.get("data"), list) else [doc]
    if not isinstance(doc, list) or not doc:
        fail("<file>", "must hold trace and span export records (a JSON list or JSON Lines)", src)
    by_trace: dict[str, list[dict]] = {}
    for i, r in enumerate(doc):
        tid = (r.get("id") if r.get("object") == "trace" else r.get("trace_id")) if isinstance(r, dict) else None
        if not isinstance(tid, str) or not tid:
            fail(f"records[{i}].trace_id", "is missing: every span export names its trace", src)
        by_trace.setdefault(tid, []).append(r)
    out = []
    for tid, recs in by_trace.items():
        try:
            out.append(from_records(recs, run_id=tid, origin=src))
        except AdapterError as e:
            raise AdapterError(e.message, field=f"trace {tid}: {e.field}", source=src) from None
    return out
