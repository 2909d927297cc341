"""Framework runs -> trajectories, on records the frameworks themselves produce (smolagents,
AG2, OpenAI Agents SDK, OpenTelemetry SDK + the official OTLP encoder), each driven by a scripted
model the framework accepts: counts of steps, tool calls, results and agents; call ids, handoffs,
errors and termination kept; JSONL and event round trips; `aftraj convert --from …`; errors that
name the file and field. Needs the `adapters` extra (each test skips without its framework)."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from aftraj.adapters import ADAPTERS, AdapterError, read_runs
from aftraj.cli import main as cli
from aftraj.events import events_to_steps, trajectory_to_events
from aftraj.schema import iter_jsonl, write_jsonl

_spec = importlib.util.spec_from_file_location("scripted_frameworks", Path(__file__).with_name("scripted_frameworks.py"))
fw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fw)


def kinds(t):
    """Event kinds of a trajectory's steps (handoff/error/thinking kept under meta)."""
    return [s.meta.get("aftraj_event", {}).get("kind", s.kind) for s in t.steps]


def round_trips(t, tmp_path):
    out = tmp_path / f"{t.source}.jsonl"
    write_jsonl([t], out)
    (back,) = list(iter_jsonl(out))
    assert back == t
    evs = trajectory_to_events(t)
    assert events_to_steps(evs[:-1], t.id) == list(t.steps)
    assert evs[-1].kind == "termination" and evs[-1].payload["reason"] == t.termination


def convert(tmp_path, fmt, src) -> tuple[int, list]:
    out = tmp_path / "out.jsonl"
    rc = cli(["convert", "--from", fmt, str(src), "--out", str(out)])
    return rc, (list(iter_jsonl(out)) if rc == 0 else [])


# --------------------------------------------------------------------------- smolagents

def smol_run(script, max_steps=6):
    pytest.importorskip("smolagents")
    from smolagents import ToolCallingAgent
    a = ToolCallingAgent(tools=fw.smolagents_tools(), model=fw.smolagents_model(script), name="calc",
                         verbosity_level=0, max_steps=max_steps)
    return a


def test_smolagents_memory_steps_keep_calls_results_errors_and_the_answer(tmp_path):
    from aftraj.adapters.smolagents import from_memory
    a = smol_run(fw.SMOL_SCRIPT)
    assert a.run("How many pens?") == "408 pens; Paris: 2.1 million"
    t = from_memory(a.memory.steps, agent=a.name, run_id="r1")
    assert kinds(t) == ["tool_call", "tool_result", "tool_call", "error", "tool_call", "tool_result",
                        "final_answer"]
    calls = [s for s in t.steps if s.kind == "tool_call"]
    assert [(s.tool, s.arguments, s.event_id) for s in calls] == [
        ("multiply", {"a": 17, "b": 24}, "r1/call_1"), ("lookup", {"city": "Atlantis"}, "r1/call_2"),
        ("lookup", {"city": "Paris"}, "r1/call_3")]
    res = [s for s in t.steps if s.kind == "tool_result"]
    assert [(s.content, s.tool, s.meta["aftraj_event"]["parent_id"]) for s in res] == [
        ("408", "multiply", "r1/call_1"), ("Paris: 2.1 million", "lookup", "r1/call_3")]
    # smolagents records no result ids: each result gets one derived from its call and its text
    from aftraj.adapters.base import derived_result_ids
    assert [s.result_ids for s in res] == [tuple(derived_result_ids("multiply", {"a": 17, "b": 24}, "408")),
                                           tuple(derived_result_ids("lookup", {"city": "Paris"}, "Paris: 2.1 million"))]
    assert res[0].result_ids != res[1].result_ids
    err = t.steps[3]
    assert err.error.startswith("AgentToolExecutionError") and "no such city" in err.error
    assert "try again" not in err.error.lower() and "Please try again" in err.content   # boilerplate kept out of the error
    from aftraj.fold import fold_trajectory
    outcomes = [c.outcome for c in fold_trajectory(t).state.tool_calls]
    assert outcomes == ["ok", "error", "ok"]          # "Please try again" no longer reads as a retryable error
    assert err.meta["aftraj_event"]["parent_id"] == "r1/call_2"
    assert (t.agents, t.task, t.final_answer, t.termination) == (["calc"], "How many pens?",
                                                                "408 pens; Paris: 2.1 million", "completed")
    assert t.steps[0].meta["aftraj_event"]["usage"] == {"input_tokens": 10, "output_tokens": 5}
    assert t.steps[0].meta["aftraj_event"]["ts"] == a.memory.steps[1].timing.start_time
    assert t.label.provenance == {"unlabeled": True} and t.meta["unlabeled"] is True
    round_trips(t, tmp_path)
    # the same run from its JSON dump (get_full_steps), through the CLI
    src = tmp_path / "memory.json"
    src.write_text(json.dumps({"agent": "calc", "run_id": "r1", "steps": a.memory.get_full_steps()}, default=str))
    rc, (back,) = convert(tmp_path, "smolagents", src)
    assert rc == 0 and back.steps == t.steps and back.final_answer == t.final_answer


