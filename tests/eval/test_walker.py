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
    for p, t in zip(preds, corpus, strict=True):
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


def _same(a, b):
    drop = ("latencies_s",)
    return [{k: v for k, v in r.items() if k not in drop} for r in a] == \
           [{k: v for k, v in r.items() if k not in drop} for r in b]


@pytest.mark.parametrize("protocol, all_prefixes", [("strict", False), ("strict", True), ("reference", False)])
def test_lookahead_fills_spare_rows_and_keeps_the_records(corpus, protocol, all_prefixes):
    """An auditor that answers each prefix alone (`lookahead`) gets the live online walks' next
    prefixes in a round's spare rows; the answers a walk never asks for are dropped, so the
    records are those of the walk without lookahead, in fewer rounds."""
    cfg = dict(protocol=protocol, all_prefixes=all_prefixes, max_in_flight=8)
    off = Recording()
    ref = walk(off, corpus, WalkConfig(**cfg, lookahead=False), progress=False)
    on = Recording()
    on.lookahead = True
    got = walk(on, corpus, WalkConfig(**cfg), progress=False)
    assert _same(got, ref)
    assert max(len(b) for b in on.batches) == 8 and len(on.batches) < len(off.batches)
    dropped = sum(map(len, on.batches)) - sum(map(len, off.batches))  # answers no walk asked for
    assert dropped == 0 if all_prefixes else dropped > 0
    for b in on.batches:
        assert len(set(b)) == len(b)
    by_id = {t.id: t for t in corpus}
    for b in on.batches:                 # a posthoc walk (reference protocol, safe run) never looks ahead
        for i, t in b:
            if protocol == "reference" and not by_id[i].label.unsafe:
                assert t == len(by_id[i].steps) - 1
    off.lookahead = False
    walk(off, corpus, WalkConfig(**cfg), progress=False)   # the default auditor never gets two prefixes
    assert all(len({i for i, _ in b}) == len(b) for b in off.batches)


def test_lookahead_takes_one_prefix_a_walk_in_turn(make_traj):
    from eval.walker import _Walk, _online, lookahead

    trajs = [make_traj(0, 3, None), make_traj(1, 6, None)]
    live = {i: _Walk(t, "online", _online(len(t.steps), False), False) for i, t in enumerate(trajs)}
    assert lookahead(live, [0, 1], 5) == [(0, 1), (1, 1), (0, 2), (1, 2), (1, 3)]
    assert lookahead(live, [0, 1], 0) == []
    assert lookahead(live, [0, 1], 99)[-1] == (1, 5) and len(lookahead(live, [0, 1], 99)) == 2 + 5


def test_auditor_cap_on_in_flight(corpus):
    aud = Recording(max_in_flight=1)
    walk(aud, corpus, WalkConfig(max_in_flight=8), progress=False)
    assert max(len(b) for b in aud.batches) == 1


def test_reference_protocol_gives_safe_runs_one_call(corpus):
    preds = walk(Recording(), corpus, WalkConfig(protocol="reference"), progress=False)
    for p, t in zip(preds, corpus, strict=True):
        if not t.label.unsafe:
            assert p["calls"] == 1 and p["mode"] == "posthoc" and p["trace"][0]["t"] == len(t.steps) - 1
        else:
            assert p["mode"] == "online" and p["calls"] == t.label.decisive_step + 1


def test_all_prefixes_scores_every_prefix(corpus):
    preds = walk(Recording(), corpus, WalkConfig(all_prefixes=True), progress=False)
    for p, t in zip(preds, corpus, strict=True):
        assert p["calls"] == len(t.steps) and p["trace_complete"]
        if t.label.unsafe:
            assert p["d"] == t.label.decisive_step  # still the first ALARM


def test_bisect_finds_first_alarm(corpus):
    preds = walk(Recording(strategy="bisect"), corpus, progress=False)
    for p, t in zip(preds, corpus, strict=True):
        assert p["calls"] <= math.ceil(math.log2(len(t.steps))) + 1
        if t.label.unsafe:
            assert p["d"] == t.label.decisive_step and p["k_hat"] == t.label.decisive_step
        else:
            assert not p["alarmed"]


def test_posthoc_heuristic_one_call(corpus):
    preds = walk(get_auditor("heuristic:last-step"), corpus, progress=False)
    for p, t in zip(preds, corpus, strict=True):
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
