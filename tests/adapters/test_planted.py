"""The fold's rule detectors fire on real framework runs posted live through each hook: per
framework (smolagents, AG2, OpenAI Agents SDK; their own classes, scripted models) a run with a
planted loop (the same call answering the same text), a planted error streak (a tool that
raises) and a planted step limit (no answer), each stopped or flagged at the right step. The
auditor behind the gateway always says SAFE: every ALARM here is the fold's. Before issue 24
no adapter filled `result_ids` (nine identical smolagents calls gave `insufficient_loop_evidence`),
the Agents SDK's tool exceptions were plain results and `MaxTurnsExceeded` was never posted.
Needs the `adapters` extra."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest

from aftraj.adapters.hooks import AG2GatewayHook, RunStopped, SmolagentsGatewayHook, openai_agents_hooks
from serve.client import GatewayClient

_spec = importlib.util.spec_from_file_location("scripted_frameworks", Path(__file__).with_name("scripted_frameworks.py"))
fw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fw)

# plant -> (finding kind, step of the verdict t, decisive step k): the step indices count every
# posted event (a call, its result or error, …), as the gateway does
PARIS = {"city": "Paris"}
ATLANTIS = {"city": "Atlantis"}


def _seen_everywhere(url, key, hook, auditor, t, k):
    """The run's verdicts as the gateway emitted them (OTel spans, Langfuse scores) and in its web
    view: one span and one score a verdict, the ALARM at step t blaming step k, marked on the page."""
    rid = hook.run_id
    if auditor.spans is not None:
        every = [s for s in auditor.spans.get_finished_spans() if s.attributes.get("aftraj.run_id") == rid]
        spans = [s for s in every if s.name == "aftraj.verdict"]
        assert len(spans) == len(hook.verdicts)
        # Phoenix-style (issue 47.2): every parent a span names is in the trace, and each verdict
        # hangs under its own step's span (the emitter's `aftraj.step` anchor: a hook run has no trace)
        by_id = {s.context.span_id: s for s in every}
        assert all(s.parent is None or s.parent.span_id in by_id for s in every)
        assert all(by_id[s.parent.span_id].name == "aftraj.step"
                   and by_id[s.parent.span_id].attributes["aftraj.step"] == s.attributes["aftraj.step"] for s in spans)
        assert all(s.events[0].name == "gen_ai.evaluation.result" for s in spans)
        last = spans[-1].attributes
        assert (last["aftraj.decision"], last["aftraj.step"], last["aftraj.decisive_step"]) == ("ALARM", t, k)
        assert spans[-1].status.status_code.name == "ERROR" and last["aftraj.reason"] == hook.alarm["reason"]
        assert all(s.attributes["aftraj.decision"] == "CONTINUE" for s in spans[:-1])
        assert len({s.context.trace_id for s in spans}) == 1           # one trace for the run's verdicts
        scores = [x for x in auditor.scores() if x["metadata"]["run_id"] == rid]
        assert [x["value"] for x in scores] == [v["decision"] for v in hook.verdicts]
        assert scores[-1]["metadata"]["step"] == t and scores[-1]["name"] == "aftraj.verdict"
        assert all(x["observationId"] for x in scores)          # Langfuse-style: on the step's observation
    page = httpx.get(f"{url}/ui/runs/{rid}/fragment", headers={"Authorization": f"Bearer {key}"})
    assert page.status_code == 200 and f"ALARM at step {t}" in page.text
    assert f'<tr id=step-{k} class="' in page.text and "decisive" in page.text.split(f"<tr id=step-{k} ")[1][:60]


def _flag(verdict, kind):
    assert verdict["decision"] == "ALARM" and verdict["auditor"] == "ok", verdict
    found = [f for f in verdict["findings"] if f["alarm"]]
    assert found and found[0]["kind"] == kind, verdict["findings"]
    assert verdict["reason"].startswith(kind)
    return verdict["t"], verdict["k"]


# --------------------------------------------------------------------------- smolagents

@pytest.mark.parametrize("plant, script, max_steps, kind, t, k, model_calls", [
    ("loop", [("call", "lookup", PARIS)] * 4 + [("call", "final_answer", {"answer": "x"})], 6,
     "repeated_result_loop", 5, 0, 3),          # call 0, result 1, …, result 5: the third repeat
    ("error streak", [("call", "lookup", ATLANTIS)] * 4 + [("call", "final_answer", {"answer": "x"})], 6,
     "error_streak", 5, 1, 3),                  # errors at 1, 3, 5
    ("step limit", [("call", "lookup", PARIS), ("call", "lookup", {"city": "Rome"}), ("text", "")], 2,
     "step_limit_without_answer", 6, 5, 3),     # 4: AgentMaxStepsError, 5: empty answer, 6: the end
])
def test_smolagents_planted(live_gateway, plant, script, max_steps, kind, t, k, model_calls):
    pytest.importorskip("smolagents")
    from smolagents import ToolCallingAgent
    url, key, auditor = live_gateway("never appears")
    with GatewayClient(url, key) as gw:
        hook = SmolagentsGatewayHook(gw)
        model = fw.smolagents_model(script)
        agent = ToolCallingAgent(tools=fw.smolagents_tools(), model=model, name="calc", verbosity_level=0,
                                 max_steps=max_steps, step_callbacks=hook.step_callbacks())
        try:
            agent.run("Population of the city?")
        except Exception as e:          # interrupted after the ALARM
            assert "interrupted" in str(e)
    assert hook.failures == [] and model.i == model_calls
    assert _flag(hook.alarm, kind) == (t, k)
    assert all(v["decision"] == "CONTINUE" for v in hook.verdicts[:-1])
    _seen_everywhere(url, key, hook, auditor, t, k)


# --------------------------------------------------------------------------- AG2

def _ag2_pair(calls):
    pytest.importorskip("autogen")
    from autogen import ConversableAgent, UserProxyAgent
    fw.AG2_SCRIPTS.clear()
    fw.AG2_SCRIPTS["solver"] = [("call", f"call_{i}", "lookup", a) for i, a in enumerate(calls)]
    solver = ConversableAgent("solver", llm_config=fw.ag2_llm_config("solver"), human_input_mode="NEVER")
    user = UserProxyAgent("user", human_input_mode="NEVER", code_execution_config=False)

    def lookup(city: str) -> str:
        if city == "Atlantis":
            raise ValueError("no such city")
        return f"{city}: 2.1 million"
    solver.register_for_llm(name="lookup", description="a city's population")(lookup)
    user.register_for_execution(name="lookup")(lookup)
    solver.register_model_client(model_client_cls=fw.AG2ScriptedClient)    # after register_for_llm (it rebuilds the client)
    return user, solver


@pytest.mark.parametrize("plant, calls, max_turns, kind, t, k", [
    ("loop", [PARIS] * 5, 8, "repeated_result_loop", 6, 1),        # 0: the task, call 1, result 2, …
    ("error streak", [ATLANTIS] * 5, 8, "error_streak", 6, 2),     # AG2's "Error: …" responses at 2, 4, 6
    # max_turns=2: the task, call, result, call; then the end (posted by hook.initiate_chat) at 4
    ("step limit", [PARIS, {"city": "Rome"}, {"city": "Oslo"}], 2, "step_limit_without_answer", 4, 3),
])
def test_ag2_planted(live_gateway, plant, calls, max_turns, kind, t, k):
    user, solver = _ag2_pair(calls)
    url, key, auditor = live_gateway("never appears")
    with GatewayClient(url, key) as gw:
        hook = AG2GatewayHook(gw).attach(user, solver)
        if plant == "step limit":
            hook.initiate_chat(user, solver, message="Population of the city?", max_turns=max_turns, silent=True)
            assert [e.kind for e in hook.rb.events] == ["message", "tool_call", "tool_result", "tool_call"]
        else:
            with pytest.raises(RunStopped):
                hook.initiate_chat(user, solver, message="Population of the city?", max_turns=max_turns,
                                   silent=True)
            assert len(fw.AG2_SCRIPTS["solver"]) == 2          # stopped: two scripted calls never made
    assert hook.failures == []
    assert _flag(hook.alarm, kind) == (t, k)
    _seen_everywhere(url, key, hook, auditor, t, k)


# --------------------------------------------------------------------------- OpenAI Agents SDK

def _oai(script):
    pytest.importorskip("agents")
    from agents import Agent, function_tool, set_trace_processors
    set_trace_processors([])

    @function_tool
    def lookup(city: str) -> str:
        """A city's population."""
        if city == "Atlantis":
            raise ValueError("no such city")
        return f"{city}: 2.1 million"
    model = fw.openai_agents_model(script)
    return Agent(name="research", instructions="look up", tools=[lookup], model=model), model