def test_smolagents_max_steps_is_a_step_limit():
    from aftraj.adapters.smolagents import from_memory
    a = smol_run([("call", "multiply", {"a": 1, "b": 2}), ("call", "multiply", {"a": 2, "b": 3}),
                  ("text", "I give up: 6")], max_steps=2)
    a.run("keep multiplying")
    t = from_memory(a.memory.steps, agent=a.name, run_id="r2")
    assert t.termination == "step_limit" and t.final_answer == "I give up: 6"
    assert Counter(kinds(t))["tool_call"] == 2 and "error" in kinds(t)


def test_smolagents_planning_step_is_thinking():
    from aftraj.adapters.smolagents import from_memory
    a = smol_run([("text", "1. multiply 17 by 24\n2. answer"), ("call", "multiply", {"a": 17, "b": 24}),
                  ("call", "final_answer", {"answer": "408"})])
    a.planning_interval = 5
    assert str(a.run("How many pens?")) == "408"
    assert [type(s).__name__ for s in a.memory.steps] == ["TaskStep", "PlanningStep", "ActionStep", "ActionStep"]
    t = from_memory(a.memory.steps, agent="calc", run_id="r4")
    assert kinds(t) == ["thinking", "tool_call", "tool_result", "final_answer"]
    assert "1. multiply 17 by 24\n2. answer" in t.steps[0].content      # PlanningStep.plan, as smolagents wrote it


def test_smolagents_managed_agent_call_is_a_handoff():
    from aftraj.adapters.smolagents import from_memory
    pytest.importorskip("smolagents")
    from smolagents import ToolCallingAgent
    worker = ToolCallingAgent(tools=fw.smolagents_tools(), name="worker", description="multiplies",
                              model=fw.smolagents_model([("call", "multiply", {"a": 3, "b": 4}),
                                                         ("call", "final_answer", {"answer": "12"})]),
                              verbosity_level=0)
    boss = ToolCallingAgent(tools=[], managed_agents=[worker], name="boss", verbosity_level=0,
                            model=fw.smolagents_model([("call", "worker", {"task": "3*4"}),
                                                       ("call", "final_answer", {"answer": "12"})]))
    assert str(boss.run("what is 3*4")) == "12"
    t = from_memory(boss.memory.steps, agent="boss", run_id="r3", managed_agents=["worker"])
    hand = t.steps[0]
    assert kinds(t)[0] == "handoff" and hand.meta["aftraj_event"]["payload"] == {"to": "worker"}
    assert hand.content == "handoff to worker: 3*4"     # a real step in the prompt, with the task handed over


# --------------------------------------------------------------------------- AG2

def test_ag2_group_chat_messages(tmp_path):
    from aftraj.adapters.autogen import from_messages
    executor, mgr, gc, _ = fw.ag2_groupchat()
    executor.initiate_chat(mgr, message="How many pens in 17 boxes of 24?", silent=True)
    t = from_messages(gc.messages, run_id="g1")
    assert kinds(t) == ["message", "message", "tool_call", "tool_result", "message", "message"]
    assert t.agents == ["executor", "planner", "calc"] and t.task == "How many pens in 17 boxes of 24?"
    call, res = t.steps[2], t.steps[3]
    assert (call.agent, call.tool, call.arguments, call.event_id, call.content) == (
        "calc", "multiply", {"a": 17, "b": 24}, "g1/call_a", "")          # AG2's "None" content is empty
    assert (res.agent, res.tool, res.content, res.meta["aftraj_event"]["parent_id"]) == (
        "executor", "multiply", "408", "g1/call_a")
    assert t.termination == "completed" and t.final_answer is None     # AG2 marks no final answer
    round_trips(t, tmp_path)
    src = tmp_path / "chat.json"
    src.write_text(json.dumps({"run_id": "g1", "messages": gc.messages}))
    rc, (back,) = convert(tmp_path, "autogen", src)
    assert rc == 0 and back.steps == t.steps


