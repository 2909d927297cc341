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
Token counts come from `gen_ai.usage.*`. A malformed record (a value of the wrong OTLP type, a
part or message that is not an object, content that is not a string, spans whose parents form a
cycle) is an `AdapterError` naming the record and field; a trace of any depth is walked
iteratively; a file with more than `MAX_SPANS` spans is refused before they are mapped. Result ids: the conventions have none, so None. A chat
or tool span outside any invoke_agent span is attributed to `assistant` (the output role).
`OtelSpanSource` gives the same mapping for the SDK's own `ReadableSpan`s (the live processor).
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

from aftraj.adapters.base import AdapterError, RunBuilder, check_size, cycle_error, fail, load_json, span_context
from aftraj.events import Event
from aftraj.schema import Trajectory

CHAT_OPS = ("chat", "text_completion", "generate_content")
MAX_SPANS = 200_000        # spans a file may hold (10^6 spans took 3.9 GB and crashed the reader); base.MAX_SPANS


def _any(v: Any, field: str = "value", origin: str | None = None, depth: int = 0) -> Any:
    """An OTLP JSON AnyValue as a Python value; AdapterError naming `field` when malformed."""
    if not isinstance(v, dict):
        return v
    if depth > 32:
        fail(field, "is nested deeper than 32 levels", origin)
    if "stringValue" in v:
        if not isinstance(v["stringValue"], str):
            fail(f"{field}.stringValue", f"must be a string, got {type(v['stringValue']).__name__}", origin)
        return v["stringValue"]
    if "boolValue" in v:
        if not isinstance(v["boolValue"], bool):
            fail(f"{field}.boolValue", f"must be true or false, got {v['boolValue']!r}"[:200], origin)
        return v["boolValue"]
    if "doubleValue" in v:
        x = v["doubleValue"]
        if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x in (float("inf"), float("-inf")):
            fail(f"{field}.doubleValue", f"must be a finite number, got {x!r}"[:200], origin)
        return x
    if "intValue" in v:
        x = v["intValue"]
        if isinstance(x, bool) or not (isinstance(x, int) or isinstance(x, str) and x.lstrip("-").isdigit()
                                       and len(x) <= 20):
            fail(f"{field}.intValue", f"must be an integer (or its decimal string), got {x!r}"[:200], origin)
        return int(x)
    if "arrayValue" in v:
        arr = v["arrayValue"]
        vals = arr.get("values") if isinstance(arr, dict) else None
        if not isinstance(arr, dict) or not isinstance(vals or [], list):
            fail(f"{field}.arrayValue", "must be {values: [AnyValue, ...]}", origin)
        return [_any(x, f"{field}.arrayValue.values[{i}]", origin, depth + 1) for i, x in enumerate(vals or [])]
    if "kvlistValue" in v:
        kv = v["kvlistValue"]
        vals = kv.get("values") if isinstance(kv, dict) else None
        if not isinstance(kv, dict) or not isinstance(vals or [], list):
            fail(f"{field}.kvlistValue", "must be {values: [{key, value}, ...]}", origin)
        out = {}
        for i, x in enumerate(vals or []):
            if not isinstance(x, dict) or not isinstance(x.get("key"), str):
                fail(f"{field}.kvlistValue.values[{i}]", "must be {key: string, value}", origin)
            out[x["key"]] = _any(x.get("value"), f"{field}.kvlistValue.values[{i}].value", origin, depth + 1)
        return out
    return None