@pytest.mark.parametrize("plant, calls, max_turns, kind, t, k", [
    ("loop", [PARIS] * 5, 10, "repeated_result_loop", 5, 0),
    ("error streak", [ATLANTIS] * 5, 10, "error_streak", 5, 1),     # the SDK's "An error occurred …" -> error events
    ("step limit", [PARIS, {"city": "Rome"}, {"city": "Oslo"}], 2, "step_limit_without_answer", 4, 3),
])
def test_openai_agents_planted(live_gateway, plant, calls, max_turns, kind, t, k):
    from agents.exceptions import MaxTurnsExceeded
    agent, model = _oai([("call", f"c{i}", "lookup", a) for i, a in enumerate(calls)])
    url, key, auditor = live_gateway("never appears")
    with GatewayClient(url, key) as gw:
        hooks = openai_agents_hooks(gw)
        with pytest.raises(MaxTurnsExceeded if plant == "step limit" else RunStopped):
            hooks.run_sync(agent, "Population of the city?", max_turns=max_turns)
    assert hooks.failures == []
    assert _flag(hooks.alarm, kind) == (t, k)
    _seen_everywhere(url, key, hooks, auditor, t, k)
    if plant == "error streak":
        errs = [e for e in hooks.rb.events if e.kind == "error"]
        assert len(errs) == 3 and all("try again" not in e.payload["error"].lower() for e in errs)
        # the tool's own exception (issue 47.6), not the SDK's redacted "Error running tool (non-fatal)"
        assert all(e.payload["error"] == "ValueError: no such city" for e in errs), [e.payload for e in errs]
        calls = [x for x in hooks.rb.events if x.kind == "tool_call"]
        assert all(e.parent_id == c.event_id for e, c in zip(errs, calls, strict=True))
    if plant == "step limit":
        assert hooks.rb.termination == "step_limit" and "MaxTurnsExceeded" in hooks.rb.termination_event().payload["content"]


