"""Live hooks: each framework's step hook posts the new step's events to the gateway through
`serve.client.GatewayClient` and stops the run when a verdict says ALARM (or the gateway's
intervention action is pause/halt), as serve/example_agent.py does for a scripted loop.

    from serve.client import GatewayClient
    from aftraj.adapters.hooks import SmolagentsGatewayHook
    with GatewayClient("http://127.0.0.1:8080", api_key=KEY) as gw:
        hook = SmolagentsGatewayHook(gw)
        agent = ToolCallingAgent(tools=..., model=..., step_callbacks=hook.step_callbacks())
        agent.run(task)          # raises smolagents' AgentError "Agent interrupted." after an ALARM
        hook.alarm               # the ALARM verdict (None when the run was never flagged)

- smolagents: `step_callbacks` (ActionStep, PlanningStep, FinalAnswerStep); on ALARM the hook calls
  `agent.interrupt()`, so no further step runs.
- AG2: `AG2GatewayHook.attach(*agents)` registers a `process_message_before_send` hook on each
  agent; on ALARM it raises `RunStopped` before the flagged message is delivered.
- OpenAI Agents SDK: `openai_agents_hooks(gw)` is a `RunHooks` (model answers, tool results,
  handoffs, final output); on ALARM it raises `RunStopped` out of `Runner.run`.
- OpenTelemetry: `GatewaySpanProcessor` (add it to the TracerProvider) posts each GenAI span's
  events as spans start and end; an SDK span processor cannot stop the traced code, so on ALARM it
  records the verdict (`.alarm`), calls `on_alarm(verdict)` (where the caller stops its agent)
  and posts nothing more for that trace.

A verdict given without the auditor (`auditor: unavailable` or `parse_failure`) is logged as a
warning (logger `aftraj.hooks`) and kept in `.unaudited`; it stops the run when the gateway's
`intervention.auditor_unavailable` makes its action pause or halt.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Callable

from aftraj.adapters import autogen as _autogen
from aftraj.adapters import otel as _otel
from aftraj.adapters import smolagents as _smol
from aftraj.adapters.base import RunBuilder, text_of


class RunStopped(RuntimeError):
    """Raised by a hook to stop a run the gateway flagged; `.verdict` is the gateway's verdict."""

    def __init__(self, verdict: dict):
        super().__init__(f"stopped by the auditor at step {verdict.get('t')}: {verdict.get('reason')}")
        self.verdict = verdict


log = logging.getLogger("aftraj.hooks")


def is_alarm(v: dict) -> bool:
    return v.get("decision") == "ALARM" or v.get("action") in ("pause", "halt")


def auditor_missing(v: dict) -> bool:
    """True when the verdict was given without the auditor (down, slow, unparseable reply): the
    run was judged by the fold's rules only; the gateway's `action` says how much that matters."""
    return v.get("auditor") in ("unavailable", "parse_failure")


class _GatewayRun:
    """One run on the gateway: created on the first post, then each batch of new events posted."""

    def __init__(self, gw, *, task: str | None = None, agents=(), category: str | None = None,
                 run_id: str | None = None):
        self.gw, self.task, self.agents, self.category = gw, task, list(agents), category
        self.run_id = run_id or f"run-{uuid.uuid4().hex[:12]}"
        self.created = self.ended = False
        self.verdicts: list[dict] = []
        self.unaudited: list[dict] = []        # verdicts given without the auditor (logged as warnings)
        self.alarm: dict | None = None

    def post(self, events, task: str | None = None, rb=None) -> dict | None:
        """Post `events` (plus, once, the run's termination when `rb` has recorded it)."""
        events = list(events)
        if rb is not None and rb.termination is not None and not self.ended:
            events.append(rb.termination_event())
            self.ended = True
        if not events or self.alarm is not None:
            return None
        if not self.created:
            self.run_id = self.gw.create_run(task or self.task or "", agents=self.agents, category=self.category,
                                             run_id=self.run_id)
            self.created = True
        v = self.gw.post_events(self.run_id, events)
        self.verdicts.append(v)
        if auditor_missing(v):
            self.unaudited.append(v)
            log.warning("run %s step %s: no auditor verdict (auditor %s: %s); action %s",
                        self.run_id, v.get("t"), v.get("auditor"), v.get("auditor_error"), v.get("action"))
        if is_alarm(v):
            self.alarm = v
        return v


class SmolagentsGatewayHook(_GatewayRun):
    """A smolagents step callback (see the module docstring)."""

    def __init__(self, gw, **kw):
        super().__init__(gw, **kw)
        self.rb = _smol.new_builder(self.run_id)
        self.stopped_at_step: int | None = None

    def step_callbacks(self) -> dict:
        from smolagents.memory import ActionStep, FinalAnswerStep, PlanningStep
        return {ActionStep: self, PlanningStep: self, FinalAnswerStep: self}

    def __call__(self, memory_step, agent=None) -> None:
        if self.alarm is not None:
            return
        name = getattr(agent, "name", None) or "agent"
        events = _smol.add_step(self.rb, memory_step, name, field=f"step {getattr(memory_step, 'step_number', '')}")
        v = self.post(events, task=getattr(agent, "task", None), rb=self.rb)
        if v is not None and self.alarm is not None:
            self.stopped_at_step = getattr(memory_step, "step_number", None)
            if agent is not None:
                agent.interrupt()


