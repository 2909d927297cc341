"""Issue 45 items 2 and 3: whatever the gateway does — drip its answer a byte at a time, hang,
answer 300 MB, answer JSON of the wrong shape (null, [], a string, a number, a cut object), not
JSON, a 3xx or a 204 — a hook step never raises into the agent and never takes more than its
deadline (+ 0.5 s), for each framework hook (smolagents, AG2, the OpenAI Agents SDK, the OTel
span processor). The gateway is tests/adapters/bad_gateway.py on 127.0.0.1. Also: the circuit
breaker (N failures, then no call for the cool-down), `flush(timeout)`/`close()` delivering what
was kept during an outage, and `HookClient`'s size cap. Before: a `null` verdict raised
AttributeError out of `_GatewayRun.post`, a 3xx counted as a verdict, a drip held a step 30 s,
and kept events were lost at exit. Needs the `adapters` extra. The figures with the issue's own
shapes (1.5 s drip, 2 s deadline, 300 MB): benchmarks/hook_deadline.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from aftraj.adapters.hooks import (AG2GatewayHook, GatewaySpanProcessor, HookClient, SmolagentsGatewayHook,
                                   _GatewayRun, openai_agents_hooks)


def _load(name):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fw = _load("scripted_frameworks")
bad = _load("bad_gateway")

DEADLINE = 0.5
MODES = ("drip", "hang", "huge", "declared", "malformed", "redirect")
KIND = {"drip": "deadline", "hang": "deadline", "huge": "oversize", "declared": "oversize",
        "malformed": "malformed", "redirect": "HTTP 302"}
# the breaker is off (max_failures) so that every step pays the gateway's worst
HOOK_KW = dict(deadline_s=DEADLINE, max_failures=10**6)


@pytest.fixture
def gateway():
    made = []

    def make(mode):
        g = bad.BadGateway(mode, drip_s=0.2, huge_mb=300)
        made.append(g)
        return g
    yield make
    for g in made:
        g.close()


def _check(hook, mode, steps_s, raised):
    assert raised == [], raised
    assert steps_s and max(steps_s) <= DEADLINE + 0.5, (mode, max(steps_s))
    assert hook.verdicts == [] and hook.alarm is None and hook.halt is None
    assert hook.failed_posts >= 1
    want = KIND[mode]
    if mode == "malformed":       # the first answers are JSON of the wrong shape: each is a failure
        assert all(f.startswith(("malformed", "http")) for f in hook.failures), hook.failures
    else:
        assert all(want in f for f in hook.failures), hook.failures
    assert hook.dropped_events + len(hook.pending) == hook.seq     # nothing kept is lost, nothing refused


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_smolagents_step_keeps_its_deadline(gateway, mode):
    pytest.importorskip("smolagents")
    from smolagents import ToolCallingAgent
    from serve.client import GatewayClient
    g = gateway(mode)
    hook = bad.timed(SmolagentsGatewayHook(GatewayClient(g.url, "k", timeout=DEADLINE, retries=1),
                                           max_failures=10**6))
    agent = ToolCallingAgent(tools=fw.smolagents_tools(), model=fw.smolagents_model(fw.SMOL_SCRIPT), name="calc",
                             verbosity_level=0, max_steps=6, step_callbacks=hook.step_callbacks())
    assert agent.run("How many pens?") == "408 pens; Paris: 2.1 million"
    _check(hook, mode, hook.step_s, hook.raised)
    if mode in ("huge", "declared"):
        assert g.sent_bytes < 64 * 2**20          # the hook stopped reading: the gateway could not send 300 MB
    hook.close(timeout=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_ag2_step_keeps_its_deadline(gateway, mode):
    pytest.importorskip("autogen")
    executor, mgr, gc, (planner, calc) = fw.ag2_groupchat()
    hook = bad.timed(AG2GatewayHook(gateway(mode).url, **HOOK_KW)).attach(executor, planner, calc)
    executor.initiate_chat(mgr, message="How many pens in 17 boxes of 24?", silent=True)
    assert "TERMINATE" in gc.messages[-1]["content"]
    _check(hook, mode, hook.step_s, hook.raised)
    hook.close(timeout=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_openai_agents_step_keeps_its_deadline(gateway, mode):
    from agents import Runner
    triage, _ = fw.openai_agents_triage()
    hooks = bad.timed(openai_agents_hooks(gateway(mode).url, **HOOK_KW))
    assert Runner.run_sync(triage, "How many pens in 17 boxes of 24?", hooks=hooks).final_output == "408 pens"
    _check(hooks, mode, hooks.step_s, hooks.raised)
    hooks.close(timeout=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_otel_span_processor_keeps_its_deadline(gateway, mode):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    proc = GatewaySpanProcessor(gateway(mode).url, **HOOK_KW)
    bad.timed(proc, "on_start")
    starts = proc.step_s
    bad.timed(proc, "on_end")
    tp = TracerProvider()
    tp.add_span_processor(proc)
    fw.otel_agent_run(tp)
    ((_, grun),) = proc.finished.values()
    _check(grun, mode, starts + proc.step_s, proc.raised)
    assert proc.alarm is None
    proc.shutdown()


def test_a_verdict_of_any_shape_is_a_failure_not_an_exception(gateway):
    """Issue 45.2's own shapes, one post each: before, `null` raised AttributeError from post."""
    from aftraj.adapters.base import RunBuilder
    from serve.client import GatewayClient
    g = gateway("malformed")
    rb = RunBuilder("r-shapes", source="test")
    run = _GatewayRun(GatewayClient(g.url, "k", timeout=DEADLINE, retries=0), run_id="r-shapes", max_failures=10**6)
    for i in range(len(bad.MALFORMED)):
        assert run.post([rb.message("a", f"step {i}")]) is None
    assert run.failed_posts == len(bad.MALFORMED) and run.verdicts == []
    assert sum(f.startswith("malformed") for f in run.failures) == len(bad.MALFORMED) - 1   # 204: no JSON
    assert sum("HTTP 302" in f for f in run.failures) == 1           # a 3xx is not a verdict
    assert len(run.pending) == len(bad.MALFORMED)                  # all kept for a resend
    # a duck-typed client answering a non-dict is caught too (before: AttributeError into the agent)

    class Odd:
        def create_run(self, *a, **kw):
            return "r"

        def post_events(self, *a, **kw):
            return None
    run = _GatewayRun(Odd(), run_id="r", **HOOK_KW)
    assert run.post([rb.message("a", "x")]) is None and "malformed" in run.failures[0]


