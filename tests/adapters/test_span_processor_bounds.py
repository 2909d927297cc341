"""GatewaySpanProcessor's memory is bounded however many traces a process makes (issue 45.3): a
trace is forgotten from the live runs when its root span ends, live traces are capped (LRU), and
finished ones too; events an outage kept in a finished trace are still delivered by force_flush."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("opentelemetry.sdk")

from aftraj.adapters.hooks import GatewaySpanProcessor  # noqa: E402


class FakeGateway:
    """create_run/post_events in memory; `down` makes every call fail (a transient error)."""

    def __init__(self):
        self.posted: dict[str, list] = {}
        self.down = False
        self.lock = threading.Lock()

    def create_run(self, task, agents=(), category=None, run_id=None):
        if self.down:
            raise ConnectionError("gateway down")
        with self.lock:
            self.posted.setdefault(run_id, [])
        return run_id

    def post_events(self, run_id, events):
        if self.down:
            raise ConnectionError("gateway down")
        with self.lock:
            self.posted[run_id].extend(events)
        return {"decision": "CONTINUE", "seq": len(self.posted[run_id]), "t": 0}


def _provider(proc):
    from opentelemetry.sdk.trace import TracerProvider
    tp = TracerProvider()
    tp.add_span_processor(proc)
    return tp.get_tracer("bounds")


def _chat(tracer, text):
    with tracer.start_as_current_span("chat m", attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.output.messages": f'[{{"role": "assistant", "parts": [{{"type": "text", "content": "{text}"}}]}}]'}):
        pass


def test_a_trace_is_forgotten_when_its_root_span_ends():
    gw = FakeGateway()
    proc = GatewaySpanProcessor(gw)                # max_runs=1000, max_finished=100
    tracer = _provider(proc)
    for i in range(300):
        with tracer.start_as_current_span("invoke_agent a", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "a"}):
            _chat(tracer, f"answer {i}")
        assert len(proc.runs) == 0                  # before: one entry per trace, forever
    assert len(proc.finished) == 100 and len(gw.posted) == 300
    assert all(len(evs) == 2 for evs in gw.posted.values())    # the message, then the run's end
    (orun, grun) = next(reversed(proc.finished.values()))
    assert grun.verdicts and orun.rb.events[-1].kind == "message"


def test_live_traces_are_capped_least_recently_active_first(caplog):
    gw = FakeGateway()
    proc = GatewaySpanProcessor(gw, max_runs=5, max_finished=3)
    tracer = _provider(proc)
    roots = []
    with caplog.at_level("WARNING", logger="aftraj.hooks"):
        for i in range(20):                         # roots left open: never a root end
            root = tracer.start_span("invoke_agent a", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "a"})
            roots.append(root)
            from opentelemetry import trace
            with trace.use_span(root):
                _chat(tracer, f"answer {i}")
            assert len(proc.runs) <= 5 and len(proc.finished) <= 3
    assert list(proc.runs) == [format(r.get_span_context().trace_id, "032x") for r in roots[-5:]]
    assert "over max_runs=5 live traces" in caplog.text and len(gw.posted) == 20


def test_events_kept_in_an_outage_are_flushed_from_finished_traces_and_counted_when_dropped(caplog):
    gw = FakeGateway()
    gw.down = True
    proc = GatewaySpanProcessor(gw, max_finished=2, max_failures=1000)
    tracer = _provider(proc)
    with caplog.at_level("WARNING", logger="aftraj.hooks"):
        for i in range(3):
            with tracer.start_as_current_span("invoke_agent a", attributes={
                    "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "a"}):
                _chat(tracer, f"answer {i}")
    assert len(proc.runs) == 0 and len(proc.finished) == 2
    assert proc.dropped_events == 2 and "dropped (over max_finished=2" in caplog.text   # the first trace's
    gw.down = False
    assert proc.force_flush(5000) is True
    assert sorted(len(v) for v in gw.posted.values()) == [2, 2]


def test_caps_must_be_positive():
    with pytest.raises(ValueError, match="max_runs"):
        GatewaySpanProcessor(FakeGateway(), max_runs=0)