class AG2GatewayHook(_GatewayRun):
    """AG2 `process_message_before_send` hooks (see the module docstring)."""

    def __init__(self, gw, **kw):
        super().__init__(gw, **kw)
        self.rb = _autogen.new_builder(self.run_id)

    def attach(self, *agents) -> "AG2GatewayHook":
        for a in agents:
            a.register_hook("process_message_before_send", self._before_send)
            if a.name not in self.agents:
                self.agents.append(a.name)
        return self

    def _before_send(self, sender, message, recipient, silent):
        m = dict(message) if isinstance(message, dict) else {"content": message}
        m.setdefault("name", sender.name)
        events = _autogen.add_message(self.rb, m, field=f"message from {sender.name}")
        v = self.post(events, task=self.rb.task, rb=self.rb)
        if v is not None and self.alarm is not None:
            raise RunStopped(self.alarm)
        return message


def openai_agents_hooks(gw, **kw):
    """OpenAI Agents SDK `RunHooks` (pass as `Runner.run(..., hooks=...)`): each model answer
    (messages, tool calls with their ids), tool result (linked by the tool context's call id),
    handoff and final output is posted as it happens; on ALARM the hook raises `RunStopped`,
    which ends `Runner.run`. The returned object has the run's `.alarm`, `.verdicts`, `.rb`."""
    import asyncio

    from agents import RunHooks
    from agents.exceptions import AgentsException

    class _Stopped(RunStopped, AgentsException):
        # an AgentsException: the SDK re-raises it as is (anything else from a tool is a UserError)
        def __init__(self, verdict):
            RunStopped.__init__(self, verdict)
            self.run_data = None

    class _Hooks(RunHooks, _GatewayRun):
        # RunHooks' methods do nothing; these post each event and raise on ALARM.
        def __init__(self):
            _GatewayRun.__init__(self, gw, **kw)
            self.rb = RunBuilder(self.run_id, source="openai-agents")
            self.open: dict[tuple[str, str], list[str]] = {}

        async def _send(self, n0: int) -> None:
            await asyncio.to_thread(self.post, self.rb.events[n0:], None, self.rb)
            if self.alarm is not None:
                raise _Stopped(self.alarm)

        async def on_llm_start(self, context, agent, system_prompt, input_items) -> None:
            if self.task is None:
                first = input_items[0] if input_items else None
                self.task = text_of(first.get("content")) if isinstance(first, dict) else None

        async def on_llm_end(self, context, agent, response) -> None:
            n0 = len(self.rb.events)
            for item in response.output:
                t = getattr(item, "type", None)
                if t == "message":
                    text = "".join(getattr(c, "text", "") or "" for c in item.content)
                    if text.strip():
                        self.rb.message(agent.name, text, field="response.output")
                elif t == "function_call":
                    self.rb.tool_call(agent.name, item.name, item.arguments, call_id=item.call_id,
                                      field="response.output")
                    self.open.setdefault((agent.name, item.name), []).append(item.call_id)
            await self._send(n0)

        async def on_tool_end(self, context, agent, tool, result) -> None:
            n0 = len(self.rb.events)
            cid = getattr(context, "tool_call_id", None)
            self.rb.tool_result(agent.name, str(result), tool=tool.name, call_id=cid, field="tool result")
            await self._send(n0)

        async def on_handoff(self, context, from_agent, to_agent) -> None:
            n0 = len(self.rb.events)
            pending = self.open.get((from_agent.name, f"transfer_to_{to_agent.name}"))
            parent = self.rb.calls.get(pending.pop(0)) if pending else None
            self.rb.handoff(from_agent.name, to_agent.name, "", field="handoff", parent_id=parent)
            await self._send(n0)

        async def on_agent_end(self, context, agent, output) -> None:
            n0 = len(self.rb.events)
            self.rb.final(agent.name, output if isinstance(output, str) else str(output), field="final output")
            self.rb.terminate("completed")
            await self._send(n0)

    return _Hooks()


class GatewaySpanProcessor:
    """An OpenTelemetry SDK SpanProcessor posting GenAI spans to the gateway, one run per trace."""

    def __init__(self, gw, *, on_alarm: Callable[[dict], Any] | None = None, category: str | None = None):
        self.gw, self.on_alarm, self.category = gw, on_alarm, category
        self.runs: dict[str, tuple[_otel.OtelRun, _GatewayRun]] = {}
        self.alarm: dict | None = None

    def _run(self, s: dict):
        if s["trace"] not in self.runs:
            self.runs[s["trace"]] = (_otel.OtelRun(s["trace"]),
                                     _GatewayRun(self.gw, run_id=s["trace"], category=self.category))
        return self.runs[s["trace"]]

    def _post(self, s: dict, events) -> None:
        orun, grun = self._run(s)
        if grun.alarm is not None:
            return
        v = grun.post(events, task=orun.task, rb=orun.rb)
        if v is not None and grun.alarm is not None:
            self.alarm = grun.alarm
            if self.on_alarm is not None:
                self.on_alarm(grun.alarm)

    def on_start(self, span, parent_context=None) -> None:
        s = _otel.span_from_sdk(span)
        orun, _ = self._run(s)
        self._post(s, orun.start(s, f"span {span.name}"))

    def on_end(self, span) -> None:
        s = _otel.span_from_sdk(span)
        orun, _ = self._run(s)
        self._post(s, orun.end(s, f"span {span.name}"))

    def _on_ending(self, span) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


__all__ = ["AG2GatewayHook", "GatewaySpanProcessor", "RunStopped", "SmolagentsGatewayHook", "is_alarm",
           "openai_agents_hooks"]
