"""Verdicts where users already look: each verdict as an OpenTelemetry span carrying the GenAI
evaluation event (Phoenix, Jaeger, any OTLP backend) and as a Langfuse score on the judged step's
observation, through the official SDKs (opentelemetry-sdk, `langfuse`; the `adapters` extra).

    from aftraj.adapters.emit import LangfuseVerdictEmitter, OtelVerdictEmitter, Emitters
    em = Emitters([OtelVerdictEmitter(tracer_provider), LangfuseVerdictEmitter(Langfuse())])
    em.emit(verdict, tenant="team-a", run_id="run-1", model="auditor-7b", step=event)

    AFTRAJ_EMIT=otel,langfuse aftraj serve gateway --config …   # the gateway emits every verdict
    aftraj eval --auditor rules --data … --out … --emit otel,langfuse   # every prefix's verdict

Ids. `tenant` is a required keyword: every id written to a backend is derived from (tenant, run),
never from the run id alone, so two tenants' runs named alike (`prod-7`) never share a trace, a
span or a score (`run_key`). The one exception is the user's own trace: when the judged step's
event carries its span (`meta["otel"] = {"trace_id", "span_id"}`, as the OTel, OpenInference and
Langfuse readers and `GatewaySpanProcessor` record it), the verdict joins that trace, under that
span; its own span id and score id are still derived from (tenant, run, seq).

- OTel: one span `aftraj.verdict` a verdict, the child of the judged step's own span, holding
  the GenAI conventions' evaluation event `gen_ai.evaluation.result` (`gen_ai.evaluation.name`
  = "aftraj.verdict", `gen_ai.evaluation.score.value` = P(UNSAFE) when known, else 1.0 for
  ALARM and 0.0 for CONTINUE, `gen_ai.evaluation.score.label` = ALARM/CONTINUE,
  `gen_ai.evaluation.explanation` = the reason) and the attributes `aftraj.step` (t),
  `aftraj.decision`, `aftraj.agent`, `aftraj.reason`, `aftraj.latency_ms`, `aftraj.model`,
  `aftraj.run_id`, `aftraj.tenant`, and `aftraj.decisive_step` (k), `aftraj.auditor`,
  `aftraj.confidence`, `aftraj.action`, `aftraj.findings` (kinds) where known; an ALARM's span
  has status ERROR (its reason), so trace views flag it, and links the decisive step's span when
  it is known. A step with no span of its own (a hook run of smolagents, AG2, the Agents SDK)
  gets one: the emitter writes the run's span `aftraj.run` and the step's span `aftraj.step` once
  (ids derived from tenant, run and t), so every parent a verdict names is in the exported trace.
  The spans' own ids are set by the emitter's tracer (derived, not random), so a resent verdict
  is the same span.
- Langfuse: one score a verdict, name `aftraj.verdict`, CATEGORICAL value `ALARM`/`CONTINUE`,
  comment the reason, metadata the rest, with `observationId` the judged step's observation (its
  span id when the step carries one; else an `aftraj.step` observation the emitter creates once
  in a trace derived from tenant and run); its id is derived from tenant, run and seq, so a
  resent verdict updates its score instead of adding one.
- `from_env()`: the emitters `AFTRAJ_EMIT` names (`otel`: the global TracerProvider, or, when none
  is set, one exporting OTLP over HTTP as the standard environment says: `OTEL_SERVICE_NAME`,
  `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_ENDPOINT` / `…_TRACES_ENDPOINT`, `…_HEADERS`;
  `langfuse`: `Langfuse()`, configured by `LANGFUSE_PUBLIC_KEY`, `LANGFUSE_SECRET_KEY`,
  `LANGFUSE_BASE_URL`). Emission fails open: an emitter's error is logged (logger `aftraj.emit`)
  and counted (`.failures`), never raised into the gateway or the evaluation.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections import OrderedDict
from typing import Any


log = logging.getLogger("aftraj.emit")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
SCORE_NAME = "aftraj.verdict"
SPAN_NAME = "aftraj.verdict"
EVAL_EVENT = "gen_ai.evaluation.result"
_REMEMBERED = 10_000        # runs / steps whose anchor span an emitter remembers having written


def run_key(tenant: str, run_id: str) -> str:
    """The one string every external id of a run is derived from: the tenant and the run,
    length-prefixed so that no (tenant, run) pair writes another's ("a/b", "c" vs "a", "b/c")."""
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    return f"{len(tenant)}:{tenant}/{run_id}"


