"""OpenTelemetry GenAI spans -> our events/steps (semantic conventions `gen_ai.*`).

    aftraj convert --from otel spans.json --out runs.jsonl

The file is an OTLP JSON export ({"resourceSpans": [{"scopeSpans": [{"spans": [...]}]}]}, one
document or JSON Lines of them, as the OpenTelemetry Collector's file exporter writes); one run
per trace id. Spans are read in start order, by `gen_ai.operation.name`:
- `invoke_agent`: names the agent (`gen_ai.agent.name`) for the spans under it; one nested under
  another agent's is a handoff from that agent to it; the outermost one's output text
  (`gen_ai.output.messages`) is the final answer, and its end is the run's end (`completed`).
- `chat` (and `text_completion`, `generate_content`): the output message parts are the agent's
  messages (`text`), thinking (`reasoning`) and tool calls (`tool_call`, with their ids); the
  first user input message is the task.
- `execute_tool`: the tool's result (`gen_ai.tool.call.result`, linked by `gen_ai.tool.call.id`);
  a span with status ERROR is an error result (the status message, else `error.type`).
Token counts come from `gen_ai.usage.*`. Result ids: the conventions have none, so None. A chat
or tool span outside any invoke_agent span is attributed to `assistant` (the output role).
`OtelSpanSource` gives the same mapping for the SDK's own `ReadableSpan`s (the live processor).
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

from aftraj.adapters.base import AdapterError, RunBuilder, fail, load_json
from aftraj.events import Event
from aftraj.schema import Trajectory

CHAT_OPS = ("chat", "text_completion", "generate_content")


def _any(v: Any) -> Any:
    """An OTLP JSON AnyValue as a Python value."""
    if not isinstance(v, dict):
        return v
    for k in ("stringValue", "boolValue", "doubleValue"):
        if k in v:
            return v[k]
    if "intValue" in v:
        return int(v["intValue"])
    if "arrayValue" in v:
        return [_any(x) for x in (v["arrayValue"].get("values") or [])]
    if "kvlistValue" in v:
        return {x["key"]: _any(x.get("value")) for x in (v["kvlistValue"].get("values") or [])}
    return None


def _hex_id(v: Any) -> Any:
    """OTLP JSON ids are hex; protobuf's generic JSON mapping writes the bytes as base64."""
    if isinstance(v, str) and v and not all(c in "0123456789abcdefABCDEF" for c in v):
        try:
            return base64.b64decode(v, validate=True).hex()
        except (binascii.Error, ValueError):
            return v
    return v


def span_from_otlp(s: dict, field: str, origin: str | None) -> dict:
    """One OTLP JSON span in the neutral form {trace, id, parent, name, start, attrs, error}."""
    if not isinstance(s, dict):
        fail(field, f"must be a span object, got {type(s).__name__}", origin)
    for k in ("traceId", "spanId"):
        if not s.get(k):
            fail(f"{field}.{k}", "is missing", origin)
    attrs = {}
    for j, a in enumerate(s.get("attributes") or []):
        if not isinstance(a, dict) or "key" not in a:
            fail(f"{field}.attributes[{j}]", "must be {key, value}", origin)
        attrs[a["key"]] = _any(a.get("value"))
    st = s.get("status") or {}
    code = st.get("code")
    err = None
    if code in (2, "STATUS_CODE_ERROR", "ERROR"):
        err = st.get("message") or attrs.get("error.type") or "error"
    return {"trace": _hex_id(s["traceId"]), "id": _hex_id(s["spanId"]),
            "parent": _hex_id(s.get("parentSpanId")) or None,
            "name": s.get("name"), "start": int(s.get("startTimeUnixNano") or 0), "attrs": attrs, "error": err}


def span_from_sdk(span) -> dict:
    """An opentelemetry-sdk ReadableSpan in the neutral form."""
    from opentelemetry.trace import StatusCode
    ctx, parent = span.context, span.parent
    err = None
    if span.status.status_code == StatusCode.ERROR:
        err = span.status.description or (span.attributes or {}).get("error.type") or "error"
    return {"trace": format(ctx.trace_id, "032x"), "id": format(ctx.span_id, "016x"),
            "parent": format(parent.span_id, "016x") if parent else None, "name": span.name,
            "start": span.start_time or 0, "attrs": dict(span.attributes or {}), "error": err}


