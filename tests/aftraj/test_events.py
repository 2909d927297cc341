"""Events: validation, fingerprints, and the lossless steps <-> events mapping."""

from __future__ import annotations

import orjson
import pytest

from aftraj.events import (EVENT_KINDS, Event, EventError, event_to_step, events_to_steps,
                           fingerprint, make_event, parse_event, steps_to_events,
                           trajectory_to_events)
from aftraj.schema import Label, Step, Trajectory


def rec(**kw) -> dict:
    d = {"event_id": "r/0", "seq": 0, "run_id": "r", "kind": "message", "agent": "A",
         "payload": {"content": "hello"}}
    d.update(kw)
    return d


def test_parse_valid_and_fields():
    ev = parse_event(rec(usage={"input_tokens": 3, "output_tokens": 1, "model": "m", "id": "u1"},
                         ts=12.5, meta={"x": 1}))
    assert isinstance(ev, Event)
    assert (ev.event_id, ev.seq, ev.run_id, ev.kind, ev.agent, ev.ts) == ("r/0", 0, "r", "message", "A", 12.5)
    assert ev.usage["id"] == "u1" and ev.meta == {"x": 1}
    assert ev.fingerprint == fingerprint({"content": "hello"}) and len(ev.fingerprint) == 64


def test_fingerprint_is_canonical():
    a = parse_event(rec(kind="tool_result", payload={"content": "c", "tool": "s", "result_ids": ["1"]}))
    b = parse_event(rec(kind="tool_result", payload={"result_ids": ["1"], "tool": "s", "content": "c"}))
    c = parse_event(rec(kind="tool_result", payload={"result_ids": ["1"], "tool": "s", "content": "c",
                                                     "error": None}))
    d = parse_event(rec(kind="tool_result", payload={"result_ids": ["2"], "tool": "s", "content": "c"}))
    assert a.fingerprint == b.fingerprint == c.fingerprint != d.fingerprint
    assert "error" not in c.payload   # a null optional key is the same as no key


def test_fingerprint_given_must_match():
    good = fingerprint({"content": "hello"})
    assert parse_event(rec(fingerprint=good)).fingerprint == good
    with pytest.raises(EventError) as e:
        parse_event(rec(fingerprint="0" * 64))
    assert e.value.field == "fingerprint"


@pytest.mark.parametrize("bad, field", [
    (rec(event_id=""), "event_id"),
    (rec(run_id=None), "run_id"),
    (rec(kind="chat"), "kind"),
    (rec(kind=["message"]), "kind"),
    (rec(agent="  "), "agent"),
    (rec(seq=-1), "seq"),
    (rec(seq=True), "seq"),
    (rec(ts=[1]), "ts"),
    (rec(payload="hi"), "payload"),
    (rec(payload={"content": 3}), "payload.content"),
    (rec(payload={"content": "x", "tool": "t"}), "payload.tool"),
    (rec(kind="tool_call", payload={"content": ""}), "payload.tool"),
    (rec(kind="tool_result", payload={"content": "", "result_ids": "a,b"}), "payload.result_ids"),
    (rec(kind="tool_result", payload={"content": "", "result_ids": [1]}), "payload.result_ids[0]"),
    (rec(kind="termination", payload={"reason": "done"}), "payload.reason"),
    (rec(kind="handoff", payload={"content": ""}), "payload.to"),
    (rec(usage={"input_tokens": -1}), "usage.input_tokens"),
    (rec(usage={"tokens": 1}), "usage.tokens"),
    (rec(extra=1), "extra"),
    (rec(meta=[1]), "meta"),
    (rec(meta={"aftraj_event": {}}), "meta.aftraj_event"),
    # reserved keys an event may carry, with a value the step conversion could not use
    (rec(meta={"aftraj_step_kind": "bogus"}), "meta.aftraj_step_kind"),
    (rec(meta={"aftraj_step_kind": ["system"]}), "meta.aftraj_step_kind"),
    (rec(meta={"aftraj_generated_id": "yes"}), "meta.aftraj_generated_id"),
    (rec(meta={"aftraj_synthetic": 1}), "meta.aftraj_synthetic"),
    (rec(seq=1 << 63), "seq"),
    # token counts a run total could push past JSON's 64-bit integers (snapshot/hash would crash)
    (rec(usage={"input_tokens": 1 << 63, "model": "m"}), "usage.input_tokens"),
    (rec(usage={"output_tokens": 10**12}), "usage.output_tokens"),
    (rec(usage={"cached_tokens": 1 << 63}), "usage.cached_tokens"),
])
def test_bad_records_name_the_field(bad, field):
    with pytest.raises(EventError) as e:
        parse_event(bad)
    assert e.value.field == field, str(e.value)


