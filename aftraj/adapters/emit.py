"""Verdicts where users already look: each verdict as an OpenTelemetry span (Phoenix, Jaeger,
any OTLP backend) and as a Langfuse score on the run's trace, through the official SDKs
(opentelemetry-sdk, `langfuse`; the `adapters` extra).

    from aftraj.adapters.emit import LangfuseVerdictEmitter, OtelVerdictEmitter, Emitters
    em = Emitters([OtelVerdictEmitter(tracer_provider), LangfuseVerdictEmitter(Langfuse())])
    em.emit(verdict, run_id="run-1", model="auditor-7b")

    AFTRAJ_EMIT=otel,langfuse aftraj serve gateway --config …   # the gateway emits every verdict
    aftraj eval --auditor rules --data … --out … --emit otel,langfuse   # every prefix's verdict

- OTel: one span `aftraj.verdict` a verdict, attributes `aftraj.step` (t), `aftraj.decision`,
  `aftraj.agent`, `aftraj.reason`, `aftraj.latency_ms`, `aftraj.model`, and `aftraj.run_id`,
  `aftraj.decisive_step` (k), `aftraj.auditor`, `aftraj.confidence`, `aftraj.action`,
  `aftraj.findings` (kinds) where known; an ALARM's span has status ERROR (its reason), so
  trace views flag it. The spans of one run share one trace: the run's own trace when the run id
  is an OTel trace id (32 hex digits, as `GatewaySpanProcessor` names runs), else one derived
  from the run id (sha256), so a backend groups a run's verdicts.
- Langfuse: one score a verdict, name `aftraj.verdict`, CATEGORICAL value `ALARM`/`CONTINUE`,
  comment the reason, metadata the rest, on the trace of the run (the run id when it is a 32-hex
  trace id, else `Langfuse.create_trace_id(seed=run_id)`); its id is derived from run and step,
  so a resent verdict updates its score instead of adding one.
- `from_env()`: the emitters `AFTRAJ_EMIT` names (`otel`: the global TracerProvider, or, when none
  is set, one exporting OTLP over HTTP to `OTEL_EXPORTER_OTLP_ENDPOINT`; `langfuse`: `Langfuse()`,
  configured by `LANGFUSE_PUBLIC_KEY`, `LANGFUSE_SECRET_KEY`, `LANGFUSE_BASE_URL`). Emission fails
  open: an emitter's error is logged (logger `aftraj.emit`) and counted (`.failures`), never
  raised into the gateway or the evaluation.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re


log = logging.getLogger("aftraj.emit")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
SCORE_NAME = "aftraj.verdict"
SPAN_NAME = "aftraj.verdict"


def _trace_hex(run_id: str) -> str:
    rid = str(run_id).lower()
    if _HEX32.match(rid) and int(rid, 16) != 0:
        return rid
    return hashlib.sha256(str(run_id).encode()).hexdigest()[:32]


def verdict_attributes(v: dict, *, run_id: str | None = None, model: str | None = None) -> dict:
    """A verdict's OTel attributes (None values left out: OTel takes none)."""
    kinds = [f.get("kind") for f in v.get("findings") or [] if isinstance(f, dict) and f.get("kind")]
    a = {"aftraj.step": v.get("t"), "aftraj.decision": v.get("decision"), "aftraj.agent": v.get("agent"),
         "aftraj.reason": v.get("reason"), "aftraj.latency_ms": v.get("latency_ms"), "aftraj.model": model,
         "aftraj.run_id": run_id or v.get("run_id"), "aftraj.decisive_step": v.get("k"),
         "aftraj.auditor": v.get("auditor"), "aftraj.confidence": v.get("confidence"),
         "aftraj.action": v.get("action"), "aftraj.findings": kinds or None}
    return {k: x for k, x in a.items() if x is not None}