def _messages(v: Any, field: str, origin: str | None) -> list:
    if v is None:
        return []
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            fail(field, "is not JSON (the GenAI conventions carry messages as a JSON list)", origin)
    if not isinstance(v, list):
        fail(field, f"must be a list of messages, got {type(v).__name__}", origin)
    return v


def _usage(a: dict) -> dict | None:
    u = {"input_tokens": a.get("gen_ai.usage.input_tokens"), "output_tokens": a.get("gen_ai.usage.output_tokens"),
         "model": a.get("gen_ai.response.model") or a.get("gen_ai.request.model"), "id": a.get("gen_ai.response.id")}
    u = {k: v for k, v in u.items() if v is not None}
    return u or None


class OtelRun:
    """One trace's spans, fed in start order, as events (the reader and the live processor)."""

    def __init__(self, run_id: str, origin: str | None = None):
        self.rb = RunBuilder(run_id, source="otel", origin=origin)
        self.agent_of: dict[str, str] = {}     # span id -> agent name (invoke_agent spans)
        self.parent_of: dict[str, str | None] = {}
        self.task: str | None = None
        self.root_agent_span: str | None = None

    def _agent(self, sid: str | None) -> str | None:
        seen = set()
        while sid and sid not in seen:
            seen.add(sid)
            if sid in self.agent_of:
                return self.agent_of[sid]
            sid = self.parent_of.get(sid)
        return None

    def start(self, s: dict, field: str = "span") -> list[Event]:
        """The events a span stands for that are known when it starts (an agent's handoff)."""
        n0 = len(self.rb.events)
        self.parent_of[s["id"]] = s["parent"]
        self.rb.ts = s["start"] / 1e9 if s["start"] else None
        a = s["attrs"]
        if a.get("gen_ai.operation.name") == "invoke_agent":
            name = a.get("gen_ai.agent.name") or (s["name"] or "").removeprefix("invoke_agent ").strip() or None
            if not name:
                fail(f"{field}.attributes.gen_ai.agent.name", "is missing on an invoke_agent span", self.rb.origin)
            outer = self._agent(s["parent"])
            self.agent_of[s["id"]] = name
            if outer is None and self.root_agent_span is None:
                self.root_agent_span = s["id"]
            elif outer is not None and outer != name:
                self.rb.handoff(outer, name, "", field=field)
        return self.rb.events[n0:]

    def end(self, s: dict, field: str = "span") -> list[Event]:
        """The events of a finished span."""
        n0 = len(self.rb.events)
        rb, a, origin = self.rb, s["attrs"], self.rb.origin
        self.rb.ts = s["start"] / 1e9 if s["start"] else None
        op = a.get("gen_ai.operation.name")
        agent = self._agent(s["id"]) or a.get("gen_ai.agent.name")
        if op in CHAT_OPS:
            if self.task is None:
                for m in _messages(a.get("gen_ai.input.messages"), f"{field}.attributes.gen_ai.input.messages", origin):
                    if isinstance(m, dict) and m.get("role") == "user":
                        self.task = "\n".join(p.get("content", "") for p in m.get("parts") or []
                                              if isinstance(p, dict) and p.get("type") == "text")
                        break
            usage = _usage(a)
            if agent is None:
                agent = "assistant"
            for j, m in enumerate(_messages(a.get("gen_ai.output.messages"),
                                            f"{field}.attributes.gen_ai.output.messages", origin)):
                for k, p in enumerate((m or {}).get("parts") or []):
                    f = f"{field}.attributes.gen_ai.output.messages[{j}].parts[{k}]"
                    t = p.get("type") if isinstance(p, dict) else None
                    if t == "text":
                        rb.message(agent, p.get("content"), field=f, usage=usage)
                    elif t == "reasoning":
                        rb.thinking(agent, p.get("content"), field=f, usage=usage)
                    elif t == "tool_call":
                        rb.tool_call(agent, p.get("name"), p.get("arguments"), call_id=p.get("id"), field=f,
                                     usage=usage)
                    else:
                        continue
                    usage = None
            if s["error"]:
                rb.error(agent, s["error"], field=f"{field}.status")
        elif op == "execute_tool":
            tool = a.get("gen_ai.tool.name") or (s["name"] or "").removeprefix("execute_tool ").strip() or None
            cid = a.get("gen_ai.tool.call.id")
            agent = agent or "assistant"
            parent = None
            if cid is None or cid not in rb.calls:   # no traced chat span announced the call
                parent = rb.tool_call(agent, tool, a.get("gen_ai.tool.call.arguments"), call_id=cid,
                                      field=field).event_id
            res = a.get("gen_ai.tool.call.result")
            rb.tool_result(agent, res if res is not None else "", tool=tool, call_id=cid, error=s["error"],
                           field=field, parent_id=parent)
        elif op == "invoke_agent":
            if s["error"]:
                rb.error(agent, s["error"], field=f"{field}.status")
            if s["id"] == self.root_agent_span:
                out = _messages(a.get("gen_ai.output.messages"), f"{field}.attributes.gen_ai.output.messages", origin)
                text = "\n".join(p.get("content", "") for m in out if isinstance(m, dict)
                                 for p in m.get("parts") or [] if isinstance(p, dict) and p.get("type") == "text")
                if text and not s["error"]:
                    rb.final(agent, text, field=field)
                if not s["error"]:
                    rb.terminate("completed")
        elif s["error"] and agent:
            rb.error(agent, s["error"], field=f"{field}.status")
        return rb.events[n0:]

    def trajectory(self) -> Trajectory:
        return self.rb.trajectory(self.task)


