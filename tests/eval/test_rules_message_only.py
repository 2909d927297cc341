"""The rules auditor on message-only runs (Who&When): its report says the detectors cannot fire
there (counts in metrics.json and report.md, and each SAFE's reasoning), instead of a silent 0."""

from __future__ import annotations

import json

from aftraj.cli import main as cli


def test_rules_on_who_and_when_says_no_rule_can_fire(tmp_path, capsys):
    out = tmp_path / "ww-rules"
    rc = cli(["eval", "--auditor", "rules", "--data", "who_and_when", "--limit", "4", "--out", str(out),
              "--no-progress", "--n-boot", "20"])
    assert rc == 0
    m = json.loads((out / "metrics.json").read_text())
    (note,) = m["auditor_notes"]
    assert note.startswith("rules: 4 of 4 trajectories are message-only") and "cannot fire" in note
    assert "cannot fire on them" in (out / "report.md").read_text()
    assert "message-only" in capsys.readouterr().err


def test_rules_notes_are_empty_for_runs_with_tool_calls():
    from aftraj.adapters.base import RunBuilder
    from eval.auditors.rules import RulesAuditor
    rb = RunBuilder("r", source="t")
    rb.message("a", "hi")
    msg_only = rb.trajectory("t")
    rb.tool_call("a", "search", {"q": 1})
    with_tools = rb.trajectory("t")
    aud = RulesAuditor()
    assert aud.report_notes([with_tools]) == []
    assert aud.report_notes([msg_only, with_tools])[0].startswith("rules: 1 of 2 trajectories are message-only")
    assert "not a judgement" in aud.audit(msg_only, 0).verdict.think
    assert aud.audit(with_tools, 1).verdict.think == "No rule finding in the steps shown."
