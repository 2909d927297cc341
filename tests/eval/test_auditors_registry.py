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


# --------------------------------------------------------------------------- options: one rule

def test_an_unknown_option_is_an_error_naming_it_and_the_auditor():
    """A misspelt or foreign option is never dropped: get_auditor and a direct construction both
    refuse it, naming the auditor, the option and what the auditor takes."""
    from eval.auditors import UnknownOptionError, accepted_options
    from eval.auditors.rules import RulesAuditor

    with pytest.raises(UnknownOptionError, match=r"the rules auditor takes no option 'polcy' \(it takes: "
                                                 r"layout, policy\)") as e:
        get_auditor("rules", polcy=None)
    assert isinstance(e.value, TypeError) and e.value.options == ["polcy"] and e.value.auditor == "rules"
    with pytest.raises(UnknownOptionError, match="'polcy'"):
        RulesAuditor(polcy=None)
    with pytest.raises(UnknownOptionError, match="the dummy auditor takes no option 'endpoint', 'seed'"):
        get_auditor("dummy:gold", seed=0, endpoint="http://x")
    # a spec that builds another class is checked against that class: a floor takes no seed
    assert accepted_options("heuristic:length") == {"data", "train", "layout"}
    assert accepted_options("heuristic:uniform-random") == {"seed", "layout"}
    with pytest.raises(UnknownOptionError, match="the heuristic auditor takes no option 'seed'"):
        get_auditor("heuristic:length", seed=0, train=[])
    assert "decision_finish" in accepted_options("hf") and "decision_finish" not in accepted_options("hf-steps")
    assert get_auditor("rules", layout="ours").arg is None          # what it takes still goes through


def test_eval_passes_each_auditor_only_what_it_takes(tmp_path):
    """`aftraj eval` holds options for any auditor (its flags): each auditor gets only the set ones
    it takes, and a model auditor's own flag on another auditor is a usage error naming both."""
    from aftraj.errors import UsageError
    from eval.run import EvalConfig, _build, auditor_options

    cfg = EvalConfig(auditor="rules", data="d.jsonl", out=tmp_path, model="m", seed=3)
    assert auditor_options(cfg) == {"layout": "ours"}
    floor = EvalConfig(auditor="heuristic:length", data="d.jsonl", out=tmp_path, seed=3)
    assert auditor_options(floor) == {"data": "d.jsonl", "layout": "ours"}
    rand = EvalConfig(auditor="heuristic:uniform-random", data="d.jsonl", out=tmp_path, seed=3)
    assert auditor_options(rand) == {"seed": 3, "layout": "ours"}
    hf = EvalConfig(auditor="hf", data="d.jsonl", out=tmp_path, model="m", endpoint="e", draft_tokens=0)
    assert auditor_options(hf) == {"model": "m", "max_new_tokens": 1024, "reference_answer": False,
                                   "layout": "ours", "draft_tokens": 0}
    bad = EvalConfig(auditor="hf-steps", data="d.jsonl", out=tmp_path, decision_finish="canonical")
    with pytest.raises(UsageError, match="--decision-finish applies to the hf auditors only, not 'hf-steps'"):
        _build(bad)
    bad = EvalConfig(auditor="rules", data="d.jsonl", out=tmp_path, decision_threshold=1.0)
    with pytest.raises(UsageError, match="--decision-threshold applies to the hf and hf-steps and vllm-steps "
                                         "auditors only, not 'rules'"):
        _build(bad)


def test_the_gateway_config_names_the_unknown_option():
    """`aftraj serve gateway`'s `auditor.options` go through the same rule; an unknown one is a
    ConfigError on `auditor.options.<option>`."""
    from aftraj.commands.serve import build_auditor
    from aftraj.config import ConfigError
    from serve.config import AuditorConfig

    with pytest.raises(ConfigError, match=r"auditor\.options\.modle: the hf-steps auditor takes no option 'modle'"):
        build_auditor(AuditorConfig(backend="hf-steps", options={"modle": "runs/x"}))
    assert build_auditor(AuditorConfig(backend="rules", options={})).name == "rules"