def test_agentchat_swarm_task_result(tmp_path):
    """AutoGen AgentChat (autogen-agentchat, installed --no-deps: see scripts/setup.sh): a Swarm
    whose researcher's first tool call fails, then hands off to the writer."""
    pytest.importorskip("autogen_agentchat")
    import asyncio

    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination, TextMentionTermination
    from autogen_agentchat.teams import Swarm

    from aftraj.adapters.autogen import from_messages

    def lookup(city: str) -> str:
        """Look up a city's population."""
        if city == "Atlantis":
            raise ValueError("no such city")
        return f"{city}: 2.1 million"

    def team(writer_says, max_messages=20):
        researcher = AssistantAgent("researcher", tools=[lookup], handoffs=["writer"], model_client=fw.agentchat_client(
            [("call", "c1", "lookup", {"city": "Atlantis"}), ("call", "c2", "lookup", {"city": "Paris"}),
             ("call", "c3", "transfer_to_writer", {})]))
        writer = AssistantAgent("writer", handoffs=["researcher"], model_client=fw.agentchat_client(writer_says))
        return Swarm([researcher, writer], termination_condition=TextMentionTermination("TERMINATE")
                     | MaxMessageTermination(max_messages))

    res = asyncio.run(team([("text", "Paris has 2.1 million people. TERMINATE")]).run(
        task="Find the population of Paris"))
    t = from_messages(res.messages, run_id="ac1", stop_reason=res.stop_reason)
    assert kinds(t) == ["message", "tool_call", "error", "message", "tool_call", "tool_result", "message",
                        "tool_call", "tool_result", "handoff", "message"]
    assert t.agents == ["user", "researcher", "writer"] and t.task == "Find the population of Paris"
    err, ok, hand = t.steps[2], t.steps[5], t.steps[9]
    assert (err.error, err.tool, err.meta["aftraj_event"]["parent_id"]) == ("no such city", "lookup", "ac1/c1")
    assert (ok.content, ok.meta["aftraj_event"]["parent_id"]) == ("Paris: 2.1 million", "ac1/c2")
    assert hand.agent == "researcher" and hand.meta["aftraj_event"]["payload"] == {"to": "writer"}
    assert t.steps[1].meta["aftraj_event"]["usage"] == {"input_tokens": 10, "output_tokens": 5}
    assert t.termination == "completed" and Counter(kinds(t))["tool_call"] == 3
    round_trips(t, tmp_path)
    src = tmp_path / "task_result.json"
    src.write_text(json.dumps({"run_id": "ac1", **res.model_dump(mode="json")}))
    rc, (back,) = convert(tmp_path, "autogen", src)
    assert rc == 0 and back.steps == t.steps
    # the max-messages condition: a step limit
    res = asyncio.run(team([], max_messages=3).run(task="Paris?"))   # task + 2 tool summaries
    t = from_messages(res.messages, run_id="ac2", stop_reason=res.stop_reason)
    assert t.termination == "step_limit" and "Maximum" in t.meta["stop_reason"]


# --------------------------------------------------------------------------- OpenAI Agents SDK

def oai_run(script, max_turns=10, responses_api=False):
    pytest.importorskip("agents")
    from agents import Agent, RunConfig, Runner, function_tool, set_trace_processors
    coll = fw.TraceCollector()
    set_trace_processors([coll])

    @function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        if a < 0:
            raise ValueError("negative")
        return a * b
    model = fw.openai_agents_model(script, responses_api=responses_api)
    math = Agent(name="math", instructions="do math", tools=[multiply], model=model)
    triage = Agent(name="triage", instructions="route", handoffs=[math], model=model)
    try:
        res = Runner.run_sync(triage, "How many pens in 17 boxes of 24?", max_turns=max_turns,
                              run_config=RunConfig(workflow_name="pens"))
    except Exception as e:   # noqa: BLE001 - the run's own error is part of what is traced
        res = e
    return res, coll.records