@pytest.mark.parametrize("meta", [{"aftraj_step_kind": k} for k in ("message", "tool_call", "tool_result",
                                                                      "final_answer", "system")]
                         + [{"aftraj_generated_id": True}, {"aftraj_synthetic": False}])
def test_valid_reserved_meta_is_accepted(meta):
    assert parse_event(rec(meta=meta)).meta == meta


def test_record_round_trip():
    ev = parse_event(rec(kind="tool_call", parent_id=None, payload={"content": "", "tool": "search",
                                                                   "arguments": {"q": "x"}}))
    again = parse_event(orjson.loads(ev.dumps()))
    assert again == ev


def _all_kinds_events(run="run-1"):
    evs = [
        make_event(event_id="e0", run_id=run, kind="message", agent="user", payload={"content": "task"}, seq=0),
        make_event(event_id="e1", run_id=run, kind="thinking", agent="A", payload={"content": "hmm"}, seq=1,
                   usage={"input_tokens": 5, "output_tokens": 2, "model": "m", "id": "u1"}, ts=1.5),
        make_event(event_id="e2", run_id=run, kind="tool_call", agent="A", seq=2,
                   payload={"content": "", "tool": "search", "arguments": {"q": "x"}}),
        make_event(event_id="e3", run_id=run, kind="tool_result", agent="env", seq=3, parent_id="e2",
                   payload={"content": "r", "tool": "search", "result_ids": [], "retryable": False}),
        make_event(event_id="e4", run_id=run, kind="error", agent="env", seq=5, parent_id="e2",
                   payload={"content": "", "error": "boom", "retryable": True}),
        make_event(event_id="e5", run_id=run, kind="handoff", agent="A", seq=6,
                   payload={"content": "over", "to": "B"}, meta={"note": "x"}),
        make_event(event_id="e6", run_id=run, kind="final_answer", agent="B", seq=7, payload={"content": "42"}),
        make_event(event_id="e7", run_id=run, kind="termination", agent="system", seq=8,
                   payload={"reason": "completed", "final_answer": "42"}),
    ]
    assert sorted({e.kind for e in evs}) == sorted(EVENT_KINDS)
    return evs


def test_events_steps_events_is_exact():
    evs = _all_kinds_events()
    steps = events_to_steps(evs, "run-1")
    assert [s.kind for s in steps] == ["message", "message", "tool_call", "tool_result", "message",
                                      "message", "final_answer", "system"]
    back = steps_to_events(steps, "run-1")
    assert [e.to_record() for e in back] == [e.to_record() for e in evs]


def test_steps_events_steps_is_exact(ww_trajs):
    system = Step(index=0, agent="sys", kind="system", content="rules")
    odd = [system,
           Step(index=1, agent="A", kind="tool_call", content="", tool="t", arguments={"a": [1, 2]},
                event_id="given-id", meta={"k": "v"}),
           Step(index=2, agent="env", kind="tool_result", content="x", tool="t", result_ids=("1",),
                error="e"),
           Step(index=3, agent="env", kind="tool_result", content="x", result_ids=()),
           Step(index=4, agent="A", kind="final_answer", content="done")]
    for steps in [odd] + [list(t.steps) for t in ww_trajs[:20]]:
        evs = steps_to_events(steps, "rid")
        assert events_to_steps(evs, "rid") == steps
    ev = steps_to_events([system], "rid")[0]
    assert ev.kind == "message" and ev.meta["aftraj_step_kind"] == "system"
    assert event_to_step(ev, 0, "rid") == system


def test_reserved_step_meta_is_refused():
    step = Step(index=0, agent="A", kind="message", content="x", event_id="e",
                meta={"aftraj_generated_id": True})
    with pytest.raises(EventError) as e:
        steps_to_events([step], "r")
    assert e.value.field == "meta.aftraj_generated_id"


def test_trajectory_to_events_adds_termination():
    steps = [Step(index=0, agent="user", kind="message", content="q"),
             Step(index=1, agent="A", kind="final_answer", content="")]
    traj = Trajectory(id="t1", family_id="f", domain="math", source="s", task="q", steps=steps,
                      label=Label(verdict="SAFE", label_source="verified_safe"),
                      termination="step_limit", final_answer="")
    evs = trajectory_to_events(traj)
    assert len(evs) == 3 and evs[-1].kind == "termination"
    assert evs[-1].payload == {"reason": "step_limit", "final_answer": ""}
    assert evs[-1].meta["aftraj_synthetic"] is True
    assert events_to_steps(evs[:-1], "t1") == steps
