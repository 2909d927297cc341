"""Hooks fail open: with the gateway down (connection refused), slow (no answer within the
client's timeout), or answering 409 / 500, a run of each framework (its own classes, scripted
models) finishes with its own answer; every failure is logged and counted, nothing reaches the
agent. `fail_closed=True` stops the run at the first failure instead. Sequence numbers are the
hook's: an AG2 message delivered after one bearing TERMINATE follows the termination (it
answered HTTP 409 out_of_order before). Needs the `adapters` extra."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
from pathlib import Path

import httpx
import pytest

from aftraj.adapters.hooks import (AG2GatewayHook, GatewaySpanProcessor, GatewayUnavailable, SmolagentsGatewayHook,
                                   openai_agents_hooks)
from serve.client import GatewayClient

_spec = importlib.util.spec_from_file_location("scripted_frameworks", Path(__file__).with_name("scripted_frameworks.py"))
fw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fw)

MODES = ("down", "slow", "409", "500")


class _Silent:
    """A TCP server that accepts connections and never answers (a gateway stuck past any timeout)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns, self.stop = [], False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self):
        self.stop = True
        for c in self.conns:
            c.close()
        self.sock.close()


def _problem(status: int, detail: str) -> httpx.Response:
    return httpx.Response(status, json={"detail": detail, "event_index": 0, "event_id": None, "field": "seq"})


@pytest.fixture
def bad_gateway():
    """make(mode) -> a GatewayClient whose gateway misbehaves in `mode`; `.calls` counts requests."""
    made = []

    def make(mode: str) -> GatewayClient:
        calls = []
        if mode == "down":
            with socket.socket() as s:            # a port nothing listens on
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            gw = GatewayClient(f"http://127.0.0.1:{port}", "k", timeout=0.5, retries=0)
        elif mode == "slow":
            srv = _Silent()
            made.append(srv)
            gw = GatewayClient(f"http://127.0.0.1:{srv.port}", "k", timeout=0.3, retries=0)
        else:
            def handler(req: httpx.Request) -> httpx.Response:
                calls.append(req.url.path)
                if mode == "409" and req.url.path == "/v1/runs":
                    return httpx.Response(201, json={"run_id": json.loads(req.content)["run_id"], "event_id": "x",
                                                     "seq": 0})
                if mode == "409":
                    return _problem(409, "out_of_order: seq 6 of event 'x' is not after the run's last seq 6")
                return _problem(500, "internal error")
            gw = GatewayClient("http://gateway.test", "k", timeout=1.0, retries=1,
                               transport=httpx.MockTransport(handler))
        gw.calls = calls
        made.append(gw)
        return gw

    yield make
    for m in made:
        m.close()


def _check_failed_open(hook, mode, caplog):
    assert hook.halt is None and hook.alarm is None and hook.verdicts == []
    assert hook.failed_posts >= 1 and len(hook.failures) == hook.failed_posts
    assert "gateway post failed" in caplog.text and "the agent carries on" in caplog.text
    want = {"down": "ConnectError", "slow": "deadline", "409": "HTTP 409", "500": "HTTP 500"}[mode]
    assert all(want in f for f in hook.failures), hook.failures
    # every event is either dropped (refused: 409) or waiting for the next post (transient, or
    # held back during the cool-down)
    assert hook.dropped_events + len(hook.pending) == hook.seq
    assert (hook.dropped_events > 0) is (mode == "409")
    assert hook.failed_posts <= hook.max_failures      # then the cool-down: no call per step


@pytest.mark.parametrize("mode", MODES)
def test_smolagents_run_finishes_when_the_gateway_misbehaves(bad_gateway, caplog, mode):
    pytest.importorskip("smolagents")
    from smolagents import ToolCallingAgent
    gw = bad_gateway(mode)
    hook = SmolagentsGatewayHook(gw)
    agent = ToolCallingAgent(tools=fw.smolagents_tools(), model=fw.smolagents_model(fw.SMOL_SCRIPT), name="calc",
                             verbosity_level=0, max_steps=6, step_callbacks=hook.step_callbacks())
    with caplog.at_level("WARNING", logger="aftraj.hooks"):
        assert agent.run("How many pens?") == "408 pens; Paris: 2.1 million"
    _check_failed_open(hook, mode, caplog)
    assert hook.seq == 8          # 7 events + the termination, numbered by the hook


@pytest.mark.parametrize("mode", MODES)
def test_ag2_group_chat_finishes_when_the_gateway_misbehaves(bad_gateway, caplog, mode):
    executor, mgr, gc, (planner, calc) = fw.ag2_groupchat()
    hook = AG2GatewayHook(bad_gateway(mode)).attach(executor, planner, calc)
    with caplog.at_level("WARNING", logger="aftraj.hooks"):
        executor.initiate_chat(mgr, message="How many pens in 17 boxes of 24?", silent=True)
    assert [m["name"] for m in gc.messages] == ["executor", "planner", "calc", "executor", "planner", "calc"]
    assert "TERMINATE" in gc.messages[-1]["content"]
    _check_failed_open(hook, mode, caplog)


