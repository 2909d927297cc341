"""A live gateway for the hook tests: the real FastAPI app served by uvicorn on 127.0.0.1 in a
thread, with a scripted auditor (an httpx MockTransport standing in for vLLM) that alarms at the
first shown step holding a trigger string, blaming that step's agent. The gateway emits every
verdict (aftraj/adapters/emit.py) as an OTel span into an in-memory exporter (`auditor.spans`)
and as a Langfuse score through the Langfuse SDK with a mocked HTTP client (`auditor.scores()`:
the score bodies it sent) when the `adapters` extra is installed."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest

KEY = "adapters-test-key"
_STEP = re.compile(r'<step index=(\d+) agent="((?:[^"\\]|\\.)*)"')


class TriggerAuditor:
    def __init__(self, trigger: str):
        self.trigger, self.calls = trigger, 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        user = json.loads(request.content)["messages"][-1]["content"]
        steps = [(int(m.group(1)), json.loads(f'"{m.group(2)}"')) for m in _STEP.finditer(user)]
        blocks = user.split("<step index=")[1:]
        bad = next(((k, a) for (k, a), b in zip(steps, blocks, strict=True) if self.trigger in b), None)
        ans = ({"answer": "SAFE", "agent": None, "reason": None} if bad is None else
               {"answer": bad[0], "agent": bad[1], "reason": f"{self.trigger} is wrong"})
        return httpx.Response(200, json={
            "choices": [{"message": {"role": "assistant",
                                     "content": f"<think>checked</think><answer>{json.dumps(ans)}</answer>"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5}})


@pytest.fixture
def live_gateway(tmp_path):
    """make(trigger) -> (base_url, api_key, auditor): a gateway on a free local port."""
    pytest.importorskip("uvicorn")
    import uvicorn

    from serve.config import ApiKey, AuditorConfig, GatewayConfig, hash_key
    from serve.router import build_app
    from serve.service import GatewayService

    servers, closers = [], []

    def make(trigger: str):
        auditor = TriggerAuditor(trigger)
        auditor.spans = auditor.scores = None
        emitters = _emitters(auditor, closers)
        cfg = GatewayConfig(ledger_url=f"sqlite:///{tmp_path / f'ledger{len(servers)}.db'}",
                            api_keys=(ApiKey("t", hash_key(KEY)),),
                            auditor=AuditorConfig(backend="openai", base_url="http://auditor.test/v1",
                                                  model="auditor", deadline_s=5.0, tokenizer="approx"))
        import aftraj.adapters.emit as emit
        real, emit.from_env = emit.from_env, (lambda: emitters)
        try:
            app = build_app(GatewayService(cfg, transport=httpx.MockTransport(auditor)))
        finally:
            emit.from_env = real
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        t0 = time.monotonic()
        while not server.started:
            if time.monotonic() - t0 > 30:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.05)
        servers.append(server)
        return f"http://127.0.0.1:{port}", KEY, auditor

    yield make
    for s in servers:
        s.should_exit = True
    for c in closers:
        c()


def _emitters(auditor, closers):
    try:
        from langfuse import Langfuse
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    except ImportError:
        from aftraj.adapters.emit import Emitters
        return Emitters()
    from aftraj.adapters.emit import Emitters, LangfuseVerdictEmitter, OtelVerdictEmitter
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    sent = []

    def langfuse_api(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/api/public/scores":
            sent.extend(json.loads(req.content))
        return httpx.Response(200, json={})
    # a public key of its own: the SDK keeps one resource manager (queues, HTTP client) per key
    lf = Langfuse(public_key=f"pk-lf-test-{len(closers)}-{time.monotonic_ns()}", secret_key="sk-lf-test",
                  base_url="http://langfuse.test",
                  span_exporter=InMemorySpanExporter(), httpx_client=httpx.Client(transport=httpx.MockTransport(langfuse_api)))
    closers.append(lf.shutdown)

    def scores():
        lf.flush()
        return list(sent)
    auditor.spans, auditor.scores = spans, scores
    return Emitters([OtelVerdictEmitter(tp), LangfuseVerdictEmitter(lf)])


@pytest.fixture
def otel_memory():
    """(TracerProvider, InMemorySpanExporter): the OTel SDK writing spans to memory."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exp = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exp))
    return tp, exp
