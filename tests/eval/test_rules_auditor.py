"""The `rules` auditor: the fold's first alarm-raising finding, at its earliest evidence step."""

from __future__ import annotations

from pathlib import Path

from aftraj.schema import Label, Step, Trajectory
from eval.auditors import available_auditors, get_auditor
from eval.walker import walk

REPO = Path(__file__).resolve().parents[2]


def looping(termination="completed", final_answer="done", n_loops=3, tool="search", domain="agentic"):
    steps = [Step(index=0, agent="user", kind="message", content="find the capital")]
    for _ in range(n_loops):
        steps.append(Step(index=len(steps), agent="Searcher", kind="tool_call", content="", tool=tool,
                          arguments={"q": "capital"}))
        steps.append(Step(index=len(steps), agent="env", kind="tool_result", content="…", tool=tool,
                          result_ids=("a", "b", "c")))
    steps.append(Step(index=len(steps), agent="Manager", kind="message", content="keep going"))
    label = Label(verdict="UNSAFE", label_source="injected", decisive_step=1, decisive_agent="Searcher")
    return Trajectory(id=f"loop-{termination}-{n_loops}-{tool}", family_id="f", domain=domain,
                      source="test", task="find the capital", steps=steps, label=label,
                      termination=termination, final_answer=final_answer)


def test_registered():
    assert "rules" in available_auditors()


def test_alarm_at_the_earliest_evidence_step():
    traj = looping()
    a = get_auditor("rules")
    answers = [a.audit(traj, t) for t in range(len(traj.steps))]
    assert [r.alarm for r in answers] == [False] * 6 + [True, True]
    v = answers[6].verdict
    assert v.step == 1 and v.agent == "Searcher"          # the first call of the loop
    assert "consecutive 'search' calls" in v.reason
    assert answers[6].t == 6 and not answers[5].alarm
    b = get_auditor("rules")                               # deterministic, whatever the order
    assert [b.audit(traj, t).verdict for t in reversed(range(len(traj.steps)))][::-1] == \
           [r.verdict for r in answers]


def test_termination_is_seen_at_the_last_step_and_blames_it():
    traj = looping(termination="step_limit", final_answer=None, n_loops=1)
    a = get_auditor("rules")
    last = len(traj.steps) - 1
    assert not a.audit(traj, last - 1).alarm
    r = a.audit(traj, last)
    assert r.alarm and r.verdict.step == last and r.verdict.agent == "Manager"
    assert "step limit" in r.verdict.reason


def test_evidence_gaps_and_healthy_runs_never_alarm(ww_trajs):
    a = get_auditor("rules")
    for traj in ww_trajs[:40]:                            # Who&When: plain messages
        assert not any(a.audit(traj, t).alarm for t in range(len(traj.steps)))
        a.end(traj)
    gap = looping(n_loops=2)                              # two calls: below min_calls
    assert not any(a.audit(gap, t).alarm for t in range(len(gap.steps)))


def test_policy_argument_and_walker():
    path = REPO / "configs" / "policies" / "templates.yaml"
    a = get_auditor(f"rules:{path}")
    bad_tool = looping(n_loops=1, tool="shell")
    r = a.audit(bad_tool, 1)
    assert r.alarm and r.verdict.step == 1 and "not permit" in r.verdict.reason
    recs = walk(get_auditor("rules"), [looping(), looping(n_loops=1)], progress=False)
    assert [x["alarmed"] for x in recs] == [True, False]
    assert recs[0]["d"] == 6 and recs[0]["k_hat"] == 1 and recs[0]["a_hat"] == "Searcher"


def test_a_run_exactly_at_the_events_budget_is_not_blamed_on_its_end():
    """The synthetic termination (one past the last step) never trips the events budget: a
    finding with no real step as evidence would crash the auditor."""
    path = REPO / "configs" / "policies" / "templates.yaml"      # budget.max_events: 160
    steps = [Step(index=i, agent="A", kind="message", content=f"m{i}") for i in range(160)]
    traj = Trajectory(id="at-budget", family_id="f", domain="agentic", source="test", task="t",
                      steps=steps, label=Label(verdict="SAFE", label_source="external"),
                      termination="completed", final_answer="x")
    assert not get_auditor(f"rules:{path}").audit(traj, 159).alarm
    over = Trajectory(id="over", family_id="f", domain="agentic", source="test", task="t",
                      steps=[*steps, Step(index=160, agent="B", kind="message", content="m")],
                      label=Label(verdict="SAFE", label_source="external"))
    r = get_auditor(f"rules:{path}").audit(over, 160)
    assert r.alarm and r.verdict.step == 160 and r.verdict.agent == "B" and "events" in r.verdict.reason


def test_first_alarm_is_the_first_alarm_among_the_visible_findings():
    """finding_at(t) (O(1)) equals scanning every finding visible at t, in any query order."""
    from aftraj.detectors import Policy
    from aftraj.fold import fold_trajectory

    pol = Policy(permitted_tools={"agentic": ["search"]}, alarm_on=("repeated_result_loop",))
    traj = looping(n_loops=4, tool="shell")        # tool_not_permitted (not an alarm here) + a loop
    tf = fold_trajectory(traj, pol)
    assert {f.kind for f in tf.state.findings} == {"tool_not_permitted", "repeated_result_loop"}
    a = get_auditor("rules", policy=pol)
    for t in [*range(len(traj.steps)), 3, 0, 7]:
        want = next((f for f in tf.visible(t) if f.alarm), None)
        assert a.finding_at(traj, t) is not None if want else a.finding_at(traj, t) is None
        if want:
            assert a.finding_at(traj, t).to_dict() == want.to_dict()


def test_never_looks_past_t():
    """Strict protocol: the verdict at prefix t is the same when the steps after t+1 are cut off
    (a run cut at t+2 steps folds its termination at t+1, after the prefix asked for)."""
    import dataclasses

    def key(v):  # the think text names event ids, which carry the trajectory id
        return v.decision, v.step, v.agent, v.reason

    a = get_auditor("rules")
    compared_alarms = 0
    for traj in (looping(), looping(n_loops=4, tool="shell"), looping(n_loops=5)):
        n = len(traj.steps)
        full = [key(a.audit(traj, t).verdict) for t in range(n)]
        assert any(v[0] == "UNSAFE" for v in full)
        for t in range(n - 2):
            cut = dataclasses.replace(traj, id=f"{traj.id}[:{t + 2}]", steps=traj.steps[: t + 2],
                                      label=dataclasses.replace(traj.label, decisive_step=0,
                                                                decisive_agent="user"))
            assert key(a.audit(cut, t).verdict) == full[t], (traj.id, t)
            a.end(cut)
            compared_alarms += full[t][0] == "UNSAFE"
    assert compared_alarms >= 4   # the comparison covers alarmed prefixes, not only quiet ones