def test_openai_agents_trace_export(tmp_path):
    from aftraj.adapters.openai_agents import from_records
    res, recs = oai_run([("call", "call_h", "transfer_to_math", {}),
                         ("call", "call_m", "multiply", {"a": 17, "b": 24}), ("text", "408 pens")])
    assert res.final_output == "408 pens"
    t = from_records(recs)
    assert kinds(t) == ["tool_call", "handoff", "tool_call", "tool_result", "message"]
    assert t.agents == ["triage", "math"] and t.task == "How many pens in 17 boxes of 24?"
    hand = t.steps[1]
    assert hand.agent == "triage" and hand.meta["aftraj_event"]["payload"] == {"to": "math"}
    assert hand.meta["aftraj_event"]["parent_id"] == t.steps[0].event_id
    res_step = t.steps[3]
    assert (res_step.tool, res_step.content, res_step.meta["aftraj_event"]["parent_id"]) == (
        "multiply", "408", t.steps[2].event_id)
    assert t.steps[2].event_id.endswith("/call_m") and len(res_step.result_ids) == 1    # derived (the SDK records none)
    assert hand.content == "handoff to math"
    assert (t.termination, t.final_answer, t.meta["workflow_name"]) == ("completed", "408 pens", "pens")
    round_trips(t, tmp_path)
    src = tmp_path / "trace.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rc, (back,) = convert(tmp_path, "openai-agents", src)
    assert rc == 0 and back.steps == t.steps


def test_openai_agents_trace_without_generation_spans():
    """The SDK's Responses-API model records `response` spans (an id, no text): tool calls then come
    from the function spans, and no message or final answer is invented."""
    from aftraj.adapters.openai_agents import from_records
    res, recs = oai_run([("call", "call_h", "transfer_to_math", {}),
                         ("call", "call_m", "multiply", {"a": 17, "b": 24}), ("text", "408 pens")])
    t = from_records([r for r in recs if (r.get("span_data") or {}).get("type") != "generation"])
    assert kinds(t) == ["handoff", "tool_call", "tool_result"]
    assert (t.steps[1].agent, t.steps[1].tool, t.steps[1].arguments) == ("math", "multiply", {"a": 17, "b": 24})
    assert t.steps[2].meta["aftraj_event"]["parent_id"] == t.steps[1].event_id and t.task == ""
    assert (t.termination, t.final_answer, t.meta["task_recorded"]) == ("completed", None, False)


def test_openai_agents_tool_error_and_max_turns():
    from aftraj.adapters.openai_agents import from_records
    res, recs = oai_run([("call", "call_h", "transfer_to_math", {}),
                         ("call", "call_m", "multiply", {"a": -1, "b": 2}),
                         ("call", "call_n", "multiply", {"a": 2, "b": 2})], max_turns=3)
    assert type(res).__name__ == "MaxTurnsExceeded"
    t = from_records(recs)
    bad = next(s for s in t.steps if s.kind == "tool_result")
    assert bad.error is not None and bad.tool == "multiply"
    assert t.termination == "step_limit" and t.final_answer is None and "error" in kinds(t)


# --------------------------------------------------------------------------- OpenTelemetry

def otel_export(tmp_path):
    pytest.importorskip("opentelemetry.sdk")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.common")
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exp = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exp))
    fw.otel_agent_run(tp)
    src = tmp_path / "spans.json"
    src.write_text(json.dumps(MessageToDict(encode_spans(exp.get_finished_spans()))))
    return src, exp.get_finished_spans()


