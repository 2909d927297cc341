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
  `hook.initiate_chat(sender, recipient, **kw)` also posts the end of a chat that stopped at its
  turn or round limit (`step_limit`; AG2 calls no hook then).
- OpenAI Agents SDK: `openai_agents_hooks(gw)` is a `RunHooks` (model answers, tool results,
  tool errors, handoffs, final output); on ALARM it raises `RunStopped` out of `Runner.run`.
  `hooks.run_sync(agent, input, max_turns=…)` also posts `MaxTurnsExceeded` as the run's
  `step_limit` end.
- OpenTelemetry: `GatewaySpanProcessor` (add it to the TracerProvider) posts each GenAI span's
  events as spans start and end; an SDK span processor cannot stop the traced code, so on ALARM it
  records the verdict (`.alarm`), calls `on_alarm(verdict)` (where the caller stops its agent)
  and posts nothing more for that trace.

A verdict given without the auditor (`auditor: unavailable` or `parse_failure`) is logged as a
warning (logger `aftraj.hooks`) and kept in `.unaudited`; it stops the run when the gateway's
`intervention.auditor_unavailable` makes its action pause or halt.

Fail open (the default, as the Langfuse SDK does): monitoring never breaks the agent. A gateway
that is down, slow past the client's timeout, or answers an error (409, 500, …) is logged
(warning, logger `aftraj.hooks`) and counted (`.failures`, `.failed_posts`, `.dropped_events`),
and the agent carries on. Events a transient failure kept from the gateway (connection, timeout,
5xx, 429) wait in `.pending` (at most `max_pending`) and go with the next post (a batch is
idempotent by event id); events the gateway refused (another 4xx) are dropped and counted. After
`max_failures` failures in a row the hook stops calling the gateway for `cooldown_s` seconds, so a
dead gateway costs the agent one timeout, not one per step. `fail_closed=True` instead stops the
run at the first failure, as an ALARM would, with `GatewayUnavailable` (a `RunStopped`; its
`.verdict` says why). The wait per post is the client's: `GatewayClient(url, key, timeout=2,
retries=1)` for a live agent.

Sequence numbers are the hook's: each event posted takes the next one (`.seq`), whatever its
builder said, so a message after the run's termination (AG2 sends after TERMINATE) follows it.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable

from aftraj.adapters import autogen as _autogen
from aftraj.adapters import otel as _otel
from aftraj.adapters import smolagents as _smol
from aftraj.adapters.base import RunBuilder, strip_boilerplate, text_of


class RunStopped(RuntimeError):
    """Raised by a hook to stop a run the gateway flagged; `.verdict` is the gateway's verdict."""

    def __init__(self, verdict: dict):
        super().__init__(f"stopped by the auditor at step {verdict.get('t')}: {verdict.get('reason')}")
        self.verdict = verdict


class GatewayUnavailable(RunStopped):
    """Raised (fail-closed hooks only) when the gateway could not be reached or refused a post;
    `.verdict` = {"decision": None, "t": None, "reason": …, "gateway_error": …}."""

    def __init__(self, verdict: dict):
        RuntimeError.__init__(self, f"stopped: the gateway is unavailable ({verdict.get('gateway_error')})")
        self.verdict = verdict


log = logging.getLogger("aftraj.hooks")


def is_alarm(v: dict) -> bool:
    return v.get("decision") == "ALARM" or v.get("action") in ("pause", "halt")


def auditor_missing(v: dict) -> bool:
    """True when the verdict was given without the auditor (down, slow, unparseable reply): the
    run was judged by the fold's rules only; the gateway's `action` says how much that matters."""
    return v.get("auditor") in ("unavailable", "parse_failure")


def _transient(e: BaseException) -> bool:
    """A failure worth resending after: no answer (connection, timeout) or a 5xx/408/429."""
    status = getattr(e, "status", None)
    return status is None or status in (408, 429) or status >= 500


def _describe(e: BaseException) -> str:
    status = getattr(e, "status", None)
    return f"HTTP {status}: {getattr(e, 'problem', {}).get('detail')}" if status else f"{type(e).__name__}: {e}"


class _GatewayRun:
    """One run on the gateway: created on the first post, then each batch of new events posted
    (see the module docstring: fail open, hook-owned sequence numbers)."""

    def __init__(self, gw, *, task: str | None = None, agents=(), category: str | None = None,
                 run_id: str | None = None, fail_closed: bool = False, max_pending: int = 1000,
                 max_failures: int = 3, cooldown_s: float = 30.0):
        self.gw, self.task, self.agents, self.category = gw, task, list(agents), category
        self.run_id = run_id or f"run-{uuid.uuid4().hex[:12]}"
        self.fail_closed, self.max_pending = fail_closed, max_pending
        self.max_failures, self.cooldown_s = max_failures, cooldown_s
        self.created = self.ended = False
        self.verdicts: list[dict] = []
        self.unaudited: list[dict] = []        # verdicts given without the auditor (logged as warnings)
        self.alarm: dict | None = None
        self.halt: dict | None = None          # why the hook stops the run: the ALARM, or (fail-closed) the failure
        self.seq = 0                           # the last seq this hook gave an event
        self.pending: list = []                # events a transient failure kept from the gateway
        self.failures: list[str] = []          # each failure, described (the last 100)
        self.failed_posts = 0
        self.dropped_events = 0
        self._in_a_row = 0
        self._quiet_until = 0.0

    def _stamp(self, events) -> list:
        for ev in events:       # Event objects, or their wire dicts
            self.seq += 1
            if isinstance(ev, dict):
                ev["seq"] = self.seq
            else:
                ev.seq = self.seq
        return events

    def post(self, events, task: str | None = None, rb=None) -> dict | None:
        """Post `events` (plus, once, the run's termination when `rb` has recorded it). Returns
        the verdict, or None when nothing was posted (nothing new, the run already stopped, or
        the gateway failed: see the module docstring)."""
        events = list(events)
        if rb is not None and rb.termination is not None and not self.ended:
            events.append(rb.termination_event())
            self.ended = True
        if self.halt is not None:
            return None
        batch = self.pending + self._stamp(events)
        if not batch:
            return None
        if time.monotonic() < self._quiet_until:
            self._keep(batch)
            return None
        try:
            if not self.created:
                self.run_id = self.gw.create_run(task or self.task or "", agents=self.agents,
                                                 category=self.category, run_id=self.run_id)
                self.created = True
            v = self.gw.post_events(self.run_id, batch)
        except Exception as e:      # anything the monitoring raises: the agent must not see it
            self._failed(e, batch)
            return None
        self.pending, self._in_a_row = [], 0
        self.verdicts.append(v)
        if auditor_missing(v):
            self.unaudited.append(v)
            log.warning("run %s step %s: no auditor verdict (auditor %s: %s); action %s",
                        self.run_id, v.get("t"), v.get("auditor"), v.get("auditor_error"), v.get("action"))
        if is_alarm(v):
            self.alarm = self.halt = v
        return v

    def _keep(self, batch) -> None:
        over = len(batch) - self.max_pending
        if over > 0:
            self.dropped_events += over
            log.warning("run %s: %d unposted events dropped (more than max_pending=%d waiting)",
                        self.run_id, over, self.max_pending)
            batch = batch[over:]
        self.pending = batch

    def _failed(self, e: BaseException, batch) -> None:
        what = _describe(e)
        self.failed_posts += 1
        self._in_a_row += 1
        self.failures = (self.failures + [what])[-100:]
        if _transient(e):
            self._keep(batch)
            fate = f"{len(self.pending)} events kept for the next post"
        else:
            self.pending = []
            self.dropped_events += len(batch)
            fate = f"the gateway refused the batch: {len(batch)} events dropped"
        if self._in_a_row >= self.max_failures:
            self._quiet_until = time.monotonic() + self.cooldown_s
            fate += f"; {self._in_a_row} failures in a row: no post for {self.cooldown_s:g} s"
        if self.fail_closed:
            self.halt = {"decision": None, "t": None, "agent": None, "gateway_error": what,
                         "reason": f"the gateway is unavailable ({what}) and the hook is fail-closed"}
            log.error("run %s: gateway post failed (%s): stopping the run (fail-closed)", self.run_id, what)
            return
        log.warning("run %s: gateway post failed (%s); the agent carries on (%s)", self.run_id, what, fate)

    def convert(self, fn, *args, **kwargs) -> list:
        """`fn(*args, **kwargs)` (a framework record -> events), failing open: a record the adapter
        cannot read is logged and counted like a failed post, and gives no events."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            self.failed_posts += 1
            what = f"unreadable framework record: {_describe(e)}"
            self.failures = (self.failures + [what])[-100:]
            if self.fail_closed:
                self.halt = {"decision": None, "t": None, "agent": None, "gateway_error": what,
                             "reason": f"{what}; the hook is fail-closed"}
            log.warning("run %s: %s; the agent carries on", self.run_id, what)
            return []

    def stop_error(self) -> RunStopped:
        """The exception that stops the run (`halt` must be set)."""
        return RunStopped(self.halt) if self.alarm is not None else GatewayUnavailable(self.halt)


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
        if self.halt is not None:
            return
        name = getattr(agent, "name", None) or "agent"
        events = self.convert(_smol.add_step, self.rb, memory_step, name,
                              field=f"step {getattr(memory_step, 'step_number', '')}")
        self.post(events, task=getattr(agent, "task", None), rb=self.rb)
        if self.halt is not None and self.stopped_at_step is None:
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

    def finish(self, reason: str | None = None) -> dict | None:
        """Post the run's end, unless a message bearing TERMINATE already did: `reason`, else
        `step_limit` (AG2 ends a chat without TERMINATE only at a limit: `max_turns`,
        `max_round`, `max_consecutive_auto_reply`). Returns the verdict (None if nothing posted)."""
        if self.rb.termination is not None:
            return None
        self.rb.terminate(reason or "step_limit", note="the chat ended without TERMINATE (a turn or round limit)"
                          if reason is None else None)
        return self.post([], task=self.rb.task, rb=self.rb)

    def initiate_chat(self, sender, recipient, **kw):
        """`sender.initiate_chat(recipient, **kw)`, then `finish()`: the end of a chat that hit
        its limit is posted too (AG2 calls no hook for it). Returns AG2's ChatResult."""
        res = sender.initiate_chat(recipient, **kw)
        self.finish()
        return res

    def _before_send(self, sender, message, recipient, silent):
        m = dict(message) if isinstance(message, dict) else {"content": message}
        m.setdefault("name", sender.name)
        events = self.convert(_autogen.add_message, self.rb, m, field=f"message from {sender.name}")
        self.post(events, task=self.rb.task, rb=self.rb)
        if self.halt is not None:
            raise self.stop_error()
        return message


def _sdk_tool_error(result: Any) -> str | None:
    """The error of the tool call that just ended, as the Agents SDK records it: the function
    span's error (the SDK catches a tool's exception, answers the model with its failure text and
    attaches the error to that span; `on_tool_end` runs inside it), else its default failure text."""
    try:
        from agents.tool import default_tool_error_function
        from agents.tracing import get_current_span
    except ImportError:
        return None
    span = get_current_span()
    err = getattr(span, "error", None) if span is not None else None
    if err:
        data = err.get("data") or {}
        detail = data.get("error") if isinstance(data, dict) else None
        return strip_boilerplate(f"{err.get('message') or 'tool error'}" + (f": {detail}" if detail else ""))
    default = default_tool_error_function(None, RuntimeError())
    if isinstance(result, str) and result.strip().startswith(default.split(".")[0]):
        return strip_boilerplate(result) or "tool error"
    return None


def openai_agents_hooks(gw, **kw):
    """OpenAI Agents SDK `RunHooks` (pass as `Runner.run(..., hooks=...)`): each model answer
    (messages, tool calls with their ids), tool result (linked by the tool context's call id),
    handoff and final output is posted as it happens; on ALARM the hook raises `RunStopped`,
    which ends `Runner.run`. The returned object has the run's `.alarm`, `.verdicts`, `.rb`.

    A tool that raised (the SDK answers the model with a failure text) is posted as an error
    event. The SDK calls no hook when a run ends on `MaxTurnsExceeded` or another exception:
    run it with `hooks.run_sync(agent, input, **kw)` / `await hooks.run(...)` (or inside
    `with hooks.watch():`), which posts the end (`step_limit` for max turns, `cancelled` for
    another error) and re-raises. `kw`: `_GatewayRun`'s (task, agents, category, run_id,
    fail_closed, …)."""
    import asyncio
    import contextlib

    from agents import RunHooks
    from agents.exceptions import AgentsException, MaxTurnsExceeded

    class _Stopped(RunStopped, AgentsException):
        # an AgentsException: the SDK re-raises it as is (anything else from a tool is a UserError)
        def __init__(self, stop: RunStopped):
            RuntimeError.__init__(self, str(stop))
            self.verdict = stop.verdict
            self.run_data = None

    class _Hooks(RunHooks, _GatewayRun):
        # RunHooks' methods do nothing; these post each event and raise on ALARM.
        def __init__(self):
            _GatewayRun.__init__(self, gw, **kw)
            self.rb = RunBuilder(self.run_id, source="openai-agents")
            self.open: dict[tuple[str, str], list[str]] = {}
            self.last_agent: str | None = None

        async def _send(self, n0: int) -> None:
            await asyncio.to_thread(self.post, self.rb.events[n0:], None, self.rb)
            if self.halt is not None:
                raise _Stopped(self.stop_error())

        async def on_agent_start(self, context, agent) -> None:
            self.last_agent = agent.name

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
            err = _sdk_tool_error(result)
            if err is not None:
                self.rb.error(agent.name, err, content=str(result), tool=tool.name, call_id=cid, field="tool result")
            else:
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

        def _ended_by(self, e: BaseException) -> None:
            """Post the run's end when it ended on an exception no hook saw."""
            if self.ended or isinstance(e, RunStopped):
                return
            n0 = len(self.rb.events)
            agent = self.last_agent or "system"
            if isinstance(e, MaxTurnsExceeded):      # the SDK's step limit: the run's end
                self.rb.terminate("step_limit", note=f"{agent}: MaxTurnsExceeded: {e}")
            else:
                self.rb.error(agent, f"{type(e).__name__}: {e}", field="run")
                self.rb.terminate("cancelled")
            self.post(self.rb.events[n0:], None, self.rb)

        @contextlib.contextmanager
        def watch(self):
            try:
                yield self
            except BaseException as e:
                self._ended_by(e)
                raise

        def run_sync(self, agent, input, **run_kw):
            from agents import Runner
            with self.watch():
                return Runner.run_sync(agent, input, hooks=self, **run_kw)

        async def run(self, agent, input, **run_kw):
            from agents import Runner
            try:
                return await Runner.run(agent, input, hooks=self, **run_kw)
            except BaseException as e:
                await asyncio.to_thread(self._ended_by, e)
                raise

    return _Hooks()


class GatewaySpanProcessor:
    """An OpenTelemetry SDK SpanProcessor posting GenAI spans to the gateway, one run per trace."""

    def __init__(self, gw, *, on_alarm: Callable[[dict], Any] | None = None, category: str | None = None,
                 **run_kw):
        self.gw, self.on_alarm, self.category, self.run_kw = gw, on_alarm, category, run_kw
        self.runs: dict[str, tuple[_otel.OtelRun, _GatewayRun]] = {}
        self.alarm: dict | None = None

    def _run(self, s: dict):
        if s["trace"] not in self.runs:
            self.runs[s["trace"]] = (_otel.OtelRun(s["trace"]),
                                     _GatewayRun(self.gw, run_id=s["trace"], category=self.category, **self.run_kw))
        return self.runs[s["trace"]]

    def _post(self, s: dict, events) -> None:
        orun, grun = self._run(s)
        if grun.halt is not None:
            return
        grun.post(events, task=orun.task, rb=orun.rb)
        if grun.halt is not None and self.alarm is None:
            self.alarm = grun.halt
            if self.on_alarm is not None:
                self.on_alarm(grun.halt)

    def _span(self, span, which: str) -> None:
        try:
            s = _otel.span_from_sdk(span)
            orun, grun = self._run(s)
        except Exception as e:          # a span the reader cannot place: never into the traced code
            log.warning("span %s: not posted (%s)", getattr(span, "name", "?"), _describe(e))
            return
        events = grun.convert(getattr(orun, which), s, f"span {span.name}")
        self._post(s, events)

    def on_start(self, span, parent_context=None) -> None:
        self._span(span, "start")

    def on_end(self, span) -> None:
        self._span(span, "end")

    def _on_ending(self, span) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


__all__ = ["AG2GatewayHook", "GatewayUnavailable", "GatewaySpanProcessor", "RunStopped", "SmolagentsGatewayHook",
           "is_alarm", "openai_agents_hooks"]
