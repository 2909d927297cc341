"""Langfuse traces -> our events/steps: a trace's observations become the run's steps.

    aftraj convert --from langfuse trace.json --out runs.jsonl

Two shapes, told apart by the file:
- a Langfuse trace export, as the public API returns it (`GET /api/public/traces/{id}`, the UI's
  download): {"id", "name", "input", "output", "observations": [{"id", "type", "name",
  "startTime", "parentObservationId", "input", "output", "level", "statusMessage", "model",
  "usageDetails" | "usage"}, …]}; one such object, a list of them, {"data": [...]}, or JSON Lines;
- the spans the Langfuse SDK (v3+, OpenTelemetry-based) writes, as an OTLP JSON export
  (`{"resourceSpans": …}`): each span's `langfuse.observation.*` attributes are the observation
  (`observation_from_span`), `langfuse.trace.*` the trace's. `from_sdk_spans(spans)` reads the
  SDK's own ReadableSpans.

Observations are read in start order, by type: `AGENT` names the agent for those under it (one
nested under another agent is a handoff); `GENERATION` is the agent's message(s) and tool calls
(its output: text, a message {"content", "tool_calls"}, or a list of them); `TOOL` is a call (its
input the arguments) and its result (its output), or, at level ERROR, its error (the status
message); a `SPAN`/`CHAIN`/`EVENT`/other observation at level ERROR is an error event. The trace's
input (else the first user message of a generation) is the task, its output the final answer; a
trace with an output ended (`completed`). Each observation's agent is found in one pass down the
tree (linear in the observations, whatever the depth); parents that form a cycle are an
`AdapterError` naming an observation and the cycle; a file over `aftraj.schema.MAX_RECORD_BYTES`
or with more than `otel.MAX_SPANS` observations is refused. Each event carries its observation
as `meta["otel"]` (trace and observation ids, when they are OTel ids, as the SDK v3+ writes them),
where an emitted verdict's score lands (`observationId`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aftraj.adapters import otel as _otel
from aftraj.adapters.base import (AdapterError, RunBuilder, check_size, cycle_error, fail, load_json, span_context,
                                  strip_boilerplate, text_of)
from aftraj.adapters.openinference import _json_or_text, _task_of, iter_otlp_spans
from aftraj.adapters.otel import span_from_sdk
from aftraj.schema import Trajectory


def observation_from_span(s: dict) -> dict:
    """A Langfuse SDK span (neutral form of aftraj.adapters.otel) as an observation of the API's
    shape (what the Langfuse server stores for it)."""
    a = s["attrs"]
    usage = _json_or_text(a.get("langfuse.observation.usage_details"))
    level = a.get("langfuse.observation.level") or ("ERROR" if s["error"] else "DEFAULT")
    return {"id": s["id"], "traceId": s["trace"], "parentObservationId": s["parent"], "name": s["name"],
            "type": str(a.get("langfuse.observation.type") or "span").upper(), "startTime": s["start"],
            "input": _json_or_text(a.get("langfuse.observation.input")),
            "output": _json_or_text(a.get("langfuse.observation.output")),
            "level": level, "statusMessage": a.get("langfuse.observation.status_message") or s["error"],
            "model": a.get("langfuse.observation.model.name"),
            "usageDetails": usage if isinstance(usage, dict) else None,
            "traceInput": _json_or_text(a.get("langfuse.trace.input")),
            "traceOutput": _json_or_text(a.get("langfuse.trace.output")),
            "traceName": a.get("langfuse.trace.name")}


def trace_from_spans(spans: list[dict]) -> dict:
    """One trace's SDK spans as the API's trace export: the trace's own input/output are the
    `langfuse.trace.*` attributes, else the root observation's."""
    obs = [observation_from_span(s) for s in spans]
    ids = {o["id"] for o in obs}
    roots = [o for o in obs if o["parentObservationId"] not in ids]
    root = min(roots, key=lambda o: o["startTime"]) if roots else None

    def pick(k: str, rk: str) -> Any:
        """The first observation's `k` that is set, else the root observation's `rk`."""
        return next((o[k] for o in obs if o.get(k) is not None), root.get(rk) if root else None)

    return {"id": spans[0]["trace"], "name": pick("traceName", "name"), "input": pick("traceInput", "input"),
            "output": pick("traceOutput", "output"), "observations": obs}


def _messages(v: Any) -> list[dict]:
    v = _json_or_text(v)
    if isinstance(v, dict) and isinstance(v.get("messages"), list):
        v = v["messages"]
    if isinstance(v, dict):
        return [v]
    if isinstance(v, list):
        return [m for m in v if isinstance(m, dict)]
    return [{"role": "assistant", "content": v}] if isinstance(v, str) else []


