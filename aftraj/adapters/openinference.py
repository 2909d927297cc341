"""OpenInference spans (Arize Phoenix, the `openinference-instrumentation-*` packages) -> our
events/steps. OpenInference spans are OpenTelemetry spans whose attributes follow the
OpenInference semantic conventions (`openinference.span.kind`, `llm.*`, `tool.*`,
`input.value`/`output.value`), flattened with indices (`llm.output_messages.0.message.content`).

    aftraj convert --from openinference spans.json --out runs.jsonl

The file is an OTLP JSON export (as for `--from otel`: `{"resourceSpans": …}`, one document or
JSON Lines of them); one run per trace id. `from_sdk_spans(spans)` reads the SDK's own
`ReadableSpan`s (an `InMemorySpanExporter`'s). Spans are read in start order, by span kind:
- `AGENT`: names the agent (`agent.name`, else the span name without a trailing `.run`, as
  smolagents' instrumentor writes it) for the spans under it; one nested under another agent is a
  handoff. The outermost agent (or root chain) gives the task (`input.value`: its `task`, `input`
  or `query` field, or the text) and the final answer (`output.value`), and its end ends the run.
- `LLM`: each output message's text is the agent's message and its tool calls
  (`message.tool_calls.N.tool_call.{id, function.name, function.arguments}`) the agent's calls; the
  first user input message is the task when no root span gave one; `llm.token_count.*` and
  `llm.model_name` are the usage.
- `TOOL`: the tool's result (`output.value`), linked by `tool_call.id` when the span has it, else to
  the oldest open call of that tool by the same agent (instrumentors do not record the id on the
  tool span); a tool no traced LLM span called is a call read from `tool.name` and
  `input.value` (its `kwargs`). A span with status ERROR is an error event (the status message).
  smolagents' `final_answer` tool (its call and its span) is the final answer.
- `RETRIEVER`: a call of tool `retriever` whose result ids are the documents' ids
  (`retrieval.documents.N.document.id`).
- `CHAIN` (and other kinds): only an error no span under it already reported is an event.
A trace of any depth is read in time linear in its spans (iteratively, each span's agent looked
up once); a file over `aftraj.schema.MAX_RECORD_BYTES` or with more than `otel.MAX_SPANS` spans is
refused before it is mapped, and spans whose parents form a cycle are an `AdapterError` naming one
and the cycle. Each event carries its span (`meta["otel"]`), where an emitted verdict lands.
Reading needs no OpenInference package; the tests write their spans with the official
instrumentor (openinference-instrumentation-smolagents) and check the counts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from aftraj.adapters import otel as _otel
from aftraj.adapters.base import (AdapterError, RunBuilder, check_size, cycle_error, fail, load_json, span_context,
                                  strip_boilerplate, text_of)
from aftraj.adapters.otel import span_from_otlp, span_from_sdk
from aftraj.events import Event
from aftraj.schema import Trajectory

KIND = "openinference.span.kind"


def iter_otlp_spans(doc: Any, src: str):
    """Every span of an OTLP JSON export (one document or a list of them), in the neutral form of
    `aftraj.adapters.otel.span_from_otlp`, with its field path; more than `otel.MAX_SPANS` spans
    in the file is an error (raised before the span past the limit is mapped)."""
    docs = doc if isinstance(doc, list) else [doc]
    n, limit = 0, _otel.MAX_SPANS
    for d_i, d in enumerate(docs):
        if not isinstance(d, dict) or not isinstance(d.get("resourceSpans"), list):
            fail(f"[{d_i}].resourceSpans" if len(docs) > 1 else "resourceSpans",
                 "is missing: expected an OTLP JSON export", src)
        for r_i, rs in enumerate(d["resourceSpans"]):
            if rs is not None and not isinstance(rs, dict):
                fail(f"resourceSpans[{r_i}]", f"must be an object {{resource, scopeSpans}}, got {type(rs).__name__}", src)
            if not isinstance((rs or {}).get("scopeSpans") or [], list):
                fail(f"resourceSpans[{r_i}].scopeSpans", "must be a list", src)
            for s_i, ss in enumerate((rs or {}).get("scopeSpans") or []):
                if ss is not None and (not isinstance(ss, dict) or not isinstance(ss.get("spans") or [], list)):
                    fail(f"resourceSpans[{r_i}].scopeSpans[{s_i}]", "must be an object {scope, spans: [...]}", src)
                spans = (ss or {}).get("spans") or []
                n += len(spans)
                if n > limit:
                    fail(f"resourceSpans[{r_i}].scopeSpans[{s_i}].spans",
                         f"the file holds more than {limit:,} spans, the most one conversion reads: split the "
                         f"export (one trace a file)", src)
                for k, sp in enumerate(spans):
                    f = f"resourceSpans[{r_i}].scopeSpans[{s_i}].spans[{k}]"
                    yield span_from_otlp(sp, f, src), f


def walk_spans(spans: list[dict], start, end, origin: str | None = None) -> None:
    """Call `start(span, i)` then, children first in start order, `end(span, i)` for each span of
    one trace (roots: spans whose parent is not in the list). Spans no root reaches (their parents
    form a cycle) are an AdapterError naming one of them and the cycle, never dropped."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i]["start"], i))
    children: dict[str | None, list[int]] = {}
    for i in order:
        children.setdefault(spans[i]["parent"], []).append(i)
    ids = {s["id"] for s in spans}
    seen = [False] * len(spans)
    stack = [(i, False) for i in reversed(order) if spans[i]["parent"] is None or spans[i]["parent"] not in ids]
    while stack:                     # iterative: a deep trace does not hit the recursion limit
        i, done = stack.pop()
        if done:
            end(spans[i], i)
            continue
        if seen[i]:                  # a span id used twice: its children are walked once
            continue
        seen[i] = True
        start(spans[i], i)
        stack.append((i, True))
        stack.extend((c, False) for c in reversed(children.get(spans[i]["id"], [])))
    left = [i for i in order if not seen[i]]
    if left:
        at = {spans[i]["id"]: i for i in left}
        cycle_error({spans[i]["id"]: spans[i]["parent"] for i in left}, [spans[i]["id"] for i in left],
                    lambda sid: f"spans[{at[sid]}].parentSpanId", "spans", origin)


