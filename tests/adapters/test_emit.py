"""Verdicts as OTel spans and Langfuse scores (aftraj/adapters/emit.py), through the official
SDKs with in-memory exporters / a mocked HTTP client (no network): attributes, status, one trace
a run, idempotent score ids, failing open; and `aftraj eval --emit`. The gateway's emission of
live framework runs is checked in test_planted.py (conftest's gateway emits). Needs the
`adapters` extra."""

from __future__ import annotations

import json

import httpx
import pytest

from aftraj.adapters.emit import Emitters, LangfuseVerdictEmitter, OtelVerdictEmitter, parse_spec, prediction_verdicts

CONT = {"run_id": "run-1", "seq": 1, "t": 0, "decision": "CONTINUE", "k": None, "agent": None, "reason": None,
        "latency_ms": 12.5, "auditor": "ok", "action": "none", "findings": []}
ALARM = {"run_id": "run-1", "seq": 2, "t": 1, "decision": "ALARM", "k": 1, "agent": "calc", "reason": "418 is wrong",
         "latency_ms": 30.0, "auditor": "ok", "action": "halt", "confidence": 0.93,
         "findings": [{"kind": "error_streak", "alarm": True, "steps": [1]}]}


@pytest.fixture
def otel(otel_memory):
    return otel_memory


