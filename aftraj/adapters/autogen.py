"""AutoGen / AG2 runs -> our events/steps.

    aftraj convert --from autogen chat.json --out runs.jsonl

Two native shapes, told apart per message:
- AG2 (`autogen` 0.x) group-chat message lists: `groupchat.messages` or `ChatResult.chat_history`,
  each {"content", "role", "name", "tool_calls": [{"id", "function": {"name", "arguments"}}],
  "tool_responses": [{"tool_call_id", "content"}]}. `name` is the agent; a tool response links
  to its call by `tool_call_id` (one reading "Error: …", what AG2 answers for a tool that raised,
  is an error event); a message holding "TERMINATE" ends the run (`completed`). The
  first message is the task. AG2 writes a tool-call message's empty content as the string "None";
  that is read as empty.
- AutoGen AgentChat `TaskResult.model_dump()`: {"messages": [{"type": "TextMessage" |
  "ToolCallRequestEvent" | "ToolCallExecutionEvent" | "ToolCallSummaryMessage" |
  "HandoffMessage" | "ThoughtEvent" | "StopMessage", "source", "content", …}], "stop_reason"}
  (or the message objects themselves). A tool result with `is_error` is an error event; the stop
  reason of a max-messages condition ends the run with `step_limit`, any other with `completed`.

The file is one run (a list of messages, or {"messages": [...], "run_id"?, "task"?}) or a list /
JSON Lines of such runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aftraj.adapters.base import AdapterError, RunBuilder, fail, load_json, text_of
from aftraj.events import Event
from aftraj.schema import Trajectory

TERMINATE = "TERMINATE"
AG2_TOOL_ERROR = "Error: "    # how AG2's execute_function answers for a tool that raised


def add_message(rb: RunBuilder, m: Any, *, field: str = "messages[0]") -> list[Event]:
    """Append one message's events to `rb` (either shape); returns the events added."""
    start = len(rb.events)
    if not isinstance(m, dict):
        if hasattr(m, "model_dump"):
            m = m.model_dump(mode="json")
        else:
            fail(field, f"must be a message object, got {type(m).__name__}", rb.origin)
    if "type" in m and "source" in m:
        _agentchat(rb, m, field)
    else:
        _ag2(rb, m, field)
    return rb.events[start:]


def _ag2(rb: RunBuilder, m: dict, field: str) -> None:
    agent = m.get("name")
    if agent is None:
        fail(f"{field}.name", "is missing: an AG2 message names its agent (or a `role` of tool/user/assistant only "
                              "is not enough to know who spoke)", rb.origin)
    content = m.get("content")
    calls = m.get("tool_calls") or []
    responses = m.get("tool_responses") or []
    if calls and content == "None":
        content = None
    if rb.task is None and not rb.events:
        rb.task = text_of(content)
    if responses:
        for j, r in enumerate(responses):
            if not isinstance(r, dict):
                fail(f"{field}.tool_responses[{j}]", "must be an object", rb.origin)
            cid = r.get("tool_call_id")
            tool = rb.call_tools.get(cid)
            text = text_of(r.get("content"))
            if text.startswith(AG2_TOOL_ERROR):      # AG2's execute_function caught the tool's exception
                rb.error(agent, text[len(AG2_TOOL_ERROR):].strip() or "tool error", content=text, tool=tool,
                         call_id=cid, field=f"{field}.tool_responses[{j}]")
            else:
                rb.tool_result(agent, text, tool=tool, call_id=cid, field=f"{field}.tool_responses[{j}]")
        return
    if text_of(content).strip() or not calls:
        rb.message(agent, content, field=field)
    for j, tc in enumerate(calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict):
            fail(f"{field}.tool_calls[{j}].function", "is missing", rb.origin)
        rb.tool_call(agent, fn.get("name"), fn.get("arguments"), call_id=tc.get("id"),
                     field=f"{field}.tool_calls[{j}]")
        rb.call_tools[tc.get("id")] = fn.get("name")
    if isinstance(content, str) and TERMINATE in content:
        rb.terminate("completed")