def derived_id(key: str, what: str, n_hex: int) -> str:
    """`n_hex` hex digits of sha256(what, key), never all zeros (an invalid OTel id)."""
    h = hashlib.sha256(f"aftraj/{what}/{key}".encode("utf-8", "surrogatepass")).hexdigest()[:n_hex]
    return h if int(h, 16) else "1".rjust(n_hex, "0")


def _meta(ev: Any) -> dict:
    meta = ev.get("meta") if isinstance(ev, dict) else getattr(ev, "meta", None)
    return meta if isinstance(meta, dict) else {}


def _seq(ev: Any) -> Any:
    return ev.get("seq") if isinstance(ev, dict) else getattr(ev, "seq", None)


def step_span(step: Any, seq: Any = None) -> tuple[str, str] | None:
    """(trace id, span id) of the judged step's own span, in lowercase hex, when its event carries
    one (`meta["otel"]`); None otherwise. `step`: the event (a wire dict or an `Event`), or the
    events the verdict covers (the posted batch, as a list or as the request's JSON body
    `{"events": [...]}`, parsed only here): the one whose seq is `seq`, else the newest carrying
    a span."""
    if step is None:
        return None
    if isinstance(step, (bytes, bytearray, memoryview, str)):      # the posted body {"events": [...]}
        try:
            import orjson
            body = orjson.loads(step)
        except ValueError:
            return None
        step = body.get("events") if isinstance(body, dict) else body
        if not isinstance(step, list):
            return None
    if isinstance(step, (list, tuple)):
        evs = list(step)
        exact = [e for e in evs if seq is not None and _seq(e) == seq]
        for e in exact + evs[::-1]:
            got = step_span(e)
            if got is not None:
                return got
        return None
    o = _meta(step).get("otel")
    if not isinstance(o, dict):
        return None
    tid, sid = str(o.get("trace_id") or "").lower(), str(o.get("span_id") or "").lower()
    if _HEX32.match(tid) and _HEX16.match(sid) and int(tid, 16) and int(sid, 16):
        return tid, sid
    return None


def verdict_attributes(v: dict, *, run_id: str | None = None, model: str | None = None,
                       tenant: str | None = None) -> dict:
    """A verdict's OTel attributes (None values left out: OTel takes none)."""
    kinds = [f.get("kind") for f in v.get("findings") or [] if isinstance(f, dict) and f.get("kind")]
    a = {"aftraj.step": v.get("t"), "aftraj.decision": v.get("decision"), "aftraj.agent": v.get("agent"),
         "aftraj.reason": v.get("reason"), "aftraj.latency_ms": v.get("latency_ms"), "aftraj.model": model,
         "aftraj.run_id": run_id or v.get("run_id"), "aftraj.tenant": tenant, "aftraj.decisive_step": v.get("k"),
         "aftraj.auditor": v.get("auditor"), "aftraj.confidence": v.get("confidence"),
         "aftraj.action": v.get("action"), "aftraj.findings": kinds or None}
    return {k: x for k, x in a.items() if x is not None}


def evaluation_attributes(v: dict) -> dict:
    """The GenAI conventions' `gen_ai.evaluation.result` attributes of a verdict."""
    conf = v.get("confidence")
    score = float(conf) if isinstance(conf, (int, float)) and not isinstance(conf, bool) else \
        (1.0 if v.get("decision") == "ALARM" else 0.0)
    a = {"gen_ai.evaluation.name": SCORE_NAME, "gen_ai.evaluation.score.value": score,
         "gen_ai.evaluation.score.label": str(v.get("decision")),
         "gen_ai.evaluation.explanation": v.get("reason") or f"step {v.get('t')}: {v.get('decision')}"}
    return a


