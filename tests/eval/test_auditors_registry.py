"""The auditor interface and registry (eval/auditors/__init__.py) and the dummy auditor."""

from __future__ import annotations

import pytest

from aftraj.verdict import ParseFailure, Verdict
from eval.auditors import AuditResult, Auditor, available_auditors, get_auditor, parse_spec, register_auditor


def test_discovery_and_spec():
    names = available_auditors()
    assert "dummy" in names
    assert parse_spec("heuristic:uniform-random") == ("heuristic", "uniform-random")
    assert parse_spec("hf") == ("hf", None)
    assert parse_spec("x:a:b") == ("x", "a:b")
    with pytest.raises(KeyError, match="unknown auditor 'nope'"):
        get_auditor("nope:1")
    with pytest.raises(ValueError):
        parse_spec(":x")


def test_register_rejects_duplicates_and_non_auditors():
    with pytest.raises(ValueError, match="already registered"):
        @register_auditor("dummy")
        class Other(Auditor):
            pass
    with pytest.raises(TypeError):
        register_auditor("notanauditor")(object)


def test_dummy_rules(ww_trajs):
    traj = ww_trajs[0]
    k = traj.label.decisive_step
    gold = get_auditor("dummy:gold")
    assert not gold.audit(traj, k - 1).alarm if k > 0 else True
    r = gold.audit(traj, k)
    assert r.alarm and r.verdict.step == k and r.verdict.agent == traj.label.decisive_agent
    a = get_auditor("dummy:alarm-at-2,confidence=0.25")
    assert [a.audit(traj, t).alarm for t in range(4)] == [False, False, True, True]
    assert a.audit(traj, 3).verdict.step == 2 and a.audit(traj, 3).confidence == 0.25
    f = get_auditor("dummy:fail").audit(traj, 0)
    assert f.parse_failed and not f.alarm
    with pytest.raises(ValueError):
        get_auditor("dummy:whatever")


def test_audit_result_validates():
    with pytest.raises(ValueError):
        AuditResult(Verdict("SAFE"), t=0, confidence=1.5)
    assert not AuditResult(ParseFailure("empty", "e", ""), t=0).alarm