@pytest.fixture
def langfuse():
    lf_mod = pytest.importorskip("langfuse")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    sent = []

    def api(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/api/public/scores":
            sent.extend(json.loads(req.content))
        return httpx.Response(200, json={})
    import time
    lf = lf_mod.Langfuse(public_key=f"pk-lf-emit-{time.monotonic_ns()}", secret_key="sk", base_url="http://langfuse.test",
                         span_exporter=InMemorySpanExporter(), httpx_client=httpx.Client(transport=httpx.MockTransport(api)))
    yield lf, sent
    lf.shutdown()


def _verdicts(exp):
    return [s for s in exp.get_finished_spans() if s.name == "aftraj.verdict"]


def test_otel_spans_carry_the_verdict(otel):
    tp, exp = otel
    em = OtelVerdictEmitter(tp)
    em.emit(CONT, tenant="acme", run_id="run-1", model="auditor-7b")
    em.emit(ALARM, tenant="acme", run_id="run-1", model="auditor-7b")
    a, b = _verdicts(exp)
    assert dict(b.attributes) == {"aftraj.step": 1, "aftraj.decision": "ALARM", "aftraj.agent": "calc",
                                  "aftraj.reason": "418 is wrong", "aftraj.latency_ms": 30.0,
                                  "aftraj.model": "auditor-7b", "aftraj.run_id": "run-1", "aftraj.tenant": "acme",
                                  "aftraj.decisive_step": 1, "aftraj.auditor": "ok", "aftraj.confidence": 0.93,
                                  "aftraj.action": "halt", "aftraj.findings": ("error_streak",)}
    assert "aftraj.agent" not in a.attributes and a.attributes["aftraj.decision"] == "CONTINUE"
    assert b.status.status_code.name == "ERROR" and b.status.description == "418 is wrong"
    assert a.status.status_code.name == "UNSET"
    assert a.context.trace_id == b.context.trace_id                # one trace for a run's verdicts
    # the GenAI conventions' evaluation event, on the verdict span
    (ev,) = b.events
    assert ev.name == "gen_ai.evaluation.result" and dict(ev.attributes) == {
        "gen_ai.evaluation.name": "aftraj.verdict", "gen_ai.evaluation.score.value": 0.93,
        "gen_ai.evaluation.score.label": "ALARM", "gen_ai.evaluation.explanation": "418 is wrong"}
    assert dict(a.events[0].attributes)["gen_ai.evaluation.score.value"] == 0.0
    # a step with its own span (the event carries it): the verdict is that span's child, in its trace
    tid, sid = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    step = {"seq": 1, "meta": {"source": "otel", "otel": {"trace_id": tid, "span_id": sid}}}
    em.emit(CONT, tenant="acme", run_id="run-2", step=[{"seq": 0, "meta": {}}, step])
    last = exp.get_finished_spans()[-1]
    assert format(last.context.trace_id, "032x") == tid and format(last.parent.span_id, "016x") == sid
    # the request's raw JSON body works as well (the gateway parses nothing more unless it emits)
    body = json.dumps({"events": [{"seq": 0, "meta": {}}, step]}).encode()
    em.emit({**CONT, "seq": 1}, tenant="acme", run_id="run-2", step=body)
    assert format(exp.get_finished_spans()[-1].parent.span_id, "016x") == sid
    from aftraj.adapters.emit import step_span
    assert step_span(b"not json") is None and step_span(b"[1, 2]") is None and step_span('{"events": 3}') is None
    # a resent verdict is the same span (ids derived, not random)
    n = len(_verdicts(exp))
    em.emit(ALARM, tenant="acme", run_id="run-1", model="auditor-7b")
    assert _verdicts(exp)[n].context.span_id == b.context.span_id


def test_two_tenants_same_run_id_never_share_an_id(otel, langfuse):
    """Issue 45.1: tenant B's run `prod-7` wrote A's `prod-7` trace and score ids (A's ALARM became
    B's CONTINUE). Every id is now derived from (tenant, run)."""
    tp, exp = otel
    lf, sent = langfuse
    ot, lfe = OtelVerdictEmitter(tp), LangfuseVerdictEmitter(lf)
    for tenant, v in (("tenant-a", ALARM), ("tenant-b", {**ALARM, "decision": "CONTINUE", "reason": None})):
        ot.emit(v, tenant=tenant, run_id="prod-7")
        lfe.emit(v, tenant=tenant, run_id="prod-7")
    lfe.flush()
    a, b = _verdicts(exp)
    assert a.context.trace_id != b.context.trace_id and a.context.span_id != b.context.span_id
    assert a.parent.span_id != b.parent.span_id
    sa, sb = sent
    assert (sa["value"], sb["value"]) == ("ALARM", "CONTINUE")
    assert sa["id"] != sb["id"] and sa["traceId"] != sb["traceId"] and sa["observationId"] != sb["observationId"]
    # no (tenant, run) pair writes another's: the key is length-prefixed
    from aftraj.adapters.emit import run_key
    assert run_key("a/b", "c") != run_key("a", "b/c")
    with pytest.raises(TypeError):
        Emitters([ot]).emit(ALARM, run_id="prod-7")          # tenant is required
    with pytest.raises(ValueError, match="tenant"):
        ot.emit(ALARM, tenant="", run_id="prod-7")


def test_langfuse_scores_on_the_judged_steps_observation(langfuse):
    lf, sent = langfuse
    em = LangfuseVerdictEmitter(lf)
    em.emit(CONT, tenant="acme", run_id="run-1", model="auditor-7b")
    em.emit(ALARM, tenant="acme", run_id="run-1", model="auditor-7b")
    em.emit(ALARM, tenant="acme", run_id="run-1", model="auditor-7b")       # a resent verdict: the same score id
    tid, sid = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    em.emit(CONT, tenant="acme", run_id="run-2",
            step={"seq": 1, "meta": {"otel": {"trace_id": tid, "span_id": sid}}})
    em.flush()
    assert [s["value"] for s in sent] == ["CONTINUE", "ALARM", "ALARM", "CONTINUE"]
    a, b, c, d = sent
    assert b["name"] == "aftraj.verdict" and b["dataType"] == "CATEGORICAL" and b["comment"] == "418 is wrong"
    assert b["traceId"] == a["traceId"] == em.trace_id("acme", "run-1")
    assert b["metadata"] == {"step": 1, "decisive_step": 1, "agent": "calc", "latency_ms": 30.0, "model": "auditor-7b",
                             "auditor": "ok", "confidence": 0.93, "action": "halt", "run_id": "run-1",
                             "tenant": "acme", "seq": 2}
    assert b["id"] == c["id"] != a["id"]
    assert a["comment"] == "step 0: CONTINUE"
    # each score names its step's observation: its own span when the step has one
    assert a["observationId"] and b["observationId"] and a["observationId"] != b["observationId"]
    assert b["observationId"] == c["observationId"]
    assert (d["traceId"], d["observationId"]) == (tid, sid)


def test_emitters_fail_open(caplog):
    class Broken:
        def emit(self, v, **kw):
            raise ConnectionError("collector down")

        def flush(self):
            raise ConnectionError("collector down")
    em = Emitters([Broken()])
    with caplog.at_level("WARNING", logger="aftraj.emit"):
        em.emit(ALARM, tenant="acme", run_id="run-1")
        em.flush()
    assert em.failures == 2 and em.emitted == 0 and "collector down" in caplog.text
    with pytest.raises(ValueError, match="unknown verdict emitter 'phoenix'"):
        parse_spec("otel,phoenix")


def test_aftraj_eval_emit(otel, langfuse, monkeypatch, tmp_path, capsys):
    """`aftraj eval --emit otel,langfuse`: one span and one score per audited prefix."""
    import aftraj.adapters.emit as emit
    from aftraj.cli import main as cli
    tp, exp = otel
    lf, sent = langfuse
    monkeypatch.setattr(emit, "from_spec", lambda spec: Emitters([OtelVerdictEmitter(tp), LangfuseVerdictEmitter(lf)]))
    out = tmp_path / "ev"
    assert cli(["eval", "--auditor", "rules", "--data", "who_and_when", "--limit", "2", "--out", str(out),
                "--no-progress", "--n-boot", "10", "--emit", "otel,langfuse"]) == 0
    preds = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    n = sum(p["calls"] for p in preds)
    spans = _verdicts(exp)          # (and the run and step spans they hang under)
    assert len(spans) == n and len(sent) == n and f"emitted {2 * n} verdicts" in capsys.readouterr().out
    assert all(x["observationId"] for x in sent)
    assert {s.attributes["aftraj.run_id"] for s in spans} == {p["id"] for p in preds}
    assert [s.attributes["aftraj.step"] for s in spans if s.attributes["aftraj.run_id"] == preds[0]["id"]] == \
        [e["t"] for e in preds[0]["trace"]]
    monkeypatch.undo()
    assert cli(["eval", "--auditor", "rules", "--data", "who_and_when", "--limit", "1", "--out", str(tmp_path / "x"),
                "--no-progress", "--emit", "phoenix"]) == 2


def test_prediction_verdicts_from_a_walk_record():
    p = {"id": "r", "d": 2, "reason": "bad", "latencies_s": [0.1, 0.2, 0.3],
         "trace": [{"t": 0, "alarm": False}, {"t": 1, "alarm": False, "error": "timeout"},
                   {"t": 2, "alarm": True, "k": 1, "agent": "a", "confidence": 0.8}]}
    vs = prediction_verdicts(p)
    assert [(v["t"], v["decision"], v["auditor"], v["latency_ms"]) for v in vs] == [
        (0, "CONTINUE", "ok", 100.0), (1, "CONTINUE", "unavailable", 200.0), (2, "ALARM", "ok", 300.0)]
    assert (vs[2]["k"], vs[2]["agent"], vs[2]["reason"]) == (1, "a", "bad")
