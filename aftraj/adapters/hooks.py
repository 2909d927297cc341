"""Live hooks: each framework's step hook posts the new step's events to the gateway (through
`HookClient`, below) and stops the run when a verdict says ALARM (or the gateway's
intervention action is pause/halt), as serve/example_agent.py does for a scripted loop.

    from aftraj.adapters.hooks import SmolagentsGatewayHook
    hook = SmolagentsGatewayHook("http://127.0.0.1:8080", api_key=KEY)   # or a serve.client.GatewayClient
    agent = ToolCallingAgent(tools=..., model=..., step_callbacks=hook.step_callbacks())
    agent.run(task)          # interrupted after an ALARM (smolagents' "Agent interrupted.")
    hook.alarm               # the ALARM verdict (None when the run was never flagged)
    hook.close()             # sends what an outage kept back (at most 5 s), closes the connection

- smolagents: `step_callbacks` (ActionStep, PlanningStep, FinalAnswerStep); on ALARM the hook calls
  `agent.interrupt()`, so no further step runs.
- AG2: `AG2GatewayHook.attach(*agents)` registers a `process_message_before_send` hook on each
  agent; on ALARM it raises `RunStopped` before the flagged message is delivered.
  `hook.initiate_chat(sender, recipient, **kw)` also posts the end of a chat that stopped at its
  turn or round limit (`step_limit`; AG2 calls no hook then).
- OpenAI Agents SDK: `openai_agents_hooks(gw)` is a `RunHooks` (model answers, tool results,
  tool errors, handoffs, final output); on ALARM it raises `RunStopped` out of `Runner.run`.
  `hooks.run_sync(agent, input, max_turns=…)` also posts `MaxTurnsExceeded` as the run's
  `step_limit` end. A raising tool's own exception is recorded (`on_tool_start` puts a recorder
  in the run's `RunConfig.tool_error_formatter`, chained to the caller's): the SDK's default
  failure text and its trace span say only "An error occurred while running the tool".
- OpenTelemetry: `GatewaySpanProcessor` (add it to the TracerProvider) posts each GenAI span's
  events as spans start and end (each event carries its span, `meta["otel"]`, so a verdict
  emitted for it lands on that span: aftraj/adapters/emit.py); an SDK span processor cannot
  stop the traced code, so on ALARM it records the verdict (`.alarm`), calls
  `on_alarm(verdict)` (where the caller stops its agent) and posts nothing more for that trace.

The hooks' keywords (`_GatewayRun`): `task`, `agents`, `category`, `run_id`, `api_key`,
`deadline_s`, `max_answer_bytes`, `max_failures`, `cooldown_s`, `max_pending`, `fail_closed`.

A verdict given without the auditor (`auditor: unavailable` or `parse_failure`) is logged as a
warning (logger `aftraj.hooks`) and kept in `.unaudited`; it stops the run when the gateway's
`intervention.auditor_unavailable` makes its action pause or halt.

Fail open (the default, as the Langfuse SDK does): monitoring never breaks the agent, and never
holds it longer than the hook's deadline.
- **One total deadline a step** (`deadline_s`, default 2 s): creating the run and posting the
  step's events together, connecting, sending and reading included, enforced by the hook (its
  `HookClient` cancels the call at the deadline: a gateway dripping its answer a byte at a time
  is abandoned there, not after one timeout per read). A `serve.client.GatewayClient` passed to
  a hook gives its URL and key (and its timeout, when shorter than `deadline_s`); its own
  retries and per-read timeouts are not used.
- **Any answer of any shape** is caught: an answer over `max_answer_bytes` (default 1 MiB; a
  declared `Content-Length` over it is refused unread, a streamed one abandoned there), one that is
  not JSON or not a verdict object (null, [], a string, a number), a 3xx or a 204 is a failure,
  never a verdict and never an exception in the agent.
- A failure is logged (warning, logger `aftraj.hooks`) and counted (`.failures`,
  `.failed_posts`, `.dropped_events`); events a transient failure kept from the gateway (no or
  no usable answer, 3xx, 408, 429, 5xx) wait in `.pending` (at most `max_pending`) and go with
  the next post (a batch is idempotent by event id); events the gateway refused (another 4xx)
  are dropped and counted.
- **Circuit breaker**: after `max_failures` (3) failures in a row the hook makes no call for
  `cooldown_s` (30 s): those steps cost nothing (`.skipped_posts`) and keep their events; the
  next step after the cool-down tries once.
- **`flush(timeout)` / `close()`** send the events kept during an outage (the breaker
  notwithstanding; `GatewaySpanProcessor.force_flush`/`shutdown` do it for every trace, and the
  TracerProvider calls them at exit). Call `hook.close()` when the agent is done.

Worst-case cost to the agent: `deadline_s` (+ a few ms) per step while the gateway misbehaves, at
most `max_failures` steps in a row; then nothing per step for `cooldown_s`; `flush(timeout)` at
most `timeout`. Measured with a dripping, hanging, 300 MB and malformed gateway:
benchmarks/hook_deadline.py. `fail_closed=True` instead stops the run at the first failure, as an
ALARM would, with `GatewayUnavailable` (a `RunStopped`; its `.verdict` says why).

Sequence numbers are the hook's: each event posted takes the next one (`.seq`), whatever its
builder said, so a message after the run's termination (AG2 sends after TERMINATE) follows it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from typing import Any, Callable
from urllib.parse import quote

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


DEADLINE_S = 2.0                 # the default total wait a hook step may spend on the gateway
MAX_ANSWER_BYTES = 1 << 20       # a verdict is < 10 KB; an answer past this is abandoned unread


def _transient(e: BaseException) -> bool:
    """A failure worth resending after: no (usable) answer — connection, deadline, an oversize or
    malformed answer, a 3xx — or a 408/429/5xx. Another 4xx is the gateway refusing the batch."""
    if getattr(e, "kind", None) in ("connect", "timeout", "deadline", "oversize", "malformed"):
        return True
    status = getattr(e, "status", None)
    return status is None or status < 400 or status in (408, 429) or status >= 500


def _describe(e: BaseException) -> str:
    status, kind = getattr(e, "status", None), getattr(e, "kind", None)
    if kind is not None:                           # aftraj.llm_client.EndpointError
        return f"{kind}: {e}"[:500]
    if status:
        problem = getattr(e, "problem", None)
        detail = problem.get("detail") if isinstance(problem, dict) else str(e)
        return f"HTTP {status}: {detail}"[:500]
    return f"{type(e).__name__}: {e}"[:500]


class HookClient:
    """The hooks' one way to the gateway: `aftraj.llm_client.ChatClient` (the project's HTTP
    client) on a private event-loop thread, each call cut at the deadline it is given (connect,
    send, headers and body together: a gateway that drips its answer is abandoned there), its
    answer streamed and abandoned past `max_answer_bytes`, a 3xx an error, and the answer checked
    for its shape (a verdict object; anything else is `EndpointError(kind="malformed")`).

        gw = HookClient("http://127.0.0.1:8080", api_key=KEY)      # or pass a GatewayClient / URL to a hook
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, deadline_s: float = DEADLINE_S,
                 max_answer_bytes: int = MAX_ANSWER_BYTES, retries: int = 1, transport=None):
        from aftraj.llm_client import ChatClient, ClientConfig
        self.deadline_s = float(deadline_s)
        self.chat = ChatClient(ClientConfig(str(base_url), api_key=api_key, deadline_s=self.deadline_s,
                                            retries=retries, backoff_s=0.05, max_backoff_s=0.5,
                                            max_response_bytes=max_answer_bytes, max_connections=4),
                               transport=transport)
        self._lock = threading.Lock()
        self._loop = self._thread = None

    def _loop_running(self):
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="aftraj-hook-client")
                self._thread.start()
            return self._loop

    def call(self, method: str, path: str, body: dict | None, timeout: float) -> Any:
        """One request, its answer's JSON; `EndpointError` on any failure, at `timeout` at the latest."""
        from aftraj.llm_client import EndpointError
        timeout = max(0.001, min(timeout, self.deadline_s))

        async def go():
            async with asyncio.timeout(timeout):
                return await self.chat.arequest(method, path, body)
        fut = asyncio.run_coroutine_threadsafe(go(), self._loop_running())
        try:
            return fut.result(timeout=timeout + 0.2)     # the loop cuts it at `timeout`; this is the backstop
        except (TimeoutError, concurrent.futures.TimeoutError):
            fut.cancel()
            raise EndpointError(f"{self.chat.shown_url}{path}: no complete answer within {timeout:.2f} s",
                                kind="deadline") from None
        except concurrent.futures.CancelledError:
            raise EndpointError(f"{self.chat.shown_url}{path}: cancelled", kind="deadline") from None

    def create_run(self, task: str, agents=(), category: str | None = None, run_id: str | None = None, *,
                   timeout: float | None = None) -> str:
        from aftraj.llm_client import EndpointError
        ans = self.call("POST", "/v1/runs", {"task": task, "agents": list(agents), "category": category,
                                             "run_id": run_id}, self.deadline_s if timeout is None else timeout)
        if not isinstance(ans, dict) or not isinstance(ans.get("run_id"), str) or not ans["run_id"]:
            raise EndpointError(f"POST /v1/runs: the answer is not a created run: {str(ans)[:200]}", kind="malformed")
        return ans["run_id"]

    def post_events(self, run_id: str, events, *, timeout: float | None = None) -> dict:
        from aftraj.llm_client import EndpointError
        body = {"events": [e.to_record() if hasattr(e, "to_record") else e for e in events]}
        ans = self.call("POST", f"/v1/runs/{quote(str(run_id), safe='')}/events", body,
                        self.deadline_s if timeout is None else timeout)
        if not (isinstance(ans, dict) and ans.get("decision") in ("CONTINUE", "ALARM")):
            raise EndpointError(f"POST /v1/runs/…/events: the answer is not a verdict: {str(ans)[:200]}",
                                kind="malformed")
        return ans

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        async def shutdown():
            await self.chat.aclose()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:          # calls abandoned at their deadline, still unwinding
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            await asyncio.get_running_loop().shutdown_asyncgens()
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=1.0)
        except Exception:          # a close must not raise into the agent either
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=1.0)