def _outer_agents(parent_of: dict, by_id: dict, field_of: dict, origin: str | None) -> dict:
    """observation id -> the name of the nearest AGENT observation strictly above it (None: none),
    each computed once, in one pass down the tree from its roots: linear in the observations
    whatever the depth. Observations whose parents form a cycle are an AdapterError naming one."""
    children: dict = {}
    for oid, p in parent_of.items():
        children.setdefault(p, []).append(oid)
    out: dict = {}
    stack = [(oid, None) for oid in children.get(None, [])]
    while stack:
        oid, above = stack.pop()
        out[oid] = above
        o = by_id[oid]
        name = o.get("name") if str(o.get("type") or "").upper() == "AGENT" and isinstance(o.get("name"), str) \
            and o["name"].strip() else None
        stack.extend((c, name or above) for c in children.get(oid, []))
    if len(out) < len(parent_of):
        left = [oid for oid in parent_of if oid not in out]
        cycle_error(parent_of, left, lambda oid: f"{field_of[oid]}.parentObservationId", "observations", origin)
    return out


def _observations(observations: list, origin: str | None) -> list[tuple[int, dict]]:
    """The trace export's observations, each with its index; an AdapterError where one is not."""
    obs = []
    for i, o in enumerate(observations):
        if isinstance(o, str):
            fail(f"observations[{i}]", "is an id, not an observation: export the trace itself "
                                      "(GET /api/public/traces/{id}), not the trace list", origin)
        if not isinstance(o, dict) or not o.get("id"):
            fail(f"observations[{i}]", "must be an observation object with an id", origin)
        obs.append((i, o))
    return obs


@dataclass
class _Reading:
    """One trace's reading so far, what the observation readers below share."""
    rb: RunBuilder
    origin: str | None
    parent_of: dict                 # observation id -> its parent's id (None: a root)
    task: str | None
    open_calls: dict[tuple[str, str], list[str]] = field(default_factory=dict)


def _agent_obs(st: _Reading, f: str, o: dict, who: str, err: str | None) -> None:
    """An AGENT observation: a handoff from the agent above it (if any), and its error."""
    name = o.get("name")
    if not isinstance(name, str) or not name.strip():
        fail(f"{f}.name", "an AGENT observation names no agent", st.origin)
    outer = who if st.parent_of.get(o["id"]) is not None else None
    if outer not in (None, "assistant", name):
        st.rb.handoff(outer, name, "", field=f)
    if err:
        st.rb.error(name, strip_boilerplate(err), content=str(err), field=f"{f}.statusMessage")


def _generation(st: _Reading, f: str, o: dict, who: str, err: str | None) -> None:
    """A GENERATION: the agent's messages and tool calls (the task, if the trace has none: its first
    user message)."""
    rb = st.rb
    if st.task is None:
        user = next((m for m in _messages(o.get("input")) if m.get("role") == "user"), None)
        st.task = text_of(user.get("content")) if user else None
    u = o.get("usageDetails") or o.get("usage") or {}
    usage = {k: u.get(src) for k, src in (("input_tokens", "input"), ("output_tokens", "output"))
             if isinstance(u.get(src), int)}
    if o.get("model"):
        usage["model"] = o["model"]
    usage = usage or None
    for j, m in enumerate(_messages(o.get("output"))):
        text = text_of(m.get("content"))
        if text.strip():
            rb.message(who, text, field=f"{f}.output[{j}]", usage=usage)
            usage = None
        for c, tc in enumerate(m.get("tool_calls") or []):
            fn = (tc or {}).get("function") or {}
            rb.tool_call(who, fn.get("name") or tc.get("name"), fn.get("arguments", tc.get("arguments")),
                         call_id=tc.get("id"), field=f"{f}.output[{j}].tool_calls[{c}]", usage=usage)
            usage = None
            st.open_calls.setdefault((who, fn.get("name") or tc.get("name")), []).append(tc.get("id"))
    if err:
        rb.error(who, strip_boilerplate(err), content=str(err), field=f"{f}.statusMessage")


def _tool(st: _Reading, f: str, o: dict, who: str, err: str | None) -> None:
    """A TOOL: its call (unless a generation announced it) and its result, or its error."""
    rb, name = st.rb, o.get("name")
    pending = st.open_calls.get((who, name))
    cid = pending.pop(0) if pending else None
    if cid is None or cid not in rb.calls:       # no generation announced it: the call is this observation
        cid = cid or f"obs-{o['id']}"
        rb.tool_call(who, name, _json_or_text(o.get("input")), call_id=cid, field=f)
    if err:
        rb.error(who, strip_boilerplate(err), content=str(err), tool=name, call_id=cid,
                 field=f"{f}.statusMessage")
    else:
        out = o.get("output")
        rb.tool_result(who, "" if out is None else text_of(out), tool=name, call_id=cid, field=f"{f}.output")


