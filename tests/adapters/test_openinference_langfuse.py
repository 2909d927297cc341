"""Readers for where users look: OpenInference spans (Phoenix/Arize) written by the official
instrumentor around a real smolagents run, and Langfuse traces written by the Langfuse SDK; each
converts with counts equal to what the instrumentation recorded, from the SDK's own spans and
from an OTLP JSON / trace export file (`aftraj convert --from openinference|langfuse`). All
offline: in-memory span exporters, a mocked HTTP client. Needs the `adapters` extra."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import httpx
import pytest

from aftraj.adapters import read_runs
from aftraj.cli import main as cli
from aftraj.schema import iter_jsonl

_spec = importlib.util.spec_from_file_location("scripted_frameworks", Path(__file__).with_name("scripted_frameworks.py"))
fw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fw)


def kinds(t):
    return [s.meta.get("aftraj_event", {}).get("kind", s.kind) for s in t.steps]


def _otlp_json(spans, path: Path) -> Path:
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    path.write_text(json.dumps(MessageToDict(encode_spans(spans))))
    return path


@pytest.fixture
def memory_provider(otel_memory):
    return otel_memory


# --------------------------------------------------------------------------- OpenInference

def test_openinference_spans_of_a_real_smolagents_run(memory_provider, tmp_path):
    pytest.importorskip("smolagents")
    oi = pytest.importorskip("openinference.instrumentation.smolagents")
    from openinference.semconv.trace import OpenInferenceSpanKindValues, SpanAttributes
    from smolagents import ToolCallingAgent

    from aftraj.adapters.openinference import from_sdk_spans
    tp, exp = memory_provider
    model = fw.smolagents_openai_server_model(fw.SMOL_SCRIPT)
    inst = oi.SmolagentsInstrumentor()
    inst.instrument(tracer_provider=tp)
    try:
        agent = ToolCallingAgent(tools=fw.smolagents_tools(), model=model, name="calc", verbosity_level=0, max_steps=6)
        assert agent.run("How many pens?") == "408 pens; Paris: 2.1 million"
    finally:
        inst.uninstrument()
    spans = exp.get_finished_spans()

    def kind(s):
        return s.attributes.get(SpanAttributes.OPENINFERENCE_SPAN_KIND)

    llm = [s for s in spans if kind(s) == OpenInferenceSpanKindValues.LLM.value]
    tools = [s for s in spans if kind(s) == OpenInferenceSpanKindValues.TOOL.value]
    recorded_calls = [s.attributes[k] for s in llm for k in s.attributes
                      if k.endswith("tool_call.function.name") and s.attributes[k] != "final_answer"]
    ok = [s for s in tools if s.status.is_ok and s.attributes[SpanAttributes.TOOL_NAME] != "final_answer"]
    failed = [s for s in tools if not s.status.is_ok]
    assert (len(llm), len(recorded_calls), len(ok), len(failed)) == (4, 3, 2, 1)   # what the instrumentor recorded
    (t,) = from_sdk_spans(spans)
    c = Counter(kinds(t))
    assert (c["tool_call"], c["tool_result"], c["error"], c["final_answer"]) == (len(recorded_calls), len(ok),
                                                                                 len(failed), 1)
    assert kinds(t) == ["tool_call", "tool_result", "tool_call", "error", "tool_call", "tool_result", "final_answer"]
    assert t.task == "How many pens?" and t.final_answer == "408 pens; Paris: 2.1 million"
    assert t.agents == ["calc"] and t.termination == "completed" and t.source == "openinference"
    calls = [s for s in t.steps if s.kind == "tool_call"]
    assert [(s.tool, s.arguments) for s in calls] == [("multiply", {"a": 17, "b": 24}), ("lookup", {"city": "Atlantis"}),
                                                      ("lookup", {"city": "Paris"})]
    err = t.steps[3]
    assert "no such city" in err.error and err.meta["aftraj_event"]["parent_id"] == calls[1].event_id
    assert t.steps[1].meta["aftraj_event"]["parent_id"] == calls[0].event_id          # linked to the LLM's call id
    assert t.steps[0].meta["aftraj_event"]["usage"] == {"input_tokens": 10, "output_tokens": 5, "model": "scripted"}
    # the same spans as an OTLP JSON file, through the CLI
    src = _otlp_json(spans, tmp_path / "phoenix.json")
    out = tmp_path / "runs.jsonl"
    assert cli(["convert", "--from", "openinference", str(src), "--out", str(out)]) == 0
    (back,) = list(iter_jsonl(out))
    assert [(s.kind, s.agent, s.content, s.tool, s.error) for s in back.steps] == \
        [(s.kind, s.agent, s.content, s.tool, s.error) for s in t.steps]


def test_openinference_agents_handoff_retriever_and_chain_error(memory_provider):
    """Spans with OpenInference's attribute names (the semconv package's constants), as Phoenix
    receives them from any instrumentor: agent > llm, nested agent (handoff), a retriever whose
    documents carry ids, a chain error reported once."""
    pytest.importorskip("openinference.semconv")
    from openinference.semconv.trace import DocumentAttributes, MessageAttributes, SpanAttributes
    from opentelemetry.trace import Status, StatusCode

    from aftraj.adapters.openinference import from_sdk_spans
    tp, exp = memory_provider
    tr = tp.get_tracer("t")
    K = SpanAttributes.OPENINFERENCE_SPAN_KIND
    out_msg = f"{SpanAttributes.LLM_OUTPUT_MESSAGES}.0."
    with tr.start_as_current_span("planner", attributes={K: "AGENT", SpanAttributes.AGENT_NAME: "planner",
                                                         SpanAttributes.INPUT_VALUE: "Who wrote Dune?",
                                                         SpanAttributes.OUTPUT_VALUE: "Frank Herbert"}):
        with tr.start_as_current_span("llm", attributes={K: "LLM", out_msg + MessageAttributes.MESSAGE_ROLE: "assistant",
                                                         out_msg + MessageAttributes.MESSAGE_CONTENT: "Ask the researcher."}):
            pass
        with tr.start_as_current_span("researcher", attributes={K: "AGENT", SpanAttributes.AGENT_NAME: "researcher"}):
            for _ in range(2):
                doc = f"{SpanAttributes.RETRIEVAL_DOCUMENTS}.0."
                with tr.start_as_current_span("retrieve", attributes={K: "RETRIEVER", SpanAttributes.INPUT_VALUE: "Dune",
                                                                      doc + DocumentAttributes.DOCUMENT_ID: "d1",
                                                                      doc + DocumentAttributes.DOCUMENT_CONTENT: "Dune (1965)"}):
                    pass
            with tr.start_as_current_span("step", attributes={K: "CHAIN"}) as chain:
                chain.set_status(Status(StatusCode.ERROR, "parser failed"))
    (t,) = from_sdk_spans(exp.get_finished_spans())
    assert kinds(t) == ["message", "handoff", "tool_call", "tool_result", "tool_call", "tool_result", "error",
                        "final_answer"]
    assert t.steps[1].content == "handoff to researcher" and t.task == "Who wrote Dune?"
    assert t.steps[3].result_ids == ("d1",) and t.steps[5].result_ids == ("d1",)     # the documents' own ids
    assert t.steps[6].agent == "researcher" and t.steps[6].error == "parser failed"
    assert t.final_answer == "Frank Herbert"


# --------------------------------------------------------------------------- Langfuse

def _langfuse(exporter):
    lf_mod = pytest.importorskip("langfuse")
    sent = []

    def handler(req: httpx.Request) -> httpx.Response:
        sent.append((req.url.path, json.loads(req.content) if req.content else None))
        return httpx.Response(200, json={})
    lf = lf_mod.Langfuse(public_key="pk-lf-test", secret_key="sk-lf-test", base_url="http://langfuse.test",
                         span_exporter=exporter, httpx_client=httpx.Client(transport=httpx.MockTransport(handler)))
    return lf, sent


def _langfuse_run(lf):
    """An agent run recorded with the Langfuse SDK's own observation API."""
    with lf.start_as_current_observation(as_type="agent", name="planner", input={"task": "How many pens?"}) as root:
        with lf.start_as_current_observation(as_type="generation", name="chat", model="scripted",
                                             input=[{"role": "user", "content": "How many pens?"}]) as g:
            g.update(output={"role": "assistant", "content": "Ask calc.", "tool_calls": []},
                     usage_details={"input": 12, "output": 3})
        with lf.start_as_current_observation(as_type="agent", name="calc"):
            with lf.start_as_current_observation(as_type="generation", name="chat", model="scripted") as g:
                g.update(output={"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 17, "b": 24}'}},
                    {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Atlantis"}'}}]})
            with lf.start_as_current_observation(as_type="tool", name="multiply", input={"a": 17, "b": 24}) as tl:
                tl.update(output="408")
            with lf.start_as_current_observation(as_type="tool", name="lookup", input={"city": "Atlantis"}) as tl:
                tl.update(level="ERROR", status_message="no such city")
        root.update(output="408 pens")
        return root.trace_id


def test_langfuse_sdk_trace_converts_with_the_recorded_counts(tmp_path):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from aftraj.adapters.langfuse import from_sdk_spans, trace_from_spans
    from aftraj.adapters.otel import span_from_sdk
    exp = InMemorySpanExporter()
    lf, sent = _langfuse(exp)
    tid = _langfuse_run(lf)
    lf.flush()
    spans = exp.get_finished_spans()
    types = Counter(s.attributes.get("langfuse.observation.type") for s in spans)
    assert types == {"agent": 2, "generation": 2, "tool": 2}            # what the SDK recorded
    (t,) = from_sdk_spans(spans)
    assert t.id == tid and t.source == "langfuse"
    assert kinds(t) == ["message", "handoff", "tool_call", "tool_call", "tool_result", "error", "final_answer"]
    c = Counter(kinds(t))
    assert c["tool_result"] + c["error"] == types["tool"] and c["tool_call"] == 2 and c["handoff"] == types["agent"] - 1
    assert t.task == "How many pens?" and t.final_answer == "408 pens" and t.termination == "completed"
    res, err = t.steps[4], t.steps[5]
    assert res.meta["aftraj_event"]["parent_id"] == t.steps[2].event_id and res.content == "408"
    assert err.error == "no such city" and err.meta["aftraj_event"]["parent_id"] == t.steps[3].event_id
    assert t.steps[0].meta["aftraj_event"]["usage"] == {"input_tokens": 12, "output_tokens": 3, "model": "scripted"}
    # the trace export (the API's shape) and the OTLP file of the same spans give the same steps
    export = trace_from_spans([span_from_sdk(s) for s in spans])
    assert len(export["observations"]) == len(spans)
    (tmp_path / "trace.json").write_text(json.dumps(export))
    _otlp_json(spans, tmp_path / "spans.json")

    def steps(tr):
        return [(s.kind, s.agent, s.content, s.tool, s.error) for s in tr.steps]

    for src in ("trace.json", "spans.json"):
        (back,) = read_runs(tmp_path / src, "langfuse")
        assert steps(back) == steps(t), src
    out = tmp_path / "runs.jsonl"
    assert cli(["convert", "--from", "langfuse", str(tmp_path / "trace.json"), "--out", str(out)]) == 0


def test_langfuse_export_errors_name_the_field(tmp_path):
    from aftraj.adapters import AdapterError
    (tmp_path / "list.json").write_text(json.dumps({"data": [{"id": "t1", "observations": ["o1", "o2"]}]}))
    with pytest.raises(AdapterError, match=r"observations\[0\].*export the trace itself"):
        read_runs(tmp_path / "list.json", "langfuse")
    (tmp_path / "none.json").write_text(json.dumps({"id": "t1"}))
    with pytest.raises(AdapterError, match="observations"):
        read_runs(tmp_path / "none.json", "langfuse")
