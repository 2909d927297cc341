"""Constructive stream: every error type changes the targeted turn, the downstream agents act on
it, and the provenance names the type; recovery is detected, not assumed."""

from __future__ import annotations

import pytest

from aftraj.corpus.build import precompute_tests
from aftraj.corpus.config import ERROR_TYPES, SlipConfig
from aftraj.corpus.curate import curate
from aftraj.corpus.inject import corrupt, inject, targets
from aftraj.corpus.policies import ScriptedPolicy
from aftraj.corpus.rollout import run_rollout
from aftraj.corpus.tasks import generate_tasks
from aftraj.corpus.templates import TEMPLATES

POLICY = ScriptedPolicy(SlipConfig(computation_slip=0, verdict_misread=0, wrong_entity=0,
                                   wrong_tool_argument=0, premature_termination=0, catch_rate=0.6))


@pytest.fixture(scope="module")
def safe_runs(sandbox):
    out = {}
    for d, tpl in TEMPLATES.items():
        tasks = generate_tasks(d, 12, 21)
        precompute_tests(tasks, sandbox)
        out[d] = [(t, r) for t in tasks for r in [run_rollout(tpl, t, POLICY, seed=0, sandbox=sandbox)]
                  if r.success and not curate(tpl, t, r)]
    return out


@pytest.mark.parametrize("etype", ERROR_TYPES)
def test_each_type_changes_the_turn_and_names_itself(etype, safe_runs, sandbox):
    n_applied, kept, domains = 0, 0, set()
    for d, runs in safe_runs.items():
        tpl = TEMPLATES[d]
        for task, r in runs:
            for k in targets(tpl, task, r.turns, etype):
                res = inject(tpl, task, POLICY, r, etype, k, seed=0, sandbox=sandbox)
                if res.outcome == "not_applicable":
                    continue
                n_applied += 1
                domains.add(d)
                assert res.corrupted is not None and not res.corrupted.same_as(r.turns[k])
                # changed as the auditor sees it, not only in the simulator's reading (`sim`)
                seen = lambda t: (t.agent, t.kind, t.content, t.tool, t.arguments)  # noqa: E731
                assert seen(res.corrupted) != seen(r.turns[k])
                assert res.rollout.turns[:k] == r.turns[:k] and res.rollout.turns[k].same_as(res.corrupted)
                prov = res.provenance()
                assert prov["injection_type"] == etype and prov["step"] == k
                assert res.kept == (not res.rollout.success)
                kept += res.kept
    assert n_applied >= 5 and kept >= 1, (etype, n_applied, kept)
    assert len(domains) >= 2 or etype == "computation_slip"


def test_corruptions_are_deterministic(safe_runs):
    for d, runs in safe_runs.items():
        tpl = TEMPLATES[d]
        task, r = runs[0]
        for e in ERROR_TYPES:
            for k in targets(tpl, task, r.turns, e):
                assert corrupt(tpl, task, r.turns, k, e) == corrupt(tpl, task, r.turns, k, e)


def test_recovery_happens_and_is_recorded(safe_runs, sandbox):
    outcomes = set()
    for d, runs in safe_runs.items():
        tpl = TEMPLATES[d]
        for task, r in runs:
            for k in targets(tpl, task, r.turns, "wrong_tool_argument"):
                outcomes.add(inject(tpl, task, POLICY, r, "wrong_tool_argument", k, seed=0, sandbox=sandbox).outcome)
    assert "recovered" in outcomes   # a downstream checker caught the error: the injection is discarded