def _text(v: Any, field: str, origin: str | None) -> str:
    """Message content: a string (None is ''); anything else is an error, never str()-ed."""
    if v is None:
        return ""
    if not isinstance(v, str):
        fail(field, f"must be a string, got {type(v).__name__} ({v!r})"[:200], origin)
    return v


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
        if not isinstance(s[k], str):
            fail(f"{field}.{k}", f"must be a hex string, got {type(s[k]).__name__}", origin)
    if s.get("parentSpanId") is not None and not isinstance(s["parentSpanId"], str):
        fail(f"{field}.parentSpanId", f"must be a hex string, got {type(s['parentSpanId']).__name__}", origin)
    attrs = {}
    if not isinstance(s.get("attributes") or [], list):
        fail(f"{field}.attributes", "must be a list of {key, value}", origin)
    for j, a in enumerate(s.get("attributes") or []):
        if not isinstance(a, dict) or not isinstance(a.get("key"), str):
            fail(f"{field}.attributes[{j}]", "must be {key, value}", origin)
        attrs[a["key"]] = _any(a.get("value"), f"{field}.attributes[{j}].value", origin)
    st = s.get("status") or {}
    if not isinstance(st, dict):
        fail(f"{field}.status", f"must be an object {{code, message}}, got {type(st).__name__}", origin)
    start = s.get("startTimeUnixNano") or 0
    if isinstance(start, bool) or not (isinstance(start, int) or isinstance(start, str) and start.isdigit()
                                       and len(start) <= 20):
        fail(f"{field}.startTimeUnixNano", f"must be an integer (nanoseconds), got {start!r}"[:200], origin)
    if s.get("name") is not None and not isinstance(s["name"], str):
        fail(f"{field}.name", f"must be a string, got {type(s['name']).__name__}", origin)
    code = st.get("code")
    err = None
    if code in (2, "STATUS_CODE_ERROR", "ERROR"):
        err = st.get("message") or attrs.get("error.type") or "error"
    return {"trace": _hex_id(s["traceId"]), "id": _hex_id(s["spanId"]),
            "parent": _hex_id(s.get("parentSpanId")) or None,
            "name": s.get("name"), "start": int(start), "attrs": attrs, "error": err}


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
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            fail(f"{field}[{i}]", f"must be a message object {{role, parts}}, got {type(m).__name__}", origin)
        if not isinstance(m.get("parts") or [], list):
            fail(f"{field}[{i}].parts", f"must be a list of parts, got {type(m.get('parts')).__name__}", origin)
        for k, p in enumerate(m.get("parts") or []):
            if not isinstance(p, dict):
                fail(f"{field}[{i}].parts[{k}]", f"must be a part object {{type, ...}}, got {type(p).__name__}", origin)
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
        self.agent_at: dict[str, str | None] = {}   # span id -> its agent (its own, else its parent's)
        self.task: str | None = None
        self.root_agent_span: str | None = None

    def _agent(self, sid: str | None) -> str | None:
        """The agent of a started span: one dict look-up (set at its start from its parent's:
        linear in the spans whatever the depth; a walk up the ancestors was quadratic)."""
        return self.agent_at.get(sid) if sid else None

    def start(self, s: dict, field: str = "span") -> list[Event]:
        """The events a span stands for that are known when it starts (an agent's handoff)."""
        n0 = len(self.rb.events)
        self.agent_at[s["id"]] = self._agent(s["parent"])
        self.rb.ts = s["start"] / 1e9 if s["start"] else None
        self.rb.span = span_context(s["trace"], s["id"])
        a = s["attrs"]
        if a.get("gen_ai.operation.name") == "invoke_agent":
            name = a.get("gen_ai.agent.name") or (s["name"] or "").removeprefix("invoke_agent ").strip() or None
            if not name:
                fail(f"{field}.attributes.gen_ai.agent.name", "is missing on an invoke_agent span", self.rb.origin)
            outer = self._agent(s["parent"])
            self.agent_of[s["id"]] = self.agent_at[s["id"]] = name
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
        self.rb.span = span_context(s["trace"], s["id"])
        op = a.get("gen_ai.operation.name")
        agent = self._agent(s["id"]) or a.get("gen_ai.agent.name")
        if op in CHAT_OPS:
            if self.task is None:
                fi = f"{field}.attributes.gen_ai.input.messages"
                for i, m in enumerate(_messages(a.get("gen_ai.input.messages"), fi, origin)):
                    if m.get("role") == "user":
                        self.task = "\n".join(_text(p.get("content"), f"{fi}[{i}].parts[{k}].content", origin)
                                              for k, p in enumerate(m.get("parts") or []) if p.get("type") == "text")
                        break
            usage = _usage(a)
            if agent is None:
                agent = "assistant"
            for j, m in enumerate(_messages(a.get("gen_ai.output.messages"),
                                            f"{field}.attributes.gen_ai.output.messages", origin)):
                for k, p in enumerate(m.get("parts") or []):
                    f = f"{field}.attributes.gen_ai.output.messages[{j}].parts[{k}]"
                    t = p.get("type")
                    if t == "text":
                        rb.message(agent, _text(p.get("content"), f"{f}.content", origin), field=f, usage=usage)
                    elif t == "reasoning":
                        rb.thinking(agent, _text(p.get("content"), f"{f}.content", origin), field=f, usage=usage)
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
            res = _text(a.get("gen_ai.tool.call.result"), f"{field}.attributes.gen_ai.tool.call.result", origin)
            rb.tool_result(agent, res, tool=tool, call_id=cid, error=s["error"],
                           field=field, parent_id=parent)
        elif op == "invoke_agent":
            if s["error"]:
                rb.error(agent, s["error"], field=f"{field}.status")
            if s["id"] == self.root_agent_span:
                fo = f"{field}.attributes.gen_ai.output.messages"
                out = _messages(a.get("gen_ai.output.messages"), fo, origin)
                text = "\n".join(_text(p.get("content"), f"{fo}[{j}].parts[{k}].content", origin)
                                 for j, m in enumerate(out) for k, p in enumerate(m.get("parts") or [])
                                 if p.get("type") == "text")
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
    done = [False] * len(spans)
    for root in ends:
        if spans[root]["parent"] is not None and spans[root]["parent"] in ids:
            continue
        # iterative depth-first walk: a chain of any depth (3,000 nested spans) is no recursion
        run.start(spans[root], f"spans[{root}]")
        done[root] = True
        stack = [(root, iter(children.get(spans[root]["id"], [])))]
        while stack:
            i, it = stack[-1]
            c = next(it, None)
            if c is None:
                stack.pop()
                run.end(spans[i], f"spans[{i}]")
                continue
            if done[c]:
                continue
            done[c] = True
            run.start(spans[c], f"spans[{c}]")
            stack.append((c, iter(children.get(spans[c]["id"], []))))
    left = [i for i, d in enumerate(done) if not d]
    if left:
        at = {spans[i]["id"]: i for i in left}
        cycle_error({spans[i]["id"]: spans[i]["parent"] for i in left}, [spans[i]["id"] for i in left],
                    lambda sid: f"spans[{at[sid]}].parentSpanId", "spans", origin)
    return run.trajectory()


