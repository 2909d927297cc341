"""A corpus only reading can solve (issue 43, DESIGN §4 "Safe runs that look like real runs"):
safe runs meet and handle failures (environment faults, drafts that do not load, plans that miss
a stage, searches that find nothing) at about the rate unsafe runs do before k*; no prefix appears
with contradictory labels; decisive steps are the honest step's own template with its content
changed; a twin's step k* has the post's kind, tool and agent."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import replace

import pytest

from aftraj.boundary import find_twins, is_twin
from aftraj.corpus.config import SlipConfig
from aftraj.corpus.curate import curate
from aftraj.corpus.policies import ScriptedPolicy
from aftraj.corpus.rollout import run_rollout
from aftraj.corpus.slips import find_slips
from aftraj.corpus.tasks import generate_tasks
from aftraj.corpus.templates import template_for

# the error vocabulary of issue 43 item 1 (the lexical floor's words)
ERROR_WORDS = re.compile(r"error|fail|wrong|exception|incorrect|reject|traceback", re.I)
NON_AGENTS = {"environment", "User"}
NO_SLIPS = dict(computation_slip=0.0, verdict_misread=0.0, wrong_entity=0.0, wrong_tool_argument=0.0,
                premature_termination=0.0, transient_error=0.0, draft_error=0.0, plan_slip=0.0, empty_search=0.0)


def _runs(domain, sandbox, n=12, **rates):
    """Rollouts of n tasks with only `rates` switched on (every other slip off)."""
    from aftraj.corpus.build import precompute_tests

    tasks = generate_tasks(domain, n, 5)
    if domain == "coding":
        precompute_tests(tasks, sandbox)
    tpl = template_for(domain)
    policy = ScriptedPolicy(SlipConfig(**{**NO_SLIPS, **rates}))
    return tpl, [(t, run_rollout(tpl, t, policy, seed=5, sandbox=sandbox)) for t in tasks]


def _accepted(tpl, runs):
    return [(t, r) for t, r in runs if r.success and not curate(tpl, t, r)]


# --------------------------------------------------------------------------- handled failures are safe

@pytest.mark.parametrize("domain", ["math", "coding", "agentic"])
def test_a_transient_tool_fault_is_retried_and_the_run_stays_safe(domain, sandbox):
    tpl, runs = _runs(domain, sandbox, transient_error=1.0)
    faults = 0
    for _, r in runs:
        for i, t in enumerate(r.turns):
            if t.kind == "tool_result" and t.sim.get("transient"):
                faults += 1
                assert t.content.startswith("ERROR: ") and t.error
                retry = r.turns[i + 1]
                assert (retry.agent, retry.kind, retry.tool, retry.arguments) == \
                    (r.turns[i - 1].agent, "tool_call", r.turns[i - 1].tool, r.turns[i - 1].arguments)
                assert ERROR_WORDS.search(retry.content.split("\n")[0])   # the retry says why
                assert not r.turns[i + 2].error                             # a retry always goes through
    assert faults >= len(runs)
    ok = _accepted(tpl, runs)
    assert len(ok) >= len(runs) // 2, [r.check_reason for _, r in runs]
    for task, r in ok:
        assert find_slips(tpl, task, r.turns) == []


def test_a_draft_that_does_not_load_is_rejected_by_the_tests_then_fixed(sandbox):
    tpl, runs = _runs("coding", sandbox, draft_error=1.0)
    ok = _accepted(tpl, runs)
    assert len(ok) >= 3       # a draft for every function: modules of 4-5 functions reach the step cap
    for _, r in ok:
        verdicts = [t for t in r.turns if t.sim.get("act") == "verdict"]
        rejected = [v for v in verdicts if not v.sim["ok"]]
        assert rejected and all("REJECT" in v.content for v in rejected)
        assert any(re.search(r"FAIL test_\d+: error: (Syntax|Indentation)Error", v.content) for v in rejected)
        assert verdicts[-1].sim["ok"]


def test_a_plan_missing_a_stage_is_caught_and_redone(sandbox):
    tpl, runs = _runs("math", sandbox, plan_slip=1.0)
    checked = 0
    for _, r in _accepted(tpl, runs):
        acts = [t.sim.get("act") for t in r.turns]
        if "plan_check" in acts:
            checked += 1
            i = acts.index("plan_check")
            assert acts[i - 1] == acts[i + 1] == "plan" and "INCORRECT" in r.turns[i].content
            assert r.turns[i].agent == "Verifier"
    assert checked >= 3


def test_an_empty_search_is_followed_by_another_query(sandbox):
    tpl, runs = _runs("agentic", sandbox, empty_search=1.0)
    empty = 0
    for _, r in _accepted(tpl, runs):
        for i, t in enumerate(r.turns):
            if t.kind == "tool_result" and t.tool == "search" and t.content == "no results":
                empty += 1
                nxt = r.turns[i + 1]
                assert nxt.tool == "search" and nxt.arguments != r.turns[i - 1].arguments
    assert empty >= 3


# --------------------------------------------------------------------------- the built corpus

def _prefix_keys(traj):
    """A running hash of every prefix 0..t as the auditor sees it (agent, kind, content, tool,
    arguments, error of each step)."""
    h = hashlib.blake2b(digest_size=16)
    for s in traj.steps:
        h.update(repr((s.agent, s.kind, s.content, s.tool, s.arguments, s.error)).encode())
        yield s.index, h.copy().hexdigest()


def test_no_prefix_appears_with_contradictory_labels(demo_build):
    """The label rule that keeps the corpus consistent: a prefix that is SAFE in one run (a safe
    run, or before k* in an unsafe one) is never ALARM (t >= k*) in another."""
    label_of: dict[str, set[str]] = {}
    for t in demo_build.trajectories:
        k = t.label.decisive_step if t.label.unsafe else None
        for i, key in _prefix_keys(t):
            label_of.setdefault(key, set()).add("ALARM" if k is not None and i >= k else "SAFE")
    both = [key for key, labels in label_of.items() if len(labels) > 1]
    assert not both, f"{len(both)} prefixes carry both labels"


def test_safe_runs_speak_of_failure_as_unsafe_runs_do_before_k_star(demo_build):
    safe = [t for t in demo_build.trajectories if not t.label.unsafe]
    unsafe = [t for t in demo_build.trajectories if t.label.unsafe]

    def speaks(steps):
        return any(s.agent not in NON_AGENTS and ERROR_WORDS.search(s.content) for s in steps)

    safe_rate = sum(speaks(t.steps[1:]) for t in safe) / len(safe)
    pre_rate = sum(speaks(t.steps[1:t.label.decisive_step]) for t in unsafe) / len(unsafe)
    assert safe_rate >= 0.15                              # issue 43's floor
    assert safe_rate >= 0.8 * pre_rate, (safe_rate, pre_rate)
    # and the failures are events, not only words: faults, rejected drafts, redone plans, empty searches
    events = Counter()
    for t in safe:
        for s in t.steps:
            if s.kind == "tool_result" and s.error:
                events["fault"] += 1
            if re.search(r"^REJECT|\nREJECT", s.content):
                events["reject"] += 1
            if "INCORRECT" in s.content:
                events["incorrect"] += 1
            if s.content == "no results":
                events["empty"] += 1
    assert all(events[e] > 0 for e in ("fault", "reject", "incorrect", "empty")), events


def test_decisive_steps_carry_no_constant_strings(demo_build):
    """An injected step k* is the honest step's own template with its content changed: its thought
    line is one honest steps use too, and no line of it is shared by many k* steps and no safe step."""
    safe_lines, kstar_lines = Counter(), Counter()
    for t in demo_build.trajectories:
        if not t.label.unsafe:
            for s in t.steps:
                safe_lines.update(set(s.content.split("\n")))
        elif t.label.label_source == "injected":
            kstar_lines.update(set(t.steps[t.label.decisive_step].content.split("\n")))
    only_kstar = {line: n for line, n in kstar_lines.items() if n >= 5 and line not in safe_lines}
    assert not only_kstar, only_kstar
    injected = [t for t in demo_build.trajectories if t.label.unsafe and t.label.label_source == "injected"]
    thoughts = [t.steps[t.label.decisive_step].content.split("\n")[0] for t in injected]
    honest = sum(line in safe_lines for line in thoughts)
    assert honest >= 0.9 * len(thoughts), (honest, len(thoughts))
    for old in ("I already know how this goes", "fails on the edge case"):
        assert not any(old in t.steps[t.label.decisive_step].content for t in injected)


def test_twins_match_the_posts_step_kind_tool_and_agent(demo_build):
    twins = find_twins(demo_build.trajectories)
    assert len(twins) >= 20
    by_id = {t.id: t for t in demo_build.trajectories}
    for uid, twin in twins.items():
        k = by_id[uid].label.decisive_step
        a, b = by_id[uid].steps[k], twin.steps[k]
        assert (a.agent, a.kind, a.tool) == (b.agent, b.kind, b.tool)


def test_a_post_whose_step_changed_kind_has_no_twin(demo_build):
    by_id = {t.id: t for t in demo_build.trajectories}
    uid, twin = next(iter(find_twins(demo_build.trajectories).items()))
    post = by_id[uid]
    k = post.label.decisive_step
    changed = replace(post, steps=[*post.steps[:k], replace(post.steps[k], kind="tool_call" if post.steps[k].kind
                                                           != "tool_call" else "message"), *post.steps[k + 1:]])
    assert is_twin(post, twin) and not is_twin(changed, twin)