def _other(st: _Reading, f: str, o: dict, who: str, err: str | None) -> None:
    """Any other observation (SPAN, CHAIN, EVENT, …): an error event at level ERROR, else nothing."""
    if err:
        st.rb.error(who, strip_boilerplate(err), content=str(err), field=f"{f}.statusMessage")


_OBSERVATION_READERS = {"AGENT": _agent_obs, "GENERATION": _generation, "TOOL": _tool}


def from_trace(doc: dict, *, origin: str | None = None) -> Trajectory:
    """One trace export (the API's shape) as a trajectory."""
    if not isinstance(doc, dict) or not isinstance(doc.get("observations"), list):
        fail("observations", "is missing: a Langfuse trace export holds its observations "
                             "(GET /api/public/traces/{id})", origin)
    tid = doc.get("id") or "langfuse-trace"
    rb = RunBuilder(str(tid), source="langfuse", origin=origin)
    obs = _observations(doc["observations"], origin)
    by_id = {o["id"]: o for _, o in obs}
    field_of = {o["id"]: f"observations[{i}]" for i, o in obs}
    parent_of = {o["id"]: o.get("parentObservationId") if o.get("parentObservationId") in by_id else None
                 for _, o in obs}
    outer_agent = _outer_agents(parent_of, by_id, field_of, origin)
    st = _Reading(rb, origin, parent_of, _task_of(doc.get("input")))
    for i, o in sorted(obs, key=lambda x: (str(x[1].get("startTime") or ""), x[0])):
        typ = str(o.get("type") or "SPAN").upper()
        rb.ts = o.get("startTime") if isinstance(o.get("startTime"), (str, int, float)) else None
        err = o.get("statusMessage") or "error" if str(o.get("level") or "").upper() == "ERROR" else None
        who = outer_agent.get(o["id"]) or "assistant"    # the nearest AGENT above (one look-up: _outer_agents)
        rb.span = span_context(o.get("traceId") or tid, o["id"])
        _OBSERVATION_READERS.get(typ, _other)(st, f"observations[{i}]", o, who, err)
    rb.span = None
    out = doc.get("output")
    if out is not None and text_of(out).strip():
        last = rb.events[-1].agent if rb.events else "assistant"
        rb.final(last, text_of(out), field="output")
        rb.terminate("completed")
    return rb.trajectory(st.task, meta={"trace_name": doc["name"]} if doc.get("name") else None)


def from_sdk_spans(spans) -> list[Trajectory]:
    """The Langfuse SDK's ReadableSpans (e.g. an InMemorySpanExporter's), one run per trace."""
    by: dict[str, list[dict]] = {}
    for s in spans:
        n = span_from_sdk(s)
        by.setdefault(n["trace"], []).append(n)
    return [from_trace(trace_from_spans(ss)) for ss in by.values()]


def read(path: str | Path) -> list[Trajectory]:
    src = str(path)
    check_size(path, "a Langfuse export")
    doc = load_json(path)
    if isinstance(doc, dict) and "resourceSpans" in doc or (isinstance(doc, list) and doc
                                                            and isinstance(doc[0], dict) and "resourceSpans" in doc[0]):
        by: dict[str, list[dict]] = {}
        for s, _ in iter_otlp_spans(doc, src):
            by.setdefault(s["trace"], []).append(s)
        traces = [trace_from_spans(ss) for ss in by.values()]
    elif isinstance(doc, dict) and isinstance(doc.get("data"), list):
        traces = doc["data"]
    else:
        traces = doc if isinstance(doc, list) else [doc]
    if not traces:
        fail("<file>", "holds no trace", src)
    n = sum(len(t["observations"]) for t in traces if isinstance(t, dict) and isinstance(t.get("observations"), list))
    if n > _otel.MAX_SPANS:
        fail("observations", f"the file holds {n:,} observations, more than the {_otel.MAX_SPANS:,} one conversion "
                             f"reads: split the export (one trace a file)", src)
    out = []
    for n, t in enumerate(traces):
        try:
            out.append(from_trace(t, origin=src))
        except AdapterError as e:
            where = f"traces[{n}]." if len(traces) > 1 else ""
            raise AdapterError(e.message, field=f"{where}{e.field}", source=src) from None
    return out


__all__ = ["from_sdk_spans", "from_trace", "observation_from_span", "read", "trace_from_spans"]