def _agentchat(rb: RunBuilder, m: dict, field: str) -> None:
    t, agent, content = m["type"], m.get("source"), m.get("content")
    mu = m.get("models_usage") if isinstance(m.get("models_usage"), dict) else {}
    usage = {k: mu[src] for k, src in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens"))
             if isinstance(mu.get(src), int)} or None
    if rb.task is None and not rb.events and t == "TextMessage":
        rb.task = text_of(content)
    if t == "ToolCallRequestEvent":
        for j, fc in enumerate(content or []):
            rb.tool_call(agent, fc.get("name"), fc.get("arguments"), call_id=fc.get("id"),
                         field=f"{field}.content[{j}]", usage=usage)
            usage = None
            rb.call_tools[fc.get("id")] = fc.get("name")
    elif t == "ToolCallExecutionEvent":
        for j, r in enumerate(content or []):
            cid = r.get("call_id")
            f = f"{field}.content[{j}]"
            if r.get("is_error"):
                rb.error(agent, r.get("content") or "tool error", content=r.get("content") or "",
                         tool=r.get("name") or rb.call_tools.get(cid), call_id=cid, field=f)
            else:
                rb.tool_result(agent, r.get("content"), tool=r.get("name") or rb.call_tools.get(cid),
                               call_id=cid, field=f)
    elif t == "HandoffMessage":
        rb.handoff(agent, m.get("target"), content, field=field)
    elif t == "ThoughtEvent":
        rb.thinking(agent, content, field=field)
    elif t == "StopMessage":
        rb.message(agent, content, field=field)
        rb.terminate("completed")
    elif t in ("TextMessage", "MultiModalMessage", "StructuredMessage"):
        rb.message(agent, content, field=field, usage=usage)
    else:
        rb.message(agent, content, field=field, meta={"autogen_type": t})


def new_builder(run_id: str, origin: str | None = None) -> RunBuilder:
    rb = RunBuilder(run_id, source="autogen", origin=origin)
    rb.task, rb.call_tools = None, {}
    return rb


def from_messages(messages, *, run_id: str = "autogen-run", task: str | None = None,
                  stop_reason: str | None = None, origin: str | None = None) -> Trajectory:
    """A trajectory from an AG2 message list or AgentChat messages (objects or dicts)."""
    if not isinstance(messages, (list, tuple)):
        fail("messages", f"must be a list of messages, got {type(messages).__name__}", origin)
    rb = new_builder(run_id, origin)
    for i, m in enumerate(messages):
        add_message(rb, m, field=f"messages[{i}]")
    if stop_reason and rb.termination is None:
        low = stop_reason.lower()
        rb.terminate("step_limit" if "maximum" in low or "max" in low else "completed")
    return rb.trajectory(task if task is not None else rb.task,
                         meta={"stop_reason": stop_reason} if stop_reason else None)


def read(path: str | Path) -> list[Trajectory]:
    doc = load_json(path)
    src = str(path)
    if isinstance(doc, dict) or (isinstance(doc, list) and doc and isinstance(doc[0], dict)
                                 and ("content" in doc[0] or "type" in doc[0]) and "messages" not in doc[0]):
        runs = [doc]
    else:
        runs = doc if isinstance(doc, list) else [doc]
    out = []
    for n, run in enumerate(runs):
        if isinstance(run, list):
            run = {"messages": run}
        where = f"runs[{n}]." if len(runs) > 1 else ""
        if not isinstance(run, dict) or not isinstance(run.get("messages"), list):
            fail(f"{where}messages", "is missing: expected a list of AG2/AgentChat messages", src)
        try:
            out.append(from_messages(run["messages"], run_id=run.get("run_id") or f"{Path(src).stem}-{n}",
                                     task=run.get("task"), stop_reason=run.get("stop_reason"), origin=src))
        except AdapterError as e:
            raise AdapterError(e.message, field=f"{where}{e.field}", source=src) from None
    return out