def read(path: str | Path) -> list[Trajectory]:
    src = str(path)
    check_size(path, "an OTLP export")
    doc = load_json(path)
    docs = doc if isinstance(doc, list) else [doc]
    by_trace: dict[str, list[dict]] = {}
    n = 0
    for d_i, d in enumerate(docs):
        pre = f"[{d_i}]." if len(docs) > 1 else ""
        if not isinstance(d, dict) or not isinstance(d.get("resourceSpans"), list):
            fail(f"{pre}resourceSpans", "is missing: expected an OTLP JSON export", src)
        for r_i, rs in enumerate(d["resourceSpans"]):
            fr = f"{pre}resourceSpans[{r_i}]"
            if rs is None:
                continue
            if not isinstance(rs, dict):
                fail(fr, f"must be an object {{resource, scopeSpans}}, got {type(rs).__name__}", src)
            if rs.get("resource") is not None and not isinstance(rs["resource"], dict):
                fail(f"{fr}.resource", f"must be an object, got {type(rs['resource']).__name__}", src)
            if not isinstance(rs.get("scopeSpans") or [], list):
                fail(f"{fr}.scopeSpans", f"must be a list, got {type(rs['scopeSpans']).__name__}", src)
            for s_i, ss in enumerate(rs.get("scopeSpans") or []):
                fs = f"{fr}.scopeSpans[{s_i}]"
                if ss is None:
                    continue
                if not isinstance(ss, dict) or not isinstance(ss.get("spans") or [], list):
                    fail(fs, "must be an object {scope, spans: [...]}", src)
                n += len(ss.get("spans") or [])
                if n > MAX_SPANS:
                    fail(f"{fs}.spans", f"the file holds more than {MAX_SPANS:,} spans, the most one conversion "
                                        f"reads: split the export (one trace a file)", src)
                for k, sp in enumerate(ss.get("spans") or []):
                    s = span_from_otlp(sp, f"{fs}.spans[{k}]", src)
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