def from_spans(spans: list[dict], *, run_id: str | None = None, origin: str | None = None) -> Trajectory:
    """One trace's spans (neutral form) as a trajectory."""
    run = OtelRun(run_id or spans[0]["trace"], origin)
    # each span starts, then its children (in start order) run, then it ends
    ends = sorted(range(len(spans)), key=lambda i: (spans[i]["start"], i))
    children: dict[str | None, list[int]] = {}
    for i in ends:
        children.setdefault(spans[i]["parent"], []).append(i)
    ids = {s["id"] for s in spans}

    def walk(i: int) -> None:
        run.start(spans[i], f"spans[{i}]")
        for c in children.get(spans[i]["id"], []):
            walk(c)
        run.end(spans[i], f"spans[{i}]")

    for i in ends:
        if spans[i]["parent"] is None or spans[i]["parent"] not in ids:
            walk(i)
    return run.trajectory()


def read(path: str | Path) -> list[Trajectory]:
    doc = load_json(path)
    src = str(path)
    docs = doc if isinstance(doc, list) else [doc]
    by_trace: dict[str, list[dict]] = {}
    for d_i, d in enumerate(docs):
        if not isinstance(d, dict) or not isinstance(d.get("resourceSpans"), list):
            fail(f"[{d_i}].resourceSpans" if len(docs) > 1 else "resourceSpans",
                 "is missing: expected an OTLP JSON export", src)
        for r_i, rs in enumerate(d["resourceSpans"]):
            for s_i, ss in enumerate((rs or {}).get("scopeSpans") or []):
                for k, sp in enumerate((ss or {}).get("spans") or []):
                    f = f"resourceSpans[{r_i}].scopeSpans[{s_i}].spans[{k}]"
                    s = span_from_otlp(sp, f, src)
                    by_trace.setdefault(s["trace"], []).append(s)
    if not by_trace:
        fail("resourceSpans", "holds no span", src)
    out = []
    for tid, spans in by_trace.items():
        try:
            out.append(from_spans(spans, run_id=tid, origin=src))
        except AdapterError as e:
            raise AdapterError(e.message, field=f"trace {tid}: {e.field}", source=src) from None
    return out
