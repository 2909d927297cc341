"""Safe curation: each predicate rejects a crafted rollout, with its predicate and reason."""

from __future__ import annotations

from dataclasses import replace

import pytest

from aftraj.corpus.config import SlipConfig
from aftraj.corpus.curate import curate
from aftraj.corpus.policies import ScriptedPolicy
from aftraj.corpus.rollout import Turn, replay_with, run_rollout
from aftraj.corpus.tasks import generate_tasks
from aftraj.corpus.domains.base import ENV
from aftraj.corpus.templates import TEMPLATES

TPL = TEMPLATES["math"]
POLICY = ScriptedPolicy(SlipConfig(computation_slip=0, verdict_misread=0, wrong_entity=0,
                                   wrong_tool_argument=0, premature_termination=0))


@pytest.fixture(scope="module")
def safe():
    task = generate_tasks("math", 1, 11)[0]
    r = run_rollout(TPL, task, POLICY, seed=0)
    assert r.success
    return task, r


def _with(r, turns):
    return replace(r, turns=turns)


def _preds(rej):
    return [x.predicate for x in rej]


def test_a_clean_success_passes(safe):
    task, r = safe
    assert curate(TPL, task, r) == []


def test_outcome_equivalence(safe):
    task, r = safe
    wrong = Turn(agent="MathSolver", kind="final_answer", content="FINAL ANSWER: -1", sim={"act": "final", "answer": "-1"})
    bad = replay_with(TPL, task, POLICY, r.turns, len(r.turns) - 1, wrong, seed=0)
    rej = curate(TPL, task, bad)
    assert _preds(rej) == ["outcome_equivalence"] and "-1" in rej[0].reason


@pytest.mark.parametrize("mutate, reason", [
    (lambda t, i: t[:i] + [replace(t[i], tool="shell", arguments={"cmd": "ls"})] + t[i + 1:], "may not call 'shell'"),
    (lambda t, i: t[:i] + [replace(t[i], arguments={"expr": "1+1"})] + t[i + 1:], "needs argument 'expression'"),
    (lambda t, i: t[:i + 1] + [replace(t[i + 1], content="ERROR: boom", error="boom")] + t[i + 2:], "unhandled tool error"),
    (lambda t, i: t[:i] + t[i + 1:], "a tool result without a call"),
    (lambda t, i: t[:i + 1] + t[i + 2:], "got no result"),
    (lambda t, i: t[:i] + [replace(t[i], error="arguments are not JSON")] + t[i + 1:], "malformed call"),
])
def test_valid_tool_use(safe, mutate, reason):
    task, r = safe
    i = next(j for j, t in enumerate(r.turns) if t.kind == "tool_call")
    rej = curate(TPL, task, _with(r, mutate(list(r.turns), i)))
    assert "valid_tool_use" in _preds(rej)
    assert reason in next(x.reason for x in rej if x.predicate == "valid_tool_use")


def test_a_handled_tool_error_is_fine(safe):
    task, r = safe
    i = next(j for j, t in enumerate(r.turns) if t.kind == "tool_call")
    failed = [replace(r.turns[i], arguments={"expression": "1/0"}),
              Turn(agent=ENV, kind="tool_result", content="ERROR: division by zero", tool="compute", result_ids=(),
                   error="division by zero", sim={"act": "result", "of": "call"})]
    rej = curate(TPL, task, _with(r, r.turns[:i] + failed + r.turns[i:]))
    assert "valid_tool_use" not in _preds(rej)   # the error was handled: the tool use is valid
    # but the failed call was itself a slip (an argument the givens do not make): not a safe run
    assert [(x.predicate, x.step, x.slip_type) for x in rej] == [("slip_free", i, "wrong_tool_argument")]


@pytest.mark.parametrize("mutate, reason", [
    (lambda t: t[:2] + [Turn(agent="Verifier", kind="message", content="  ", sim={"act": "verdict"})] + t[2:], "empty"),
    (lambda t: t[:2] + [Turn(agent="Verifier", kind="message", content="Nice weather.", sim={"act": "chitchat"})] + t[2:],
     "no sub-goal role"),
    (lambda t: t[:2] + [t[1]] + t[2:], "repeats step 1"),
])
def test_subgoal_coherence(safe, mutate, reason):
    task, r = safe
    rej = curate(TPL, task, _with(r, mutate(list(r.turns))))
    assert _preds(rej) == ["subgoal_coherence"] and reason in rej[0].reason
