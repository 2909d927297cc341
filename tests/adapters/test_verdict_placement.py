"""Issue 47.2: verdicts land where users look, checked against a local collector (an HTTP server
on 127.0.0.1 recording every OTLP/HTTP and Langfuse API post), the way Phoenix and Langfuse read
them. An agent traced with the OpenTelemetry SDK exports its GenAI spans to the collector and is
audited live through `GatewaySpanProcessor`; each verdict the gateway gave is emitted as the
gateway does (`Emitters.emit(v, tenant=…, run_id=…, step=<the run's events>)`) by the emitters
`from_spec("otel,langfuse")` builds from the standard environment (`OTEL_SERVICE_NAME`,
`OTEL_EXPORTER_OTLP_ENDPOINT`). Phoenix-style: every parent a span names is in the exported
trace, each verdict span is the child of the span of the step it judges and holds the GenAI
`gen_ai.evaluation.result` event, the service is named by OTEL_SERVICE_NAME. Langfuse-style:
each score carries `observationId`, the judged step's span. Before: verdict spans hung under a
parent id that was in no trace, scores were trace-level, OTEL_SERVICE_NAME was ignored. Needs
the `adapters` extra."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("scripted_frameworks", Path(__file__).with_name("scripted_frameworks.py"))
fw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fw)


class Collector:
    """Records every POST (path, body); answers 200."""

    def __init__(self):
        posts = self.posts = []

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                posts.append((self.path, self.headers.get("content-type"), body))
                out = b"" if "protobuf" in (self.headers.get("content-type") or "") else b"{}"
                self.send_response(200)
                self.send_header("Content-Type", self.headers.get("content-type") or "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[str, object]]:
        """(service.name, span) of every OTLP span posted."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        out = []
        for path, _, body in self.posts:
            if path.endswith("/v1/traces") and "/api/public/" not in path:
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    svc = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), None)
                    out += [(svc, s) for ss in rs.scope_spans for s in ss.spans]
        return out

    def scores(self) -> list[dict]:
        out = []
        for path, _, body in self.posts:
            if path == "/api/public/scores":
                d = json.loads(body)
                out += d if isinstance(d, list) else [d]
        return out

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_verdicts_land_on_the_judged_steps_spans(live_gateway, monkeypatch):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    lf_mod = pytest.importorskip("langfuse")
    import time

    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    import aftraj.adapters.emit as emit
    from aftraj.adapters.emit import LangfuseVerdictEmitter
    from aftraj.adapters.hooks import GatewaySpanProcessor
    col = Collector()
    try:
        # the user's agent: traced to the collector, audited live by the gateway
        url, key, _ = live_gateway("no such city")
        user_tp = TracerProvider(resource=Resource.create({"service.name": "user-agent"}))
        user_tp.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{col.url}/v1/traces")))
        proc = GatewaySpanProcessor(url, api_key=key)
        user_tp.add_span_processor(proc)
        fw.otel_agent_run(user_tp)
        ((orun, grun),) = proc.finished.values()
        assert proc.alarm is not None and len(grun.verdicts) >= 3

        # the auditor's emitters, from the standard OTel environment (no global TracerProvider)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "aftraj-auditor")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", col.url)
        monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.ProxyTracerProvider())
        lf = lf_mod.Langfuse(public_key=f"pk-lf-place-{time.monotonic_ns()}", secret_key="sk", base_url=col.url)
        monkeypatch.setattr(emit, "LangfuseVerdictEmitter", lambda: LangfuseVerdictEmitter(lf))
        ems = emit.from_spec("otel,langfuse")
        for v in grun.verdicts:
            ems.emit(v, tenant="t", run_id=grun.run_id, step=orun.rb.events)
        ems.flush()
        lf.flush()
        assert ems.failures == 0 and ems.emitted == 2 * len(grun.verdicts)

        spans = col.spans()
        user = {s.span_id.hex(): s for svc, s in spans if svc == "user-agent"}
        verdicts = [(svc, s) for svc, s in spans if s.name == "aftraj.verdict"]
        assert len(verdicts) == len(grun.verdicts) and {svc for svc, _ in verdicts} == {"aftraj-auditor"}
        # Phoenix-style: every parent named is in the exported trace
        ids = {(s.trace_id.hex(), s.span_id.hex()) for _, s in spans}
        assert all(not s.parent_span_id or (s.trace_id.hex(), s.parent_span_id.hex()) in ids for _, s in spans)
        # each verdict is the child of the span of the step it judges, with the GenAI evaluation event
        step_span = {e.seq: e.meta["otel"]["span_id"] for e in orun.rb.events if "otel" in e.meta}
        for v, (_, s) in zip(grun.verdicts, verdicts, strict=True):
            attrs = {a.key: a.value for a in s.attributes}
            assert attrs["aftraj.step"].int_value == v["t"]
            parent = s.parent_span_id.hex()
            assert parent in user and (v["seq"] not in step_span or parent == step_span[v["seq"]])
            (ev,) = s.events
            ev_attrs = {a.key: a.value for a in ev.attributes}
            assert ev.name == "gen_ai.evaluation.result"
            assert ev_attrs["gen_ai.evaluation.score.label"].string_value == v["decision"]
            assert ev_attrs["gen_ai.evaluation.name"].string_value == "aftraj.verdict"
        alarm_span = verdicts[-1][1]
        assert user[alarm_span.parent_span_id.hex()].name == "execute_tool lookup"   # the failing tool's span
        # Langfuse-style: each score names the judged step's observation (its span) in the user's trace
        scores = col.scores()
        assert len(scores) == len(grun.verdicts)
        assert all(x["observationId"] in user for x in scores)
        assert {x["traceId"] for x in scores} == {s.trace_id.hex() for s in user.values()}
        assert [x["observationId"] for x in scores] == [s.parent_span_id.hex() for _, s in verdicts]
        lf.shutdown()
    finally:
        col.close()
