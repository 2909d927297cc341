"""The strict online walk, the reference protocol, post-hoc and bisect plans (eval/walker.py)."""

from __future__ import annotations

import math

import pytest

from aftraj.verdict import ParseFailure, Verdict
from eval.auditors import AuditResult, Auditor, get_auditor
from eval.walker import WalkConfig, walk


@pytest.fixture
def corpus(make_traj):
    return [make_traj(0, 6, 3), make_traj(1, 8, 0), make_traj(2, 5, None), make_traj(3, 9, 7),
            make_traj(4, 4, None, "coding")]


class Recording(Auditor):
    """Wraps the gold oracle and records every batch the walker sends."""

    def __init__(self, strategy="online", max_in_flight=None):
        super().__init__()
        self.strategy, self.max_in_flight = strategy, max_in_flight
        self.inner = get_auditor("dummy:gold")
        self.batches: list[list[tuple[str, int]]] = []
        self.ended: list[str] = []

    def audit(self, traj, t):
        return self.inner.audit(traj, t)

    def audit_batch(self, requests):
        self.batches.append([(tr.id, t) for tr, t in requests])
        return super().audit_batch(requests)

    def end(self, traj):
        self.ended.append(traj.id)


def test_strict_gold_walk_is_perfect(corpus):
    aud = Recording()
    preds = walk(aud, corpus, WalkConfig(max_in_flight=3), progress=False)
    assert [p["id"] for p in preds] == [t.id for t in corpus]
    for p, t in zip(preds, corpus):
        if t.label.unsafe:
            k = t.label.decisive_step
            assert p["alarmed"] and p["d"] == k and p["k_hat"] == k and p["calls"] == k + 1
            assert [e["t"] for e in p["trace"]] == list(range(k + 1))  # prefix order, nothing skipped
        else:
            assert not p["alarmed"] and p["d"] is None and p["calls"] == len(t.steps)
    # batched across trajectories: never more than 3 in flight, and more than one at once
    assert max(len(b) for b in aud.batches) == 3
    assert sorted(aud.ended) == sorted(t.id for t in corpus)
    from eval.metrics import summarize

    m = summarize(preds, n_boot=0)
    assert m["exact_f1"] == 1.0 and m["far"] == 0.0 and m["agent_acc"] == 1.0 and m["ass"] == 0.0


def test_auditor_cap_on_in_flight(corpus):
    aud = Recording(max_in_flight=1)
    walk(aud, corpus, WalkConfig(max_in_flight=8), progress=False)
    assert max(len(b) for b in aud.batches) == 1


def test_reference_protocol_gives_safe_runs_one_call(corpus):
    preds = walk(Recording(), corpus, WalkConfig(protocol="reference"), progress=False)
    for p, t in zip(preds, corpus):
        if not t.label.unsafe:
            assert p["calls"] == 1 and p["mode"] == "posthoc" and p["trace"][0]["t"] == len(t.steps) - 1
        else:
            assert p["mode"] == "online" and p["calls"] == t.label.decisive_step + 1


def test_all_prefixes_scores_every_prefix(corpus):
    preds = walk(Recording(), corpus, WalkConfig(all_prefixes=True), progress=False)
    for p, t in zip(preds, corpus):
        assert p["calls"] == len(t.steps) and p["trace_complete"]
        if t.label.unsafe:
            assert p["d"] == t.label.decisive_step  # still the first ALARM


def test_bisect_finds_first_alarm(corpus):
    preds = walk(Recording(strategy="bisect"), corpus, progress=False)
    for p, t in zip(preds, corpus):
        assert p["calls"] <= math.ceil(math.log2(len(t.steps))) + 1
        if t.label.unsafe:
            assert p["d"] == t.label.decisive_step and p["k_hat"] == t.label.decisive_step
        else:
            assert not p["alarmed"]


def test_posthoc_heuristic_one_call(corpus):
    preds = walk(get_auditor("heuristic:last-step"), corpus, progress=False)
    for p, t in zip(preds, corpus):
        assert p["calls"] == 1 and p["mode"] == "posthoc" and p["alarmed"]
        assert p["d"] == len(t.steps) - 1 and p["k_hat"] == len(t.steps) - 1


def test_parse_failures_count_as_continue(corpus):
    def fn(traj, t):
        if t == 1:
            return ParseFailure("malformed_json", "x", "<answer>{</answer>")
        if t == 2:
            return Verdict("UNSAFE", step=1, agent="Solver", reason="r")
        return Verdict("SAFE")

    preds = walk(get_auditor("dummy", fn=fn), corpus[:1], progress=False)
    p = preds[0]
    assert p["d"] == 2 and p["parse_failures"] == 1 and p["trace"][1]["parse_failure"] == "malformed_json"


def test_walker_rejects_wrong_answers(corpus):
    class Liar(Auditor):
        def audit(self, traj, t):
            return AuditResult(Verdict("SAFE"), t=t + 1)

    with pytest.raises(RuntimeError, match="answered prefix 1"):
        walk(Liar(), corpus[:1], progress=False)
    with pytest.raises(ValueError):
        WalkConfig(protocol="lenient")


def test_walker_rejects_an_alarm_blaming_an_unseen_step(corpus):
    """An ALARM must name a step of the prefix it saw (0 <= k <= t): a step after t means the
    auditor looked ahead, and a missing step would count as distance 0 in ASS."""
    class Peeker(Auditor):
        def audit(self, traj, t):
            return AuditResult(Verdict("UNSAFE", step=t + 1, agent="Solver", reason="r"), t=t)

    class NoStep(Auditor):
        def audit(self, traj, t):
            return AuditResult(Verdict("UNSAFE", step=None, agent="Solver", reason="r"), t=t)

    with pytest.raises(RuntimeError, match="blames step 1 at prefix 0"):
        walk(Peeker(), corpus[:1], progress=False)
    with pytest.raises(RuntimeError, match="blames step None at prefix 0"):
        walk(NoStep(), corpus[:1], progress=False)