def test_otel_genai_spans_from_an_otlp_json_export(tmp_path):
    src, spans = otel_export(tmp_path)
    (t,) = read_runs(src, "otel")
    assert kinds(t) == ["message", "handoff", "tool_call", "tool_call", "tool_result", "tool_result", "message",
                        "final_answer"]
    assert t.id == format(spans[0].context.trace_id, "032x")          # hex, as OTLP JSON spells it
    assert t.agents == ["planner", "calc"] and t.task == "How many pens in 17 boxes of 24?"
    failed, ok = t.steps[4], t.steps[5]
    assert (failed.tool, failed.error, failed.meta["aftraj_event"]["parent_id"]) == ("lookup", "no such city",
                                                                                     f"{t.id}/c1")
    assert (ok.tool, ok.content, ok.error) == ("multiply", "408", None)
    assert t.steps[0].meta["aftraj_event"]["usage"] == {"input_tokens": 12, "output_tokens": 4, "model": "scripted"}
    chat = next(sp for sp in spans if sp.name == "chat scripted")
    assert t.steps[0].meta["aftraj_event"]["ts"] == chat.start_time / 1e9
    assert (t.termination, t.final_answer) == ("completed", "408 pens")
    round_trips(t, tmp_path)
    rc, (back,) = convert(tmp_path, "otel", src)
    assert rc == 0 and back == t
    # without the chat spans (an instrumentation that records tools only): calls come from the tool spans
    from aftraj.adapters.otel import from_spans, span_from_sdk
    (t2,) = [from_spans([span_from_sdk(sp) for sp in spans if not sp.name.startswith("chat")])]
    assert kinds(t2) == ["handoff", "tool_call", "tool_result", "tool_call", "tool_result", "final_answer"]
    assert t2.steps[2].meta["aftraj_event"]["parent_id"] == t2.steps[1].event_id and t2.task == ""
    assert (t2.steps[1].tool, t2.steps[1].arguments, t2.steps[2].error) == ("lookup", None, "no such city")


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("fmt, doc, field", [
    ("smolagents", {"steps": [{"step_number": 1, "tool_calls": [{"id": "c"}]}]}, "steps[0].tool_calls[0].function"),
    ("smolagents", {"steps": [{"what": 1}]}, "steps[0]"),
    ("smolagents", {"nosteps": []}, "steps"),
    ("autogen", [{"content": "hi", "role": "user"}], "messages[0].name"),
    ("autogen", [{"content": "x", "name": "a", "tool_calls": [{"id": "c", "function": {"name": ""}}]}],
     "messages[0].tool_calls[0].tool"),
    ("openai-agents", [{"object": "trace.span", "id": "s", "trace_id": "t"}], "records[0].span_data"),
    ("openai-agents", [{"object": "trace.span", "id": "s"}], "records[0].trace_id"),
    ("otel", {"resourceSpans": [{"scopeSpans": [{"spans": [{"spanId": "ab"}]}]}]},
     "resourceSpans[0].scopeSpans[0].spans[0].traceId"),
    ("otel", {"spans": []}, "resourceSpans"),
])
def test_bad_input_names_the_file_and_the_field(tmp_path, capsys, fmt, doc, field):
    src = tmp_path / "bad.json"
    src.write_text(json.dumps(doc))
    with pytest.raises(AdapterError) as e:
        read_runs(src, fmt)
    assert e.value.source == str(src) and field in e.value.field, str(e.value)
    rc, _ = convert(tmp_path, fmt, src)
    err = capsys.readouterr().err
    assert rc == 2 and str(src) in err and field in err


def test_not_json_and_unknown_source(tmp_path):
    src = tmp_path / "bad.json"
    src.write_text("{not json")
    with pytest.raises(AdapterError, match="invalid JSON"):
        read_runs(src, "otel")
    with pytest.raises(AdapterError, match="unknown source"):
        read_runs(src, "crewai")
    with pytest.raises(AdapterError, match="no such file"):
        read_runs(tmp_path / "missing.json", "autogen")
    assert set(ADAPTERS) == {"autogen", "smolagents", "openai-agents", "otel", "openinference", "langfuse"}
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps([{"content": "hi", "name": "a"}]))
    assert cli(["convert", "--from", "autogen", str(ok), "--out", str(tmp_path / "o.jsonl")]) == 0
    assert cli(["convert", "--from", "autogen", str(ok), "--out", str(tmp_path / "o.jsonl"), "--skip-invalid"]) == 2


def test_openai_agents_responses_model_trace_warns_what_is_missing(tmp_path):
    """The SDK's default Responses-API model traces only response ids: the reader keeps the tool
    calls, results and handoff, and warns that task, messages and final answer are missing."""
    from aftraj.adapters.openai_agents import ContentMissing, from_records
    res, recs = oai_run([("call", "call_h", "transfer_to_math", {}),
                         ("call", "call_m", "multiply", {"a": 17, "b": 24}), ("text", "408 pens")], responses_api=True)
    assert res.final_output == "408 pens"
    assert any(r.get("span_data", {}).get("type") == "response" for r in recs)
    with pytest.warns(ContentMissing, match=r"3 response span\(s\) and no generation span.*chat_completions"):
        t = from_records(recs)
    assert kinds(t) == ["handoff", "tool_call", "tool_result"]       # no message, no answer
    assert t.task == "" and t.final_answer is None and "task, the agents' messages" in t.meta["content_missing"]
    # the chat-completions trace of the same run holds everything: no warning
    import warnings
    _, recs = oai_run([("call", "call_h", "transfer_to_math", {}),
                       ("call", "call_m", "multiply", {"a": 17, "b": 24}), ("text", "408 pens")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContentMissing)
        assert "content_missing" not in from_records(recs).meta
