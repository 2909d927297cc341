"""Templates x scripted policy: every turn becomes a schema Step, rollouts are seeded and
replayable from any step, the step cap holds, tool errors are recorded."""

from __future__ import annotations

from dataclasses import replace

import pytest

from aftraj.corpus.build import precompute_tests
from aftraj.corpus.config import SlipConfig
from aftraj.corpus.policies import ScriptedPolicy
from aftraj.corpus.rollout import Turn, replay_with, run_rollout
from aftraj.corpus.tasks import generate_tasks
from aftraj.corpus.domains.base import ENV
from aftraj.corpus.templates import TEMPLATES
from aftraj.schema import Trajectory, Label

POLICY = ScriptedPolicy(SlipConfig())


@pytest.fixture(scope="module")
def tasks(sandbox):
    ts = {d: generate_tasks(d, 30, 5) for d in TEMPLATES}
    precompute_tests(ts["coding"], sandbox)
    return ts


@pytest.mark.parametrize("domain", list(TEMPLATES))
def test_rollouts_are_schema_steps_with_tools(domain, tasks, sandbox):
    tpl = TEMPLATES[domain]
    runs = [run_rollout(tpl, t, POLICY, seed=0, sandbox=sandbox) for t in tasks[domain]]
    assert any(r.success for r in runs) and any(not r.success for r in runs)
    for r in runs:
        steps = [t.to_step(i, "x") for i, t in enumerate(r.turns)]
        traj = Trajectory(id="x", family_id="f", domain=domain, source=tpl.name, task="q", steps=steps,
                          label=Label("SAFE", "verified_safe"))
        assert set(traj.agents) <= {"User", ENV, tpl.lead, tpl.partner}
        assert steps[0].agent == "User" and len(steps) <= 40
        for i, s in enumerate(steps):
            if s.kind == "tool_call":
                assert s.tool in tpl.tools[s.agent] and isinstance(s.arguments, dict)
                if i + 1 < len(steps) or r.termination != "step_limit":   # the cap may cut after a call
                    assert steps[i + 1].kind == "tool_result" and steps[i + 1].agent == ENV
            if s.kind == "tool_result":
                assert s.result_ids is not None and s.tool == steps[i - 1].tool
        assert r.backend == "scripted" and r.model == "scripted-v1" and r.seed == 0
        if r.termination == "completed":
            assert steps[-1].kind == "final_answer"


@pytest.mark.parametrize("domain", list(TEMPLATES))
def test_rollouts_are_seeded_and_replayable(domain, tasks, sandbox):
    tpl = TEMPLATES[domain]
    for t in tasks[domain][:10]:
        a = run_rollout(tpl, t, POLICY, seed=3, sandbox=sandbox)
        b = run_rollout(tpl, t, POLICY, seed=3, sandbox=sandbox)
        assert a.turns == b.turns
        for j in range(1, len(a.turns)):   # replay from any step with its own turn: same run
            r = replay_with(tpl, t, POLICY, a.turns, j, a.turns[j], seed=3, sandbox=sandbox)
            assert r.turns == a.turns and r.success == a.success
    seeds = {tuple(run_rollout(tpl, t, POLICY, seed=s, sandbox=sandbox).slips.__repr__() for t in tasks[domain])
             for s in range(4)}
    assert len(seeds) > 1   # slips depend on the seed


def test_an_overridden_turn_propagates(tasks, sandbox):
    tpl = TEMPLATES["math"]
    t = tasks["math"][0]
    a = run_rollout(tpl, t, POLICY, seed=0, sandbox=sandbox)
    k = next(i for i, u in enumerate(a.turns) if u.sim.get("act") == "claim")
    bad = replace(a.turns[k], content="So it comes to 99999.", sim={**a.turns[k].sim, "value": "99999"})
    r = replay_with(tpl, t, POLICY, a.turns, k, bad, seed=0, sandbox=sandbox)
    nxt = next(u for u in r.turns[k + 1:] if u.kind == "tool_call")
    assert "99999" in nxt.arguments["expression"]


class _Chatty:
    backend, model = "test", "chatty"

    def __init__(self, call: bool):
        self.call = call

    def next_turn(self, template, task, turns, *, seed, clean=False):
        if self.call:
            return Turn(agent="MathSolver", kind="tool_call", content="", tool="compute", arguments={"expr": "1"})
        return Turn(agent="MathSolver", kind="message", content=f"thinking {len(turns)}")


def test_step_cap_and_tool_errors(tasks, sandbox):
    tpl = TEMPLATES["math"]
    r = run_rollout(tpl, tasks["math"][0], _Chatty(False), seed=0)
    assert r.termination == "step_limit" and len(r.turns) == 40 and not r.success
    assert r.check_reason.startswith("no final answer")
    r = run_rollout(tpl, tasks["math"][0], _Chatty(True), seed=0)
    assert r.termination == "tool_error" and len(r.turns) == 7
    assert any("compute needs argument 'expression'" in n for n in r.notes)
