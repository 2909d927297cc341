"""Rule detectors: positives and healthy controls, and the policy files."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from aftraj.config import ConfigError    # a bad policy file is the one ConfigError
from aftraj.detectors import DEFAULT_POLICY_PATH, FINDING_KINDS, BudgetPolicy, Policy, load_policy
from aftraj.events import make_event
from aftraj.fold import RunState, fold, fold_trajectory
from aftraj.schema import Label, Step, Trajectory

REPO = Path(__file__).resolve().parents[2]


class Run:
    """A tiny trace builder: calls and results linked by parent_id."""

    def __init__(self, category=None, policy=None):
        self.state = RunState("r", category=category, policy=policy)
        self.seq = 0

    def add(self, kind, agent, payload, parent=None, usage=None):
        eid = f"r/{self.seq}"
        fold(self.state, make_event(event_id=eid, run_id="r", kind=kind, agent=agent,
                                    payload=payload, seq=self.seq, parent_id=parent, usage=usage))
        self.seq += 1
        return eid

    def call(self, tool, args=None, agent="A"):
        return self.add("tool_call", agent, {"content": "", "tool": tool, "arguments": args or {}})

    def result(self, call, ids, error=None, retryable=None):
        p = {"content": "…", "result_ids": ids, "error": error, "retryable": retryable}
        return self.add("tool_result", "env", p, parent=call)

    def tool(self, tool, ids, **kw):
        c = self.call(tool, kw.pop("args", None))
        return c, self.result(c, ids, **kw)

    def kinds(self):
        return [f.kind for f in self.state.findings]


def ids(*n):
    return [f"d{i}" for i in n]


# --------------------------------------------------------------------------- loops

def test_three_call_loop_with_overlap_080_fires():
    r = Run()
    c0, r0 = r.tool("search", ids(1, 2, 3, 4, 5))
    c1, r1 = r.tool("search", ids(1, 2, 3, 4, 6))   # 4/5 = 0.80
    assert r.kinds() == []
    c2, r2 = r.tool("search", ids(1, 2, 3, 4, 7))   # 4/5 = 0.80
    assert r.kinds() == ["repeated_result_loop"]
    f = r.state.findings[0]
    assert set(f.event_ids) == {c0, r0, c1, r1, c2, r2}
    assert f.steps == (0, 1, 2, 3, 4, 5) and f.policy_revision == 1 and f.alarm
    assert f.detail["overlaps"] == [0.8, 0.8] and "search" in f.reason
    r.tool("search", ids(1, 2, 3, 4, 8))             # the loop goes on: reported once
    assert r.kinds() == ["repeated_result_loop"]


def test_overlap_just_below_threshold_is_not_a_loop():
    r = Run()
    r.tool("search", ids(1, 2, 3, 4, 5))
    r.tool("search", ids(1, 2, 3, 6, 7))            # 3/5 = 0.6
    r.tool("search", ids(1, 2, 3, 8, 9))
    assert r.kinds() == []


def test_constraint_refinement_with_disjoint_results_is_not_a_loop():
    r = Run()
    for q, got in (("flights", ids(1, 2, 3)), ("flights june", ids(4, 5)), ("flights june 3", ids(6))):
        r.tool("search", got, args={"q": q})
    assert r.kinds() == []


def test_pagination_with_new_ids_is_not_a_loop():
    r = Run()
    for page in range(5):
        r.tool("list_docs", ids(*range(page * 10, page * 10 + 10)), args={"page": page})
    assert r.kinds() == []


def test_retry_after_retryable_error_is_not_a_loop():
    r = Run()
    r.tool("search", ids(1, 2, 3))
    r.tool("search", None, error="upstream timeout", retryable=True)
    r.tool("search", ids(1, 2, 3))                   # the retry
    r.tool("search", None, error="429 rate limit")
    r.tool("search", ids(1, 2, 3))
    assert "repeated_result_loop" not in r.kinds()
    outcomes = [c.outcome for c in r.state.tool_calls]
    assert outcomes == ["ok", "retryable_error", "ok", "retryable_error", "ok"]


def test_unknown_results_give_an_evidence_gap_not_a_loop():
    r = Run()
    r.tool("search", ids(1, 2))
    r.tool("search", None)                           # unknown
    r.tool("search", ids(1, 2))
    assert r.kinds() == ["insufficient_loop_evidence"]
    assert not r.state.findings[0].alarm


def test_observed_empty_lists_are_not_repeated_results():
    r = Run()
    for _ in range(4):
        r.tool("search", [])
    assert "repeated_result_loop" not in r.kinds()
    assert [c.outcome for c in r.state.tool_calls] == ["empty"] * 4


def test_loop_needs_one_tool():
    r = Run()
    r.tool("search", ids(1, 2))
    r.tool("fetch", ids(1, 2))
    r.tool("search", ids(1, 2))
    assert "repeated_result_loop" not in r.kinds()


# --------------------------------------------------------------------------- terminations

@pytest.mark.parametrize("reason, answer, expected", [
    ("completed", "42", []),
    ("step_limit", "42", []),
    ("step_limit", None, ["step_limit_without_answer"]),
    ("step_limit", "   ", ["step_limit_without_answer"]),
    ("cancelled", None, ["run_cancelled"]),
    ("tool_error", None, ["terminated_on_tool_error"]),
])
def test_termination_states(reason, answer, expected):
    r = Run()
    r.add("message", "A", {"content": "working"})
    r.add("termination", "system", {"reason": reason, "final_answer": answer})
    assert r.kinds() == expected
    if expected:
        f = r.state.findings[0]
        assert f.event_ids == ("r/0", "r/1") and f.steps == (0, 1)


def test_answer_from_a_final_answer_event_counts():
    r = Run()
    r.add("final_answer", "A", {"content": "42"})
    r.add("termination", "system", {"reason": "step_limit"})
    assert r.kinds() == []


# --------------------------------------------------------------------------- tool contract

def test_tool_contract_reports_only_the_offending_event():
    pol = Policy(permitted_tools={"agentic": ["search", "read_document"]})
    r = Run(category="agentic", policy=pol)
    r.tool("search", ids(1))
    bad_call, bad_result = r.tool("shell", ids(2))
    r.tool("read_document", ids(3))
    assert r.kinds() == ["tool_not_permitted"]
    f = r.state.findings[0]
    assert f.event_ids == (bad_call,) and f.steps == (2,) and "shell" in f.reason
    other = Run(category="math", policy=pol)          # a category with no list is not checked
    other.tool("shell", ids(1))
    assert other.kinds() == []


# --------------------------------------------------------------------------- cycles, streaks, stall, budget

def test_alternating_two_tool_cycle_without_new_results_fires():
    r = Run()
    r.tool("search", ids(1, 2, 3))
    r.tool("rank", ids(3, 1, 2))
    r.tool("search", ids(1, 2, 3))
    assert "state_cycle" not in r.kinds()
    r.tool("rank", ids(2, 3, 1))
    assert r.kinds() == ["state_cycle"]
    f = r.state.findings[0]
    assert f.detail["period"] == 2 and len(f.event_ids) == 8 and f.steps[0] == 0


def test_alternating_tools_with_new_results_are_healthy():
    r = Run()
    for i in range(4):
        r.tool("search", ids(10 * i, 10 * i + 1))
        r.tool("rank", ids(10 * i, 10 * i + 1))
    assert "state_cycle" not in r.kinds()


def test_error_streak_fires_once_and_resets():
    r = Run()
    for _ in range(3):
        r.tool("compile", None, error="SyntaxError")
    assert r.kinds() == ["error_streak"]
    assert len(r.state.findings[0].event_ids) == 3
    r.tool("compile", None, error="SyntaxError")
    assert r.kinds() == ["error_streak"]
    r.tool("compile", ids(1))
    r.tool("compile", None, error="x")
    assert r.kinds() == ["error_streak"] and r.state.max_error_streak == 4


def test_stall_and_budget():
    pol = Policy(stall=replace(Policy().stall, max_results_without_new=3),
                 budget=BudgetPolicy(max_tokens=100, max_cost_usd=None, max_events=None))
    r = Run(policy=pol)
    r.tool("a", ids(1))
    r.tool("b", ids(1))
    r.tool("c", ids(1))
    r.tool("d", ids(1))
    assert r.kinds() == ["stall"]
    r.add("message", "A", {"content": "x"}, usage={"input_tokens": 60, "output_tokens": 10, "id": "u"})
    r.add("message", "A", {"content": "x"}, usage={"input_tokens": 60, "output_tokens": 10, "id": "u"})
    assert r.kinds() == ["stall"]                   # a repeated usage record counts once
    r.add("message", "A", {"content": "x"}, usage={"input_tokens": 60, "output_tokens": 10, "id": "v"})
    assert r.kinds() == ["stall", "budget_exceeded"]
    assert r.state.total_tokens == 140 and r.state.usage_repeats == 1


# --------------------------------------------------------------------------- trajectories

def test_fold_trajectory_visible_and_first_alarm():
    steps = [Step(index=0, agent="user", kind="message", content="find x")]
    for _ in range(3):
        steps.append(Step(index=len(steps), agent="searcher", kind="tool_call", content="", tool="search",
                          arguments={"q": "x"}))
        steps.append(Step(index=len(steps), agent="env", kind="tool_result", content="…", tool="search",
                          result_ids=("a", "b")))
    steps.append(Step(index=len(steps), agent="searcher", kind="message", content="still looking"))
    traj = Trajectory(id="t", family_id="f", domain="agentic", source="s", task="find x", steps=steps,
                      label=Label(verdict="UNSAFE", label_source="injected", decisive_step=3,
                                  decisive_agent="searcher"), termination="step_limit")
    tf = fold_trajectory(traj)
    assert [f.kind for f in tf.visible(5)] == []
    assert tf.first_alarm(5) is None
    f = tf.first_alarm(6)
    assert f.kind == "repeated_result_loop" and f.first_step == 1
    last = len(steps) - 1
    assert [x.kind for x in tf.visible(last)] == ["repeated_result_loop", "step_limit_without_answer"]
    assert tf.visible(last)[1].first_step == last    # evidence includes the last real step


# --------------------------------------------------------------------------- policies

def test_every_policy_yaml_validates():
    files = sorted((REPO / "configs" / "policies").rglob("*.yaml"))
    assert DEFAULT_POLICY_PATH in files and len(files) >= 2
    for p in files:
        pol = load_policy(p)
        assert pol.revision >= 1 and set(pol.alarm_on) <= set(FINDING_KINDS)


def test_default_yaml_matches_builtin_policy():
    assert load_policy(DEFAULT_POLICY_PATH) == Policy()


@pytest.mark.parametrize("text, key", [
    ("name: x\n", "revision"),
    ("revision: 0\n", "revision"),
    ("revision: 1\nloop: {min_calls: 1}\n", "loop.min_calls"),
    ("revision: 1\nloop: {overlap: 0.5}\n", "loop.overlap"),
    ("revision: 1\nalarm_on: [nonsense]\n", "alarm_on"),
    ("revision: 1\npermitted_tools: {math: python}\n", "permitted_tools.math"),
    ("revision: 1\nbogus: 1\n", "bogus"),
    ("revision: [1\n", "not valid YAML"),
])
def test_bad_policy_names_file_and_key(tmp_path, text, key):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_policy(p)
    assert str(p) in str(e.value) and key in str(e.value)


def test_redo_with_a_different_choice_is_not_a_cycle():
    """search, read d5, search again, read d3: no new ids (d3 was listed), but a different state."""
    r = Run()
    r.tool("search", ids(3, 5, 1))
    r.tool("lookup", ids(5))
    r.tool("search", ids(3, 5, 1))
    r.tool("lookup", ids(3))
    assert "state_cycle" not in r.kinds()
    r.tool("search", ids(3, 5, 1))
    r.tool("lookup", ids(3))                     # now search, lookup(d3) has recurred
    assert r.kinds() == ["state_cycle"]


def test_error_event_outcome_is_retryable_like_an_errored_result():
    r = Run()
    c1 = r.call("search")
    r.add("error", "env", {"content": "", "error": "boom", "retryable": True}, parent=c1)
    c2 = r.call("search")
    r.add("error", "env", {"content": "", "error": "upstream timeout"}, parent=c2)
    c3 = r.call("search")
    r.add("error", "env", {"content": "", "error": "upstream timeout", "retryable": False}, parent=c3)
    assert [c.outcome for c in r.state.tool_calls] == ["retryable_error", "retryable_error", "error"]