def test_nine_identical_smolagents_calls_are_a_loop_offline():
    """The issue's own case, converted offline and folded: a loop, not insufficient evidence."""
    pytest.importorskip("smolagents")
    from smolagents import ToolCallingAgent

    from aftraj.adapters.smolagents import from_memory
    from aftraj.fold import fold_trajectory
    script = [("call", "lookup", PARIS)] * 9 + [("call", "final_answer", {"answer": "2.1 million"})]
    a = ToolCallingAgent(tools=fw.smolagents_tools(), model=fw.smolagents_model(script), name="calc",
                         verbosity_level=0, max_steps=12)
    a.run("Population of Paris?")
    tf = fold_trajectory(from_memory(a.memory.steps, agent="calc"))
    kinds = [f.kind for f in tf.state.findings]
    assert "repeated_result_loop" in kinds and "insufficient_loop_evidence" not in kinds
    # and a run of nine different lookups is not
    script = [("call", "lookup", {"city": f"C{i}"}) for i in range(9)] + [("call", "final_answer", {"answer": "x"})]
    a = ToolCallingAgent(tools=fw.smolagents_tools(), model=fw.smolagents_model(script), name="calc",
                         verbosity_level=0, max_steps=12)
    a.run("Populations?")
    assert [f.kind for f in fold_trajectory(from_memory(a.memory.steps, agent="calc")).state.findings] == []