class _Remembered:
    """A bounded set (the anchors an emitter wrote), thread-safe."""

    def __init__(self, n: int = _REMEMBERED):
        self.n, self.d, self.lock = n, OrderedDict(), threading.Lock()

    def get(self, k):
        with self.lock:
            return self.d.get(k)

    def add(self, k, value=True) -> bool:
        """True when `k` was new."""
        with self.lock:
            if k in self.d:
                self.d.move_to_end(k)
                return False
            self.d[k] = value
            if len(self.d) > self.n:
                self.d.popitem(last=False)
            return True


class _NextIds:
    """An id generator handing out the ids the emitter sets (thread-local), else the provider's."""

    def __init__(self, base):
        self.base, self.local = base, threading.local()

    def set(self, trace_id: int | None, span_id: int) -> None:
        self.local.trace, self.local.span = trace_id, span_id

    def generate_span_id(self) -> int:
        sid, self.local.span = getattr(self.local, "span", None), None
        return sid or self.base.generate_span_id()

    def generate_trace_id(self) -> int:
        tid, self.local.trace = getattr(self.local, "trace", None), None
        return tid or self.base.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return False


class OtelVerdictEmitter:
    """Each verdict as an `aftraj.verdict` span under the judged step's span (module docstring)."""

    def __init__(self, tracer_provider=None, *, tracer_name: str = "agentforesight"):
        from opentelemetry import trace
        self.provider = tracer_provider or trace.get_tracer_provider()
        self.tracer = self.provider.get_tracer(tracer_name)
        base = getattr(self.tracer, "id_generator", None)      # an SDK tracer: ids the emitter sets
        self._ids = _NextIds(base) if base is not None else None
        if self._ids is not None:
            self.tracer.id_generator = self._ids
        self._lock = threading.Lock()
        self._anchors = _Remembered()

    def _span(self, name: str, parent, span_id: str, trace_id: str | None = None, **kw):
        """Start a span with the given (derived) id; `parent` a SpanContext or None (a root in
        trace `trace_id`)."""
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan
        ctx = trace.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else \
            trace.set_span_in_context(trace.INVALID_SPAN)
        if self._ids is not None:
            self._ids.set(int(trace_id, 16) if trace_id else None, int(span_id, 16))
        return self.tracer.start_span(name, context=ctx, **kw)

    @staticmethod
    def _ctx(trace_id: str, span_id: str):
        from opentelemetry.trace import SpanContext, TraceFlags
        return SpanContext(trace_id=int(trace_id, 16), span_id=int(span_id, 16), is_remote=True,
                           trace_flags=TraceFlags(TraceFlags.SAMPLED))

    def _anchor(self, key: str, t: Any, attrs: dict) -> tuple[str, str]:
        """The (trace, span) of step t's own `aftraj.step` span, written once (with the run's span)."""
        tid = derived_id(key, "trace", 32)
        run_sid = derived_id(key, "run", 16)
        sid = derived_id(f"{key}/{t}", "step", 16)
        base = {k: attrs[k] for k in ("aftraj.run_id", "aftraj.tenant") if k in attrs}
        if self._anchors.add((key, None)):
            self._span("aftraj.run", None, run_sid, tid, attributes=base).end()
        if self._anchors.add((key, t)):
            self._span("aftraj.step", self._ctx(tid, run_sid), sid, attributes={**base, "aftraj.step": t}).end()
        return tid, sid

    def emit(self, v: dict, *, tenant: str, run_id: str | None = None, model: str | None = None,
             step: Any = None) -> None:
        from opentelemetry.trace import Link, Status, StatusCode
        rid = run_id or v.get("run_id") or "run"
        key = run_key(tenant, rid)
        attrs = verdict_attributes(v, run_id=rid, model=model, tenant=tenant)
        seq = v.get("seq", v.get("t"))
        with self._lock:            # the derived ids are handed to the very next span started
            own = step_span(step, seq)
            tid, parent_sid = own if own is not None else self._anchor(key, v.get("t"), attrs)
            links = []
            k = v.get("k")
            if v.get("decision") == "ALARM" and isinstance(k, int) and k != v.get("t") and own is None:
                links = [Link(self._ctx(*self._anchor(key, k, attrs)), {"aftraj.link": "decisive_step"})]
            span = self._span(SPAN_NAME, self._ctx(tid, parent_sid), derived_id(f"{key}/{seq}", "verdict", 16),
                              attributes=attrs, links=links)
        try:
            span.add_event(EVAL_EVENT, attributes=evaluation_attributes(v))
            if v.get("decision") == "ALARM":
                span.set_status(Status(StatusCode.ERROR, str(v.get("reason") or "ALARM")))
        finally:
            span.end()

    def flush(self) -> None:
        fn = getattr(self.provider, "force_flush", None)
        if fn is not None:
            fn()


