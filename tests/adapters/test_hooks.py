"""Live hooks against a real gateway (uvicorn on 127.0.0.1, scripted auditor): a smolagents run
is stopped at the step the gateway flags (no further model call), an AG2 group chat is stopped
before the flagged message is delivered, and the OTel span processor reports the ALARM; an
unflagged run goes to its end with every step posted. Needs the `adapters` extra."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from aftraj.adapters.hooks import (AG2GatewayHook, GatewaySpanProcessor, RunStopped, SmolagentsGatewayHook,
                                   openai_agents_hooks)

_spec = importlib.util.spec_from_file_location("scripted_frameworks", Path(__file__).with_name("scripted_frameworks.py"))
fw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fw)


def smol_agent(hook):
    pytest.importorskip("smolagents")
    from smolagents import ToolCallingAgent
    model = fw.smolagents_model(fw.SMOL_SCRIPT)
    a = ToolCallingAgent(tools=fw.smolagents_tools(), model=model, name="calc", verbosity_level=0,
                         max_steps=6, step_callbacks=hook.step_callbacks())
    return a, model


@pytest.mark.parametrize("trigger, stop_step, n_model_calls", [
    ("Atlantis", 2, 2),          # step 2 calls lookup("Atlantis") and fails: flagged, run stopped
    ("Paris: 2.1", 3, 3),        # step 3's observation
])
def test_smolagents_run_stops_at_the_step_the_gateway_flags(live_gateway, trigger, stop_step, n_model_calls):
    pytest.importorskip("smolagents")
    from serve.client import GatewayClient
    from smolagents.utils import AgentError
    url, key, auditor = live_gateway(trigger)
    with GatewayClient(url, key) as gw:
        hook = SmolagentsGatewayHook(gw, category="math")
        agent, model = smol_agent(hook)
        with pytest.raises(AgentError, match="interrupted"):
            agent.run("How many pens?")
        view = gw.run(hook.run_id)
    assert hook.stopped_at_step == stop_step and model.i == n_model_calls      # no model call after the flag
    assert [v["decision"] for v in hook.verdicts] == ["CONTINUE"] * (stop_step - 1) + ["ALARM"]
    flagged = hook.alarm
    assert flagged["agent"] == "calc" and trigger in flagged["reason"]
    steps = [s for s in agent.memory.steps if type(s).__name__ == "ActionStep"]
    assert len(steps) == stop_step
    assert len(view["verdicts"]) == stop_step and auditor.calls == stop_step


def test_smolagents_unflagged_run_posts_every_step(live_gateway):
    from serve.client import GatewayClient
    url, key, auditor = live_gateway("never appears")
    with GatewayClient(url, key) as gw:
        hook = SmolagentsGatewayHook(gw)
        agent, model = smol_agent(hook)
        assert agent.run("How many pens?") == "408 pens; Paris: 2.1 million"
    assert hook.alarm is None and hook.stopped_at_step is None
    # 4 action steps, then the FinalAnswerStep: the termination event
    assert len(hook.verdicts) == 5 and all(v["decision"] == "CONTINUE" for v in hook.verdicts)
    assert hook.verdicts[-1]["seq"] == 8 and hook.ended      # 7 events, then the termination
    assert [e.kind for e in hook.rb.events] == ["tool_call", "tool_result", "tool_call", "error", "tool_call",
                                                "tool_result", "final_answer"]


def test_ag2_reply_hook_stops_the_group_chat_before_the_flagged_message_is_delivered(live_gateway):
    from serve.client import GatewayClient
    executor, mgr, gc, (planner, calc) = fw.ag2_groupchat()
    url, key, auditor = live_gateway("408")
    with GatewayClient(url, key) as gw:
        hook = AG2GatewayHook(gw).attach(executor, planner, calc)
        with pytest.raises(RunStopped) as stop:
            executor.initiate_chat(mgr, message="How many pens in 17 boxes of 24?", silent=True)
    # the executor's tool response "408" is flagged: it never reached the group chat
    assert stop.value.verdict["agent"] == "executor" and stop.value.verdict["decision"] == "ALARM"
    assert [m["name"] for m in gc.messages] == ["executor", "planner", "calc"]
    assert [e.kind for e in hook.rb.events] == ["message", "message", "tool_call", "tool_result"]
    assert [v["decision"] for v in hook.verdicts] == ["CONTINUE"] * 3 + ["ALARM"]
    assert fw.AG2_SCRIPTS["calc"] == [("text", "17 * 24 = 408. TERMINATE")]     # calc never spoke again


def test_otel_span_processor_posts_spans_and_reports_the_alarm(live_gateway):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from serve.client import GatewayClient
    url, key, auditor = live_gateway("no such city")
    alarms = []
    with GatewayClient(url, key) as gw:
        proc = GatewaySpanProcessor(gw, on_alarm=alarms.append)
        tp = TracerProvider()
        tp.add_span_processor(proc)
        fw.otel_agent_run(tp)
        ((orun, grun),) = proc.finished.values()
        view = gw.run(grun.run_id)
    assert len(alarms) == 1 and proc.alarm is alarms[0] and alarms[0]["agent"] == "calc"
    # posted: message, handoff, 2 tool calls, the failing result (flagged); nothing after it
    assert [v["decision"] for v in grun.verdicts] == ["CONTINUE"] * 3 + ["ALARM"]
    assert len(view["verdicts"]) == 4
    assert [e.kind for e in orun.rb.events][:5] == ["message", "handoff", "tool_call", "tool_call", "tool_result"]


@pytest.mark.parametrize("trigger, n_model_calls, n_verdicts", [("408", 2, 4), ("never appears", 3, 6)])
def test_openai_agents_run_hooks_stop_the_run(live_gateway, trigger, n_model_calls, n_verdicts):
    from agents import Runner
    from serve.client import GatewayClient
    triage, model = fw.openai_agents_triage()
    url, key, _ = live_gateway(trigger)
    with GatewayClient(url, key) as gw:
        hooks = openai_agents_hooks(gw)
        if trigger == "408":
            with pytest.raises(RunStopped) as stop:
                Runner.run_sync(triage, "How many pens in 17 boxes of 24?", hooks=hooks)
            assert stop.value.verdict["agent"] == "math"
        else:
            assert Runner.run_sync(triage, "How many pens in 17 boxes of 24?", hooks=hooks).final_output == "408 pens"
    kinds = [e.kind for e in hooks.rb.events]
    # the tool's result "408" is flagged: the model is not asked again
    assert model.i == n_model_calls and len(hooks.verdicts) == n_verdicts
    assert kinds[:4] == ["tool_call", "handoff", "tool_call", "tool_result"]
    assert hooks.rb.events[3].parent_id == hooks.rb.events[2].event_id          # linked by the SDK's call id
    assert hooks.rb.events[1].parent_id == hooks.rb.events[0].event_id
    assert hooks.task == "How many pens in 17 boxes of 24?"
    if trigger != "408":
        assert kinds[4:] == ["message", "final_answer"] and hooks.ended and hooks.rb.final_answer == "408 pens"


@pytest.mark.parametrize("action, stops", [("warn", False), ("pause", True), ("halt", True)])
def test_a_verdict_without_the_auditor_is_logged_and_stops_by_the_gateways_action(caplog, action, stops):
    from aftraj.adapters.hooks import _GatewayRun

    class Gw:
        def create_run(self, task, **kw):
            return kw["run_id"]

        def post_events(self, run_id, events):
            return {"t": 0, "decision": "CONTINUE", "auditor": "unavailable", "action": action,
                    "auditor_error": "EndpointError: connect", "reason": None}
    run = _GatewayRun(Gw(), task="t", run_id="r")
    with caplog.at_level("WARNING", logger="aftraj.hooks"):
        v = run.post([{"event_id": "e"}])
    assert run.unaudited == [v] and "no auditor verdict" in caplog.text and "unavailable" in caplog.text
    assert (run.alarm is v) is stops


def test_openai_agents_hook_records_the_tools_own_error(live_gateway):
    """Issue 47.6: with `Runner.run_sync(..., hooks=hooks)` alone, a raising tool's error event is
    the tool's own exception (the SDK redacts both its answer to the model and its span's error:
    "Error running tool (non-fatal)"); a formatter of the caller's still answers the model."""
    pytest.importorskip("agents")
    from agents import Agent, RunConfig, Runner, function_tool, set_trace_processors
    from serve.client import GatewayClient
    set_trace_processors([])

    @function_tool
    def lookup(city: str) -> str:
        """A city's population."""
        raise KeyError(f"no city named {city}")
    model = fw.openai_agents_model([("call", "c1", "lookup", {"city": "Atlantis"}),
                                    ("call", "c2", "lookup", {"city": "Mu"}), ("text", "unknown")])
    agent = Agent(name="research", instructions="look up", tools=[lookup], model=model)
    told = []

    def mine(args):
        told.append(args.call_id)
        return f"lookup failed ({args.call_id})"

    url, key, _ = live_gateway("never appears")
    with GatewayClient(url, key) as gw:
        hooks = openai_agents_hooks(gw)
        res = Runner.run_sync(agent, "Population?", hooks=hooks, run_config=RunConfig(tool_error_formatter=mine))
    assert res.final_output == "unknown" and hooks.failures == []
    errs = [e for e in hooks.rb.events if e.kind == "error"]
    assert [e.payload["error"] for e in errs] == ["KeyError: 'no city named Atlantis'", "KeyError: 'no city named Mu'"]
    assert told == ["c1", "c2"] and errs[0].payload["content"] == "lookup failed (c1)"   # the caller's text
    # without a formatter of the caller's: the SDK's default text for the model, the real error recorded
    model.i = 0
    with GatewayClient(url, key) as gw:
        hooks = openai_agents_hooks(gw)
        Runner.run_sync(agent, "Population?", hooks=hooks)
    errs = [e for e in hooks.rb.events if e.kind == "error"]
    assert errs[0].payload["error"] == "KeyError: 'no city named Atlantis'"
    assert errs[0].payload["content"].startswith("An error occurred while running the tool")
