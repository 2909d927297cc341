""""Score my traces" without gold labels (issue 47 item 3): `aftraj audit` runs an auditor's strict
online walk (eval/walker.py, through eval.run.audit) over unlabeled runs, ours or an agent
framework's export, and writes each run's verdict and every prefix's; `aftraj fold` takes
several runs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from aftraj.cli import main
from aftraj.schema import write_jsonl


@pytest.fixture
def unlabeled(tmp_path, make_traj):
    from aftraj.boundary import UNLABELED

    runs = [replace(make_traj(i, n, None), label=UNLABELED, meta={"unlabeled": True}, domain="external")
            for i, n in enumerate([5, 2, 4])]
    path = tmp_path / "mine.jsonl"
    write_jsonl(runs, path)
    return path, runs


def _lines(p):
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def test_audit_scores_unlabeled_runs(unlabeled, tmp_path, capsys):
    path, runs = unlabeled
    assert main(["eval", "--auditor", "dummy:alarm-at-2", "--data", str(path), "--out", str(tmp_path / "e"),
                 "--no-progress"]) == 2
    assert f"aftraj audit --auditor dummy:alarm-at-2 --data {path}" in capsys.readouterr().err   # the way on

    out = tmp_path / "a"
    assert main(["audit", "--auditor", "dummy:alarm-at-2", "--data", str(path), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "3 of 3 runs ALARM" in printed and "t0: ALARM at prefix 2, blames step 2 (agent Solver)" in printed
    v = _lines(out / "verdicts.jsonl")
    assert [x["id"] for x in v] == ["t0", "t1", "t2"]
    assert [(x["verdict"], x["alarm_at"], x["step"], x["agent"]) for x in v] == [
        ("ALARM", 2, 2, runs[0].steps[2].agent), ("ALARM", 1, 1, runs[1].steps[1].agent),
        ("ALARM", 2, 2, runs[2].steps[2].agent)]
    assert not {"gold", "k_star", "a_star"} & set(v[0])                 # no gold label read or written
    assert [p["t"] for p in v[0]["prefixes"]] == [0, 1, 2]              # strict online: first ALARM ends it
    assert [p["decision"] for p in v[0]["prefixes"]] == ["CONTINUE", "CONTINUE", "ALARM"]
    summary = json.loads((out / "audit.json").read_text())
    assert summary["n_runs"] == 3 and summary["n_alarm"] == 3 and summary["calls"] == 3 + 2 + 3
    assert summary["alarms_by_agent"] == {"Solver": 2, "Verifier": 1}
    assert summary["provenance"]["command"].startswith("aftraj audit --auditor dummy:alarm-at-2")
    md = (out / "audit.md").read_text()
    assert "3 runs: **3 ALARM**, 0 CONTINUE" in md and "| t1 | 1 | 1 | Verifier | dummy alarm |" in md

    # the same walk the evaluation makes: the walker's records, less the gold fields
    from eval.auditors import get_auditor
    from eval.run import verdict_record
    from eval.walker import walk

    assert [verdict_record(r) | {"latencies_s": None} for r in walk(get_auditor("dummy:alarm-at-2"), runs)] == \
        [x | {"latencies_s": None} for x in v]

    assert main(["audit", "--auditor", "dummy:safe", "--data", str(path), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "already holds an earlier run's output (" in err and "verdicts.jsonl" in err
    assert main(["audit", "--auditor", "dummy:safe", "--data", str(path), "--out", str(out), "--no-progress",
                 "--overwrite", "--all-prefixes"]) == 0
    v = _lines(out / "verdicts.jsonl")
    assert [x["verdict"] for x in v] == ["CONTINUE"] * 3 and [len(x["prefixes"]) for x in v] == [5, 2, 4]
    assert main(["audit", "--auditor", "dummy:safe", "--data", str(path), "--out", str(tmp_path / "p"),
                 "--no-progress"]) == 0
    assert "--protocol" not in capsys.readouterr().out
    with pytest.raises(SystemExit):        # the reference protocol needs gold labels: not an audit flag
        main(["audit", "--auditor", "rules", "--data", str(path), "--out", str(tmp_path / "r"), "--protocol", "reference"])


def test_audit_resume_keeps_finished_runs(unlabeled, tmp_path, monkeypatch):
    from eval.resume import PredictionLog

    path, _ = unlabeled
    out = tmp_path / "a"
    real, n = PredictionLog.write, []

    def dying(self, rec):
        if n:
            raise KeyboardInterrupt
        n.append(rec["id"])
        real(self, rec)

    monkeypatch.setattr(PredictionLog, "write", dying)
    args = ["audit", "--auditor", "dummy:alarm-at-2", "--data", str(path), "--out", str(out), "--no-progress",
            "--max-in-flight", "1"]
    assert main(args) == 130
    monkeypatch.setattr(PredictionLog, "write", real)
    assert [x["id"] for x in _lines(out / "verdicts.jsonl")] == n == ["t0"]
    assert main(args + ["--resume"]) == 0
    assert [x["id"] for x in _lines(out / "verdicts.jsonl")] == ["t0", "t1", "t2"]
    # t0 was kept whole; t1's two calls, made before the kill in the middle of its record, replayed
    assert json.loads((out / "audit.json").read_text())["cached_calls"] == 2


def test_audit_reads_an_agent_framework_export(tmp_path, capsys):
    """`--from otel`: an OpenTelemetry GenAI export read by the adapter, audited as it is."""
    def attr(k, v):
        return {"key": k, "value": {"stringValue": v}}

    msgs = lambda role, text: json.dumps([{"role": role, "parts": [{"type": "text", "content": text}]}])   # noqa: E731
    spans = [{"traceId": "ab" * 16, "spanId": f"{i + 1:016x}", "name": "chat", "startTimeUnixNano": str(i + 1),
              "attributes": [attr("gen_ai.operation.name", "chat"), attr("gen_ai.agent.name", f"agent{i % 2}"),
                             attr("gen_ai.input.messages", msgs("user", "Compute 2+2.")),
                             attr("gen_ai.output.messages", msgs("assistant", f"step {i}"))]} for i in range(3)]
    src = tmp_path / "spans.json"
    src.write_text(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}))
    out = tmp_path / "o"
    assert main(["audit", "--auditor", "dummy:alarm-at-1", "--from", "otel", "--data", str(src), "--out", str(out),
                 "--no-progress"]) == 0
    v = _lines(out / "verdicts.jsonl")
    assert len(v) == 1 and v[0]["verdict"] == "ALARM" and v[0]["alarm_at"] == 1 and v[0]["domain"] == "external"
    assert json.loads((out / "audit.json").read_text())["data_format"] == "otel"
    assert main(["audit", "--auditor", "rules", "--from", "otel", "--data", str(tmp_path / "nope.json"),
                 "--out", str(tmp_path / "n"), "--no-progress"]) == 2

    # --emit: each prefix's verdict is a span under the judged step's own span of the user's trace
    pytest.importorskip("opentelemetry.sdk")
    import aftraj.adapters.emit as emit
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp, tp = InMemorySpanExporter(), TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exp))
    real = emit.from_spec
    emit.from_spec = lambda spec: emit.Emitters([emit.OtelVerdictEmitter(tp)])
    try:
        assert main(["audit", "--auditor", "dummy:alarm-at-1", "--from", "otel", "--data", str(src), "--out",
                     str(tmp_path / "em"), "--no-progress", "--emit", "otel", "--tenant", "team-a"]) == 0
    finally:
        emit.from_spec = real
    verdicts = [x for x in exp.get_finished_spans() if x.name == "aftraj.verdict"]
    assert [x.attributes["aftraj.step"] for x in verdicts] == [0, 1]
    assert all(x.attributes["aftraj.tenant"] == "team-a" for x in verdicts)
    assert [(format(x.context.trace_id, "032x"), format(x.parent.span_id, "016x")) for x in verdicts] == \
        [("ab" * 16, f"{t + 1:016x}") for t in (0, 1)]
    assert json.loads((tmp_path / "em" / "audit.json").read_text())["emitted"]["tenant"] == "team-a"


def test_audit_verdicts_emit_in_the_gateway_shape():
    from aftraj.adapters.emit import prediction_verdicts
    from eval.run import emitted_view

    v = {"id": "r1", "alarm_at": 1, "reason": "loop", "latencies_s": [0.5, 0.25],
         "prefixes": [{"t": 0, "decision": "CONTINUE", "step": None, "agent": None, "confidence": 0.1,
                       "parse_failure": None, "error": None},
                      {"t": 1, "decision": "ALARM", "step": 0, "agent": "A", "confidence": 0.9,
                       "parse_failure": None, "error": None}]}
    got = prediction_verdicts(emitted_view(v))
    assert [(g["t"], g["decision"], g["k"], g["agent"], g["reason"], g["latency_ms"]) for g in got] == [
        (0, "CONTINUE", None, None, None, 500.0), (1, "ALARM", 0, "A", "loop", 250.0)]


def test_fold_takes_several_runs(tmp_path, make_traj, capsys):
    path = tmp_path / "runs.jsonl"
    write_jsonl([make_traj(i, 3, None) for i in range(4)], path)
    assert main(["fold", str(path), "--run", "t2", "t0", "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)["runs"]] == ["t2", "t0"]
    assert main(["fold", str(path), "--run", "t1", "--run", "t3", "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)["runs"]] == ["t1", "t3"]
    assert main(["fold", str(path), "--json"]) == 0                                  # the whole file
    assert len(json.loads(capsys.readouterr().out)["runs"]) == 4
    assert main(["fold", str(path), "--run", "t1", "nope", "zz"]) == 2
    assert "no run with id 'nope', 'zz' (1 of the 3 named were found)" in capsys.readouterr().err
    # an event ledger: several runs by id as well
    from aftraj.fold import fold_trajectory

    ledger = tmp_path / "ledger.jsonl"
    with open(ledger, "w") as f:
        for i in range(3):
            for ev in fold_trajectory(make_traj(i, 3, None)).events:
                f.write(ev.dumps().decode() + "\n")
    assert main(["fold", str(ledger), "--run", "t0", "t2", "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)["runs"]] == ["t0", "t2"]


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"aftraj {version('agentforesight')}"