class LangfuseVerdictEmitter:
    """Each verdict as a Langfuse score on the judged step's observation (module docstring)."""

    def __init__(self, client=None):
        if client is None:
            from langfuse import Langfuse
            client = Langfuse()
        self.client = client
        self._steps = _Remembered()

    def trace_id(self, tenant: str, run_id: str) -> str:
        """The run's trace when no step names one: derived from tenant and run."""
        return self.client.create_trace_id(seed=run_key(tenant, run_id))

    def _observation(self, key: str, tenant: str, rid: str, t: Any, agent: Any) -> tuple[str, str]:
        """(trace id, observation id) of step t: an `aftraj.step` observation created once."""
        got = self._steps.get((key, t))
        if got is not None:
            return got
        tid = self.trace_id(tenant, rid)
        obs = self.client.start_observation(trace_context={"trace_id": tid}, name="aftraj.step", as_type="span",
                                            metadata={"run_id": rid, "tenant": tenant, "step": t,
                                                      **({"agent": agent} if agent else {})})
        obs.end()
        got = (tid, obs.id)
        self._steps.add((key, t), got)
        return got

    def emit(self, v: dict, *, tenant: str, run_id: str | None = None, model: str | None = None,
             step: Any = None) -> None:
        rid = run_id or v.get("run_id") or "run"
        key = run_key(tenant, rid)
        seq = v.get("seq", v.get("t"))
        meta = {k: x for k, x in (("step", v.get("t")), ("decisive_step", v.get("k")), ("agent", v.get("agent")),
                                  ("latency_ms", v.get("latency_ms")), ("model", model), ("auditor", v.get("auditor")),
                                  ("confidence", v.get("confidence")), ("action", v.get("action")),
                                  ("run_id", rid), ("tenant", tenant), ("seq", v.get("seq"))) if x is not None}
        own = step_span(step, seq)
        tid, oid = own if own is not None else self._observation(key, tenant, rid, v.get("t"), v.get("agent"))
        self.client.create_score(name=SCORE_NAME, value=str(v.get("decision")), data_type="CATEGORICAL",
                                 trace_id=tid, observation_id=oid, score_id=derived_id(f"{key}/{seq}", "score", 32),
                                 metadata=meta, comment=v.get("reason") or f"step {v.get('t')}: {v.get('decision')}")

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

    def emit(self, v: dict, *, tenant: str, run_id: str | None = None, model: str | None = None,
             step: Any = None) -> None:
        """Each emitter's `emit`; `tenant` (required) and the run id derive every external id,
        `step` (the judged step's event, or the posted batch) places the verdict on its span."""
        for e in self.emitters:
            try:
                e.emit(v, tenant=tenant, run_id=run_id, model=model, step=step)
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
        named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; ours only when neither names it
        provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "agentforesight"}))
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


__all__ = ["Emitters", "LangfuseVerdictEmitter", "OtelVerdictEmitter", "derived_id", "evaluation_attributes",
           "from_env", "from_spec", "prediction_verdicts", "run_key", "step_span", "verdict_attributes"]

