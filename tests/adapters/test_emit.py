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


def test_otel_spans_carry_the_verdict(otel):
    tp, exp = otel
    em = OtelVerdictEmitter(tp)
    em.emit(CONT, run_id="run-1", model="auditor-7b")
    em.emit(ALARM, run_id="run-1", model="auditor-7b")
    a, b = exp.get_finished_spans()
    assert a.name == b.name == "aftraj.verdict"
    assert dict(b.attributes) == {"aftraj.step": 1, "aftraj.decision": "ALARM", "aftraj.agent": "calc",
                                  "aftraj.reason": "418 is wrong", "aftraj.latency_ms": 30.0,
                                  "aftraj.model": "auditor-7b", "aftraj.run_id": "run-1", "aftraj.decisive_step": 1,
                                  "aftraj.auditor": "ok", "aftraj.confidence": 0.93, "aftraj.action": "halt",
                                  "aftraj.findings": ("error_streak",)}
    assert "aftraj.agent" not in a.attributes and a.attributes["aftraj.decision"] == "CONTINUE"
    assert b.status.status_code.name == "ERROR" and b.status.description == "418 is wrong"
    assert a.status.status_code.name == "UNSET"
    assert a.context.trace_id == b.context.trace_id                # one trace for a run's verdicts
    # a run named by an OTel trace id (GatewaySpanProcessor's runs): the verdicts join that trace
    tid = "0af7651916cd43dd8448eb211c80319c"
    em.emit(CONT, run_id=tid)
    assert format(exp.get_finished_spans()[-1].context.trace_id, "032x") == tid


def test_langfuse_scores_on_the_runs_trace(langfuse):
    lf, sent = langfuse
    em = LangfuseVerdictEmitter(lf)
    em.emit(CONT, run_id="run-1", model="auditor-7b")
    em.emit(ALARM, run_id="run-1", model="auditor-7b")
    em.emit(ALARM, run_id="run-1", model="auditor-7b")       # a resent verdict: the same score id
    em.flush()
    assert [s["value"] for s in sent] == ["CONTINUE", "ALARM", "ALARM"]
    a, b, c = sent
    assert b["name"] == "aftraj.verdict" and b["dataType"] == "CATEGORICAL" and b["comment"] == "418 is wrong"
    assert b["traceId"] == a["traceId"] == lf.create_trace_id(seed="run-1")
    assert b["metadata"] == {"step": 1, "decisive_step": 1, "agent": "calc", "latency_ms": 30.0, "model": "auditor-7b",
                             "auditor": "ok", "confidence": 0.93, "action": "halt", "run_id": "run-1", "seq": 2}
    assert b["id"] == c["id"] != a["id"]
    assert a["comment"] == "step 0: CONTINUE"


def test_emitters_fail_open(caplog):
    class Broken:
        def emit(self, v, **kw):
            raise ConnectionError("collector down")

        def flush(self):
            raise ConnectionError("collector down")
    em = Emitters([Broken()])
    with caplog.at_level("WARNING", logger="aftraj.emit"):
        em.emit(ALARM, run_id="run-1")
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
    spans = exp.get_finished_spans()
    assert len(spans) == n and len(sent) == n and f"emitted {2 * n} verdicts" in capsys.readouterr().out
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