class OtelVerdictEmitter:
    """Each verdict as an `aftraj.verdict` span (see the module docstring)."""

    def __init__(self, tracer_provider=None, *, tracer_name: str = "agentforesight"):
        from opentelemetry import trace
        self.provider = tracer_provider or trace.get_tracer_provider()
        self.tracer = self.provider.get_tracer(tracer_name)

    def emit(self, v: dict, *, run_id: str | None = None, model: str | None = None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags
        rid = run_id or v.get("run_id") or "run"
        tid = _trace_hex(rid)
        parent = SpanContext(trace_id=int(tid, 16), span_id=int(hashlib.sha256(f"{rid}/run".encode()).hexdigest()[:16], 16),
                             is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        ctx = trace.set_span_in_context(NonRecordingSpan(parent))
        with self.tracer.start_as_current_span(SPAN_NAME, context=ctx,
                                               attributes=verdict_attributes(v, run_id=rid, model=model)) as span:
            if v.get("decision") == "ALARM":
                span.set_status(Status(StatusCode.ERROR, str(v.get("reason") or "ALARM")))

    def flush(self) -> None:
        fn = getattr(self.provider, "force_flush", None)
        if fn is not None:
            fn()


class LangfuseVerdictEmitter:
    """Each verdict as a Langfuse score on the run's trace (see the module docstring)."""

    def __init__(self, client=None):
        if client is None:
            from langfuse import Langfuse
            client = Langfuse()
        self.client = client

    def trace_id(self, run_id: str) -> str:
        rid = str(run_id).lower()
        if _HEX32.match(rid):
            return rid
        return self.client.create_trace_id(seed=str(run_id))

    def emit(self, v: dict, *, run_id: str | None = None, model: str | None = None) -> None:
        rid = run_id or v.get("run_id") or "run"
        meta = {k: x for k, x in (("step", v.get("t")), ("decisive_step", v.get("k")), ("agent", v.get("agent")),
                                  ("latency_ms", v.get("latency_ms")), ("model", model), ("auditor", v.get("auditor")),
                                  ("confidence", v.get("confidence")), ("action", v.get("action")),
                                  ("run_id", rid), ("seq", v.get("seq"))) if x is not None}
        sid = hashlib.sha256(f"aftraj/{rid}/{v.get('seq', v.get('t'))}".encode()).hexdigest()[:32]
        self.client.create_score(name=SCORE_NAME, value=str(v.get("decision")), data_type="CATEGORICAL",
                                 trace_id=self.trace_id(rid), score_id=sid, metadata=meta,
                                 comment=v.get("reason") or f"step {v.get('t')}: {v.get('decision')}")

    def flush(self) -> None:
        self.client.flush()


class Emitters:
    """Several emitters, failing open (see the module docstring)."""

    def __init__(self, emitters=()):
        self.emitters = list(emitters)
        self.failures = 0
        self.emitted = 0

    def __bool__(self) -> bool:
        return bool(self.emitters)

    def emit(self, v: dict, *, run_id: str | None = None, model: str | None = None) -> None:
        for e in self.emitters:
            try:
                e.emit(v, run_id=run_id, model=model)
                self.emitted += 1
            except Exception as err:        # monitoring output must never break what it monitors
                self.failures += 1
                log.warning("%s: verdict of run %s step %s not emitted: %s: %s", type(e).__name__,
                            run_id or v.get("run_id"), v.get("t"), type(err).__name__, err)

    def flush(self) -> None:
        for e in self.emitters:
            try:
                e.flush()
            except Exception as err:
                self.failures += 1
                log.warning("%s: flush failed: %s: %s", type(e).__name__, type(err).__name__, err)


def _otel_from_env() -> OtelVerdictEmitter:
    from opentelemetry import trace
    provider = trace.get_tracer_provider()
    if not hasattr(provider, "add_span_processor"):     # no SDK provider set: export OTLP over HTTP
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        provider = TracerProvider(resource=Resource.create({"service.name": "agentforesight"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return OtelVerdictEmitter(provider)


def parse_spec(spec: str | None) -> list[str]:
    names = [s.strip() for s in (spec or "").split(",") if s.strip()]
    bad = [n for n in names if n not in ("otel", "langfuse")]
    if bad:
        raise ValueError(f"unknown verdict emitter {bad[0]!r} (known: otel, langfuse)")
    return names


def from_spec(spec: str | None) -> Emitters:
    """Emitters for "otel", "langfuse" or "otel,langfuse" (configured from the environment)."""
    out = []
    for n in parse_spec(spec):
        out.append(_otel_from_env() if n == "otel" else LangfuseVerdictEmitter())
    return Emitters(out)


def from_env() -> Emitters:
    """The emitters `AFTRAJ_EMIT` names (none when it is unset)."""
    return from_spec(os.environ.get("AFTRAJ_EMIT"))


def prediction_verdicts(pred: dict) -> list[dict]:
    """The per-prefix verdicts of one `aftraj eval` prediction (predictions.jsonl), as gateway-like
    verdict dicts (t, decision, k, agent, reason, confidence, latency_ms)."""
    lat = pred.get("latencies_s") or []
    out = []
    for i, e in enumerate(pred.get("trace") or []):
        alarm = bool(e.get("alarm"))
        out.append({"run_id": pred.get("id"), "seq": e.get("t"), "t": e.get("t"),
                    "decision": "ALARM" if alarm else "CONTINUE", "k": e.get("k") if alarm else None,
                    "agent": e.get("agent") if alarm else None,
                    "reason": pred.get("reason") if alarm and pred.get("d") == e.get("t") else None,
                    "confidence": e.get("confidence"),
                    "latency_ms": round(1000 * lat[i], 3) if i < len(lat) and lat[i] is not None else None,
                    "auditor": ("parse_failure" if e.get("parse_failure") else "unavailable" if e.get("error")
                                else "ok")})
    return out


__all__ = ["Emitters", "LangfuseVerdictEmitter", "OtelVerdictEmitter", "from_env", "from_spec",
           "prediction_verdicts", "verdict_attributes"]