@pytest.mark.parametrize("mode", MODES)
def test_openai_agents_run_finishes_when_the_gateway_misbehaves(bad_gateway, caplog, mode):
    from agents import Runner
    triage, _ = fw.openai_agents_triage()
    hooks = openai_agents_hooks(bad_gateway(mode))
    with caplog.at_level("WARNING", logger="aftraj.hooks"):
        res = Runner.run_sync(triage, "How many pens in 17 boxes of 24?", hooks=hooks)
    assert res.final_output == "408 pens"
    _check_failed_open(hooks, mode, caplog)


@pytest.mark.parametrize("mode", MODES)
def test_otel_span_processor_never_raises_into_the_traced_code(bad_gateway, caplog, mode):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    proc = GatewaySpanProcessor(bad_gateway(mode))
    tp = TracerProvider()
    tp.add_span_processor(proc)
    with caplog.at_level("WARNING", logger="aftraj.hooks"):
        fw.otel_agent_run(tp)
    ((_, grun),) = proc.finished.values()
    assert proc.alarm is None
    _check_failed_open(grun, mode, caplog)


def test_fail_closed_stops_the_run_at_the_first_failure(bad_gateway):
    pytest.importorskip("smolagents")
    from smolagents import ToolCallingAgent
    from smolagents.utils import AgentError
    hook = SmolagentsGatewayHook(bad_gateway("500"), fail_closed=True)
    model = fw.smolagents_model(fw.SMOL_SCRIPT)
    agent = ToolCallingAgent(tools=fw.smolagents_tools(), model=model, name="calc", verbosity_level=0,
                             max_steps=6, step_callbacks=hook.step_callbacks())
    with pytest.raises(AgentError, match="interrupted"):
        agent.run("How many pens?")
    assert model.i == 1 and hook.stopped_at_step == 1 and "HTTP 500" in hook.halt["gateway_error"]
    assert isinstance(hook.stop_error(), GatewayUnavailable)
    # AG2: the exception comes out of initiate_chat
    executor, mgr, gc, (planner, calc) = fw.ag2_groupchat()
    AG2GatewayHook(bad_gateway("down"), fail_closed=True).attach(executor, planner, calc)
    with pytest.raises(GatewayUnavailable, match="gateway is unavailable"):
        executor.initiate_chat(mgr, message="How many pens in 17 boxes of 24?", silent=True)
    assert len(gc.messages) == 0


def test_a_recovered_gateway_gets_the_events_it_missed(live_gateway):
    """Transient failures keep the events; the next post after recovery sends them (idempotent)."""
    from aftraj.adapters.hooks import _GatewayRun
    from aftraj.adapters.base import RunBuilder
    url, key, _ = live_gateway("never appears")
    real = GatewayClient(url, key)
    down = {"on": True}

    class Flaky:
        def create_run(self, *a, **kw):
            if down["on"]:
                raise httpx.ConnectError("refused")
            return real.create_run(*a, **kw)

        def post_events(self, *a, **kw):
            if down["on"]:
                raise httpx.ConnectError("refused")
            return real.post_events(*a, **kw)
    rb = RunBuilder("r-flaky", source="test")
    run = _GatewayRun(Flaky(), task="t", run_id="r-flaky", max_failures=10)
    for i in range(3):
        run.post([rb.message("a", f"step {i}")])
    assert run.failed_posts == 3 and len(run.pending) == 3
    down["on"] = False
    v = run.post([rb.message("a", "step 3")])
    assert v["t"] == 3 and v["accepted"] == 4 and run.pending == []      # steps 0..3, all four now stored
    assert len(real.run("r-flaky")["verdicts"]) == 1
    real.close()


def test_ag2_messages_after_terminate_follow_the_termination(live_gateway):
    """AG2's default termination check is content == "TERMINATE": an answer that only contains it
    gets a reply. The hook posted the termination at "… TERMINATE" and then the reply: it took the
    termination's seq and the gateway answered 409 out_of_order, raised out of initiate_chat."""
    pytest.importorskip("autogen")
    from autogen import ConversableAgent, UserProxyAgent
    fw.AG2_SCRIPTS.clear()
    fw.AG2_SCRIPTS["solver"] = [("text", "17 * 24 = 408. TERMINATE"), ("text", "TERMINATE")]
    solver = ConversableAgent("solver", llm_config=fw.ag2_llm_config("solver"), human_input_mode="NEVER")
    solver.register_model_client(model_client_cls=fw.AG2ScriptedClient)
    user = UserProxyAgent("user", human_input_mode="NEVER", code_execution_config=False,
                          max_consecutive_auto_reply=1, default_auto_reply="thanks")
    url, key, _ = live_gateway("never appears")
    with GatewayClient(url, key) as gw:
        hook = AG2GatewayHook(gw).attach(user, solver)
        user.initiate_chat(solver, message="How many pens in 17 boxes of 24?", silent=True)
        view = gw.run(hook.run_id)
    assert hook.failures == [] and hook.failed_posts == 0
    # messages after the "… TERMINATE" one were posted after the termination, with later seqs
    seqs = [v["seq"] for v in hook.verdicts]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    term_seq = hook.rb.termination_event().seq
    assert any(e.seq > term_seq for e in hook.rb.events), [e.seq for e in hook.rb.events]
    assert len(view["verdicts"]) == len(hook.verdicts)