def test_circuit_breaker_then_flush_delivers_what_was_kept(live_gateway):
    """N failures in a row: no call for the cool-down (fail open, events kept); then `flush`
    delivers them all, and `close` too (before: no flush/close, kept events were lost at exit)."""
    from aftraj.adapters.base import RunBuilder
    from serve.client import GatewayClient
    url, key, _ = live_gateway("never appears")
    g = bad.BadGateway("hang")
    rb = RunBuilder("r-breaker", source="test")
    run = _GatewayRun(HookClient(g.url, key, deadline_s=0.3), run_id="r-breaker", max_failures=2, cooldown_s=60)
    for i in range(5):
        run.post([rb.message("a", f"step {i}")])
    assert run.failed_posts == 2 and run.skipped_posts == 3 and len(run.pending) == 5
    assert len(g.requests) == 2              # the open breaker made no call
    g.close()
    run.gw = HookClient(url, key)            # the gateway is back (same run, same events)
    assert run.flush(timeout=5.0) is True and run.pending == []
    with GatewayClient(url, key) as gw:
        view = gw.run("r-breaker")
    assert view["verdicts"][-1]["t"] == 4 and view["verdicts"][-1]["accepted"] == 5
    assert run.close(timeout=1.0) is True


def test_hook_client_caps_the_answer_and_keeps_the_deadline():
    from aftraj.llm_client import EndpointError
    with bad.BadGateway("huge", huge_mb=300) as url:
        c = HookClient(url, "k", deadline_s=2.0, max_answer_bytes=1 << 20)
        with pytest.raises(EndpointError) as e:
            c.post_events("r", [])
        assert e.value.kind == "oversize"
        c.close()
    import time
    with bad.BadGateway("drip", drip_s=0.2) as url:
        c = HookClient(url, "k", deadline_s=0.6)
        t0 = time.monotonic()
        with pytest.raises(EndpointError) as e:
            c.create_run("t")
        assert e.value.kind == "deadline" and time.monotonic() - t0 < 0.6 + 0.5
        c.close()