_IDX = re.compile(r"^(\d+)\.(.+)$")


def indexed(attrs: dict, prefix: str) -> list[dict]:
    """`prefix.N.rest = v` attributes as a list (by N) of {rest: v}."""
    out: dict[int, dict] = {}
    p = prefix + "."
    for k, v in attrs.items():
        if k.startswith(p):
            m = _IDX.match(k[len(p):])
            if m:
                out.setdefault(int(m.group(1)), {})[m.group(2)] = v
    return [out[i] for i in sorted(out)]


def _text(m: dict) -> str:
    """A flattened OpenInference message's text: `message.content`, else its text contents."""
    if isinstance(m.get("message.content"), str):
        return m["message.content"]
    parts = indexed(m, "message.contents")
    return "\n".join(p.get("message_content.text", "") for p in parts
                     if p.get("message_content.type", "text") == "text" and p.get("message_content.text"))


def _json_or_text(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


def _task_of(v: Any) -> str | None:
    v = _json_or_text(v)
    if isinstance(v, dict):
        for k in ("task", "input", "query", "question", "message"):
            if isinstance(v.get(k), str):
                return v[k]
        return None
    return v if isinstance(v, str) and v.strip() else None


class OpenInferenceRun:
    """One trace's OpenInference spans, fed by `walk_spans`, as events."""

    def __init__(self, run_id: str, origin: str | None = None):
        self.rb = RunBuilder(run_id, source="openinference", origin=origin)
        self.agent_of: dict[str, str] = {}
        self.agent_at: dict[str, str] = {}      # span id -> its agent (its own, else its parent's)
        self.parent_of: dict[str, str | None] = {}
        self.open: dict[tuple[str, str], list[str]] = {}
        self.errored: set[str] = set()          # spans under which an error was already an event
        self.task: str | None = None
        self.root: str | None = None

    def _agent(self, sid: str | None) -> str:
        """The agent of a started span: one look-up (set at its start from its parent's; a walk up
        the ancestors was quadratic in the depth)."""
        return self.agent_at.get(sid, "assistant") if sid else "assistant"

    def _mark_error(self, sid: str | None) -> None:
        while sid and sid not in self.errored:
            self.errored.add(sid)
            sid = self.parent_of.get(sid)

    def start(self, s: dict, field: str) -> list[Event]:
        n0 = len(self.rb.events)
        self.parent_of[s["id"]] = s["parent"]
        self.agent_at[s["id"]] = self._agent(s["parent"])
        self.rb.ts = s["start"] / 1e9 if s["start"] else None
        self.rb.span = span_context(s["trace"], s["id"])
        a = s["attrs"]
        kind = str(a.get(KIND) or "").upper()
        if self.root is None and kind in ("AGENT", "CHAIN"):
            self.root = s["id"]
            self.task = _task_of(a.get("input.value"))
        if kind == "AGENT":
            name = a.get("agent.name") or (s["name"] or "").removesuffix(".run").strip() or None
            if not name:
                fail(f"{field}.name", "an AGENT span names no agent (agent.name or the span name)", self.rb.origin)
            outer = self._agent(s["parent"]) if s["parent"] in self.parent_of else None
            self.agent_of[s["id"]] = self.agent_at[s["id"]] = name
            if outer not in (None, "assistant", name):
                self.rb.handoff(outer, name, "", field=field)
        return self.rb.events[n0:]

    def end(self, s: dict, field: str) -> list[Event]:
        n0 = len(self.rb.events)
        rb, a, sid = self.rb, s["attrs"], s["id"]
        rb.ts = s["start"] / 1e9 if s["start"] else None
        rb.span = span_context(s["trace"], sid)
        kind = str(a.get(KIND) or "").upper()
        agent = self._agent(sid)
        if kind == "LLM":
            self._llm(a, agent, field)
            if s["error"]:
                rb.error(agent, strip_boilerplate(s["error"]), content=s["error"], field=f"{field}.status")
                self._mark_error(sid)
        elif kind == "TOOL":
            self._tool(s, a, agent, field)
        elif kind == "RETRIEVER":
            docs = indexed(a, "retrieval.documents")
            call = rb.tool_call(agent, "retriever", {"query": _json_or_text(a.get("input.value"))}, field=field)
            if s["error"]:
                rb.error(agent, strip_boilerplate(s["error"]), tool="retriever", field=f"{field}.status",
                         parent_id=call.event_id)
                self._mark_error(sid)
            else:
                ids = [str(d["document.id"]) for d in docs if d.get("document.id") is not None]
                rb.tool_result(agent, "\n".join(str(d.get("document.content", "")) for d in docs), tool="retriever",
                               parent_id=call.event_id, result_ids=ids if len(ids) == len(docs) else None,
                               field=field)
        elif s["error"] and sid not in self.errored:
            rb.error(agent, strip_boilerplate(s["error"]), content=s["error"], field=f"{field}.status")
            self._mark_error(sid)
        if sid == self.root:
            out = a.get("output.value")
            if rb.final_answer is None and not s["error"] and out is not None and text_of(_json_or_text(out)).strip():
                rb.final(agent, text_of(_json_or_text(out)), field=f"{field}.output.value")
            if not s["error"]:
                rb.terminate("completed")
        elif s["error"]:
            self._mark_error(s["parent"])
        return rb.events[n0:]

    def _llm(self, a: dict, agent: str, field: str) -> None:
        rb = self.rb
        if self.task is None:
            user = next((m for m in indexed(a, "llm.input_messages") if m.get("message.role") == "user"), None)
            self.task = _text(user) if user else None
        usage = {k: v for k, v in (("input_tokens", a.get("llm.token_count.prompt")),
                                   ("output_tokens", a.get("llm.token_count.completion")),
                                   ("model", a.get("llm.model_name"))) if v is not None} or None
        for j, m in enumerate(indexed(a, "llm.output_messages")):
            f = f"{field}.attributes.llm.output_messages.{j}"
            text = _text(m)
            if text.strip():
                rb.message(agent, text, field=f, usage=usage)
                usage = None
            for c, tc in enumerate(indexed(m, "message.tool_calls")):
                name = tc.get("tool_call.function.name")
                cid = tc.get("tool_call.id")
                if name == "final_answer":       # smolagents' answer: its TOOL span is the final answer
                    continue
                rb.tool_call(agent, name, tc.get("tool_call.function.arguments"), call_id=cid,
                             field=f"{f}.message.tool_calls.{c}", usage=usage)
                usage = None
                self.open.setdefault((agent, name), []).append(cid)

    def _tool(self, s: dict, a: dict, agent: str, field: str) -> None:
        rb = self.rb
        name = a.get("tool.name") or s["name"]
        cid = a.get("tool_call.id")
        pending = self.open.get((agent, name)) or []
        if cid is not None and cid in pending:
            pending.remove(cid)
        elif cid is None and pending:
            cid = pending.pop(0)
        out = a.get("output.value")
        if name == "final_answer" and not s["error"]:      # smolagents' final answer tool
            rb.final(agent, text_of(_json_or_text(out)), field=f"{field}.output.value")
            return
        if cid is None or cid not in rb.calls:             # no traced LLM span announced the call
            args = _json_or_text(a.get("input.value"))
            if isinstance(args, dict) and isinstance(args.get("kwargs"), dict):
                args = args["kwargs"]
            cid = cid or f"span-{s['id']}"
            rb.tool_call(agent, name, args, call_id=cid, field=field)
        if s["error"]:
            rb.error(agent, strip_boilerplate(s["error"]), content=s["error"], tool=name, call_id=cid,
                     field=f"{field}.status")
            self._mark_error(s["id"])
        else:
            rb.tool_result(agent, text_of(_json_or_text(out)) if out is not None else "", tool=name, call_id=cid,
                           field=f"{field}.output.value")

    def trajectory(self) -> Trajectory:
        return self.rb.trajectory(self.task)


def from_spans(spans: list[dict], *, run_id: str | None = None, origin: str | None = None) -> Trajectory:
    """One trace's spans (the neutral form of aftraj.adapters.otel) as a trajectory."""
    run = OpenInferenceRun(run_id or spans[0]["trace"], origin)
    walk_spans(spans, lambda s, i: run.start(s, f"spans[{i}]"), lambda s, i: run.end(s, f"spans[{i}]"), origin)
    return run.trajectory()


def _by_trace(spans) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in spans:
        out.setdefault(s["trace"], []).append(s)
    return out


def from_sdk_spans(spans) -> list[Trajectory]:
    """The opentelemetry-sdk's ReadableSpans (e.g. `InMemorySpanExporter.get_finished_spans()`),
    one trajectory per trace."""
    return [from_spans(ss, run_id=tid) for tid, ss in _by_trace(span_from_sdk(s) for s in spans).items()]


def read(path: str | Path) -> list[Trajectory]:
    src = str(path)
    check_size(path, "an OTLP export")
    spans = [s for s, _ in iter_otlp_spans(load_json(path), src)]
    if not spans:
        fail("resourceSpans", "holds no span", src)
    out = []
    for tid, ss in _by_trace(spans).items():
        try:
            out.append(from_spans(ss, run_id=tid, origin=src))
        except AdapterError as e:
            raise AdapterError(e.message, field=f"trace {tid}: {e.field}", source=src) from None
    return out