class _ThreadedGateway:
    """Any other object with `create_run`/`post_events` (a test double, a custom client): each call
    runs on one worker thread and the hook waits at most its deadline for it; a call still running
    at the next step makes that step fail fast (its events are kept), never queue behind it. The
    answer's size is that object's to bound."""

    def __init__(self, gw, deadline_s: float = DEADLINE_S):
        self.gw, self.deadline_s = gw, float(deadline_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aftraj-hook-call")
        self._busy: concurrent.futures.Future | None = None

    def _run(self, fn, timeout: float, *args, **kw):
        from aftraj.llm_client import EndpointError
        if self._busy is not None and not self._busy.done():
            raise EndpointError("the previous gateway call is still running", kind="deadline")
        self._busy = fut = self._pool.submit(fn, *args, **kw)
        try:
            return fut.result(timeout=max(0.001, timeout))
        except concurrent.futures.TimeoutError:
            raise EndpointError(f"no answer within {timeout:.2f} s", kind="deadline") from None

    def create_run(self, *a, timeout: float, **kw) -> str:
        from aftraj.llm_client import EndpointError
        rid = self._run(self.gw.create_run, timeout, *a, **kw)
        if not isinstance(rid, str) or not rid:
            raise EndpointError(f"create_run answered {str(rid)[:200]}, not a run id", kind="malformed")
        return rid

    def post_events(self, run_id, events, *, timeout: float) -> dict:
        from aftraj.llm_client import EndpointError
        v = self._run(self.gw.post_events, timeout, run_id, events)
        if not (isinstance(v, dict) and v.get("decision") in ("CONTINUE", "ALARM")):
            raise EndpointError(f"post_events answered {str(v)[:200]}, not a verdict", kind="malformed")
        return v

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_CLIENTS: "weakref.WeakKeyDictionary[Any, HookClient]" = weakref.WeakKeyDictionary()


def hook_client(gw, *, api_key: str | None = None, deadline_s: float = DEADLINE_S,
                max_answer_bytes: int = MAX_ANSWER_BYTES):
    """What a hook calls the gateway through: a `HookClient` for a URL, a `HookClient`, or a
    `serve.client.GatewayClient` (its URL and key; its timeout, when shorter, is the deadline; the
    hook never waits on the GatewayClient's own per-read timeouts and retries); any other object
    with `create_run`/`post_events` runs on a worker thread under the deadline."""
    import httpx
    if isinstance(gw, (HookClient, _ThreadedGateway)):
        return gw
    if isinstance(gw, str):
        return HookClient(gw, api_key, deadline_s=deadline_s, max_answer_bytes=max_answer_bytes)
    http = getattr(gw, "http", None)
    if isinstance(http, httpx.Client):
        transport = getattr(http, "_transport", None)
        if isinstance(transport, httpx.MockTransport) or type(transport) is httpx.HTTPTransport:
            try:
                return _CLIENTS[gw]
            except (KeyError, TypeError):
                pass
            auth = http.headers.get("authorization") or ""
            key = auth[7:] if auth.lower().startswith("bearer ") else api_key
            timeout = getattr(gw, "timeout", None)
            client = HookClient(str(http.base_url), key,
                                deadline_s=min(deadline_s, timeout) if isinstance(timeout, (int, float)) and timeout > 0
                                else deadline_s, max_answer_bytes=max_answer_bytes,
                                retries=min(1, max(0, int(getattr(gw, "retries", 1)))),
                                transport=transport if isinstance(transport, httpx.MockTransport) else None)
            try:
                _CLIENTS[gw] = client
            except TypeError:
                pass
            return client
    return _ThreadedGateway(gw, deadline_s)


class _GatewayRun:
    """One run on the gateway: created on the first post, then each batch of new events posted
    (see the module docstring: one deadline a step, fail open, the circuit breaker, flush/close,
    hook-owned sequence numbers)."""

    def __init__(self, gw, *, task: str | None = None, agents=(), category: str | None = None,
                 run_id: str | None = None, fail_closed: bool = False, max_pending: int = 1000,
                 max_failures: int = 3, cooldown_s: float = 30.0, deadline_s: float = DEADLINE_S,
                 max_answer_bytes: int = MAX_ANSWER_BYTES, api_key: str | None = None):
        self.gw = hook_client(gw, api_key=api_key, deadline_s=deadline_s, max_answer_bytes=max_answer_bytes)
        self._owns_client = self.gw is not gw        # made here (from a URL or a GatewayClient): close() closes it
        self.task, self.agents, self.category = task, list(agents), category
        self.deadline_s = getattr(self.gw, "deadline_s", deadline_s)
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
        self.skipped_posts = 0                 # steps the open circuit breaker did not post
        self._in_a_row = 0
        self._quiet_until = 0.0
        self._last_transient = True
        self._flushing = False
        self._lock = threading.Lock()

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
        the verdict, or None when nothing was posted (nothing new, the run already stopped, the
        circuit breaker is open, or the gateway failed: see the module docstring). Never raises,
        and returns within the deadline (`deadline_s`, default 2 s) whatever the gateway does."""
        try:
            with self._lock:
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
                    self.skipped_posts += 1
                    self._keep(batch)
                    return None
                return self._deliver(batch, task, time.monotonic() + self.deadline_s)
        except Exception as e:      # a bug of ours, an Event that will not serialise: never into the agent
            self.failed_posts += 1
            what = f"hook error: {_describe(e)}"
            self.failures = (self.failures + [what])[-100:]
            log.warning("run %s: %s; the agent carries on", self.run_id, what)
            return None

    def _deliver(self, batch: list, task: str | None, end: float) -> dict | None:
        try:
            if not self.created:
                self.run_id = self.gw.create_run(task or self.task or "", agents=self.agents,
                                                 category=self.category, run_id=self.run_id,
                                                 timeout=end - time.monotonic())
                self.created = True
            v = self.gw.post_events(self.run_id, batch, timeout=end - time.monotonic())
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

    def flush(self, timeout: float = 5.0) -> bool:
        """Send the events kept during an outage now (the circuit breaker notwithstanding), trying
        again (0.1 s, 0.2 s, … 1 s apart) until `timeout` seconds have passed; True when none is
        left waiting. Never raises; one warning when events are still waiting."""
        try:
            with self._lock:
                if not self.pending or self.halt is not None:
                    return not self.pending
                end = time.monotonic() + max(0.0, timeout)
                pause, tries, self._flushing = 0.1, 0, True
                try:
                    while self.pending and time.monotonic() < end:
                        tries += 1
                        v = self._deliver(list(self.pending), None, min(end, time.monotonic() + self.deadline_s))
                        if v is None and self.pending:
                            if not self._last_transient:
                                break
                            time.sleep(min(pause, max(0.0, end - time.monotonic())))
                            pause = min(1.0, 2 * pause)
                finally:
                    self._flushing = False
                if self.pending:
                    log.warning("run %s: flush: %d events still waiting after %d tries in %.1f s (last: %s)",
                                self.run_id, len(self.pending), tries, timeout,
                                self.failures[-1] if self.failures else "-")
                return not self.pending
        except Exception as e:
            log.warning("run %s: flush failed: %s", self.run_id, _describe(e))
            return False

    def close(self, timeout: float = 5.0) -> bool:
        """`flush(timeout)`, then release the connection the hook opened. True when nothing was lost."""
        ok = self.flush(timeout)
        if not ok and self.pending:
            log.warning("run %s: %d events never reached the gateway", self.run_id, len(self.pending))
        if self._owns_client:
            self.gw.close()
        return ok

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
        self._last_transient = _transient(e)
        if self._last_transient:
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
        (log.debug if self._flushing else log.warning)(
            "run %s: gateway post failed (%s); the agent carries on (%s)", self.run_id, what, fate)

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


@functools.cache
def _sdk_stopped() -> type:
    """`RunStopped` as an Agents SDK `AgentsException`: the SDK re-raises it as is (anything else
    raised from a hook inside a tool is wrapped in a UserError)."""
    from agents.exceptions import AgentsException

    class _Stopped(RunStopped, AgentsException):
        def __init__(self, stop: RunStopped):
            RuntimeError.__init__(self, str(stop))
            self.verdict = stop.verdict
            self.run_data = None
    return _Stopped


class _OpenAIAgentsRun(_GatewayRun):
    """What `openai_agents_hooks` returns, less the SDK's `RunHooks` base (`_sdk_hooks` mixes it
    in after this class, so these methods win over RunHooks' empty ones): each hook posts its
    events and raises `RunStopped` on ALARM."""

    def __init__(self, gw, **kw):
        _GatewayRun.__init__(self, gw, **kw)
        self.rb = RunBuilder(self.run_id, source="openai-agents")
        self.open: dict[tuple[str, str], list[str]] = {}
        self.last_agent: str | None = None
        self.tool_errors: dict[str, str] = {}     # call id -> the tool's own error (run_config)

    async def _send(self, n0: int) -> None:
        await asyncio.to_thread(self.post, self.rb.events[n0:], None, self.rb)
        if self.halt is not None:
            raise _sdk_stopped()(self.stop_error())

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
        err = self.tool_errors.pop(cid, None) if cid is not None else None
        if err is None:
            err = _sdk_tool_error(result)
        if err is not None:
            self.rb.error(agent.name, err, content=str(result), tool=tool.name, call_id=cid, field="tool result")
        else:
            self.rb.tool_result(agent.name, str(result), tool=tool.name, call_id=cid, field="tool result")
        await self._send(n0)

    def _recorder(self, theirs):
        """A `tool_error_formatter` recording each raising tool's own exception for the hook
        (by call id), then answering as `theirs` (the caller's formatter; None: the SDK's
        default text)."""
        while getattr(theirs, "_aftraj_hooks", None) is not None:    # another hooks' recorder
            theirs = theirs._theirs

        def formatter(args):
            try:
                if args.kind == "tool_exception" and args.error is not None and args.call_id:
                    e = args.error
                    self.tool_errors[args.call_id] = strip_boilerplate(f"{type(e).__name__}: {e}")[:4000]
                    if len(self.tool_errors) > 1000:
                        self.tool_errors.pop(next(iter(self.tool_errors)))
            except Exception:          # recording must never change what the model is told
                pass
            return theirs(args) if theirs is not None else None
        formatter._aftraj_hooks, formatter._theirs = self, theirs
        return formatter

    def run_config(self, base=None):
        """`base` (a RunConfig, or None) with the hook's error recorder (`_recorder`) as its
        `tool_error_formatter`. `on_tool_start` installs it on the run's own RunConfig anyway."""
        import dataclasses

        from agents import RunConfig
        base = base or RunConfig()
        if getattr(base.tool_error_formatter, "_aftraj_hooks", None) is self:
            return base
        return dataclasses.replace(base, tool_error_formatter=self._recorder(base.tool_error_formatter))

    async def on_tool_start(self, context, agent, tool) -> None:
        # the SDK answers a raising tool with a redacted text and redacts its span's error too:
        # the run's RunConfig (the tool context's) gets the recorder before the tool runs
        rc = getattr(context, "run_config", None)
        try:
            if rc is not None and getattr(rc.tool_error_formatter, "_aftraj_hooks", None) is not self:
                rc.tool_error_formatter = self._recorder(rc.tool_error_formatter)
        except Exception as e:         # an SDK without the formatter: the redacted text it is
            log.debug("tool error recorder not installed: %s", _describe(e))

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
        from agents.exceptions import MaxTurnsExceeded

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
    return _sdk_hooks()(gw, **kw)


@functools.cache
def _sdk_hooks() -> type:
    """`_OpenAIAgentsRun` with the SDK's `RunHooks` mixed in after it (its empty methods last)."""
    from agents import RunHooks

    class _Hooks(_OpenAIAgentsRun, RunHooks):
        pass
    return _Hooks


class GatewaySpanProcessor:
    """An OpenTelemetry SDK SpanProcessor posting GenAI spans to the gateway, one run per trace.
    Each span's start and end is a step: at most `deadline_s` each; `force_flush(timeout_millis)`
    and `shutdown()` (the TracerProvider calls them, at exit too) deliver the events kept during an
    outage.

    Its memory is bounded, however long the process traces: a trace is live (`.runs`) until its
    root span ends, then finished (`.finished`: its verdicts stay readable, and the events an
    outage kept wait there for `force_flush`). At most `max_runs` live traces (the least recently
    active beyond it, a trace whose root never ended, is finished) and `max_finished` finished
    ones (the oldest beyond it is forgotten; events it still kept are dropped with a warning and
    counted in `.dropped_events`). A span arriving after its trace was forgotten would start a
    second run under the trace's id, which the gateway refuses (409: the span's events are
    dropped and counted, as any refused post)."""

    def __init__(self, gw, *, on_alarm: Callable[[dict], Any] | None = None, category: str | None = None,
                 deadline_s: float = DEADLINE_S, max_answer_bytes: int = MAX_ANSWER_BYTES,
                 api_key: str | None = None, max_runs: int = 1000, max_finished: int = 100, **run_kw):
        if max_runs < 1 or max_finished < 1:
            raise ValueError(f"max_runs and max_finished must be at least 1, got {max_runs} and {max_finished}")
        self.client = hook_client(gw, api_key=api_key, deadline_s=deadline_s, max_answer_bytes=max_answer_bytes)
        self._owns_client = self.client is not gw
        self.gw, self.on_alarm, self.category, self.run_kw = gw, on_alarm, category, run_kw
        self.max_runs, self.max_finished = max_runs, max_finished
        self.runs: OrderedDict[str, tuple[_otel.OtelRun, _GatewayRun]] = OrderedDict()      # live, LRU
        self.finished: OrderedDict[str, tuple[_otel.OtelRun, _GatewayRun]] = OrderedDict()  # oldest first
        self.dropped_events = 0              # kept by finished traces forgotten before a flush
        self.alarm: dict | None = None
        self._runs_lock = threading.Lock()   # spans end on any thread

    def _run(self, s: dict):
        trace = s["trace"]
        with self._runs_lock:
            run = self.runs.get(trace) or self.finished.get(trace)
            if run is None:
                run = self.runs[trace] = (_otel.OtelRun(trace), _GatewayRun(
                    self.client, run_id=trace, category=self.category, **self.run_kw))
                while len(self.runs) > self.max_runs:
                    old = next(iter(self.runs))
                    log.warning("trace %s: no span for a while and over max_runs=%d live traces: finished "
                                "before its root span ended", old, self.max_runs)
                    self._finish(old)
            elif trace in self.runs:
                self.runs.move_to_end(trace)
            return run

    def _finish(self, trace: str) -> None:
        """Move a trace from live to finished, forgetting the oldest finished beyond the cap
        (under `_runs_lock`)."""
        run = self.runs.pop(trace, None)
        if run is None:
            return
        self.finished[trace] = run
        while len(self.finished) > self.max_finished:
            old, (_, grun) = self.finished.popitem(last=False)
            if grun.pending:
                self.dropped_events += len(grun.pending)
                log.warning("run %s: %d events kept during an outage dropped (over max_finished=%d "
                            "finished traces; call force_flush sooner)", old, len(grun.pending), self.max_finished)

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
        if which == "end" and s["parent"] is None:          # the root span: the trace is done
            with self._runs_lock:
                self._finish(s["trace"])

    def on_start(self, span, parent_context=None) -> None:
        self._span(span, "start")

    def on_end(self, span) -> None:
        self._span(span, "end")

    def _on_ending(self, span) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        end = time.monotonic() + timeout_millis / 1000
        ok = True
        with self._runs_lock:
            runs = [*self.finished.values(), *self.runs.values()]
        for _, grun in runs:
            ok = grun.flush(max(0.0, end - time.monotonic())) and ok
        return ok

    def shutdown(self) -> None:
        self.force_flush(int(1000 * self.client.deadline_s) if hasattr(self.client, "deadline_s") else 2000)
        if self._owns_client:
            self.client.close()


__all__ = ["AG2GatewayHook", "DEADLINE_S", "GatewayUnavailable", "GatewaySpanProcessor", "HookClient",
           "MAX_ANSWER_BYTES", "RunStopped", "SmolagentsGatewayHook", "hook_client", "is_alarm", "openai_agents_hooks"]
