"""`--parser reference`: the released evaluation's acceptance rules (aftraj/reference_parse.py)
give the release's own answers on every golden reply, and walking + scoring with them gives the
release's own Exact-F1 / precision / recall / ASS / FAR / Step-Acc on a scripted evaluation.
The golden file was made by the release's code (tests/aftraj/golden/make_reference_parse.py; its
`made_by` line says how). The strict parser stays the default and refuses the issue's seven kinds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aftraj.reference_parse import parse_reference, parse_with
from aftraj.verdict import ParseFailure, Verdict, parse_verdict

GOLDEN = json.loads((Path(__file__).parent / "golden" / "reference_parse.json").read_text(encoding="utf-8"))
REPLIES = {r["name"]: r for r in GOLDEN["replies"]}
ISSUE_KINDS = ("step_after_prefix", "step_float", "step_string", "agent_null", "no_think",
               "safe_lower_case", "trailing_text")


def test_golden_was_made_by_the_release():
    assert "ZBox1005/AgentForesight@" in GOLDEN["made_by"]
    assert len(REPLIES) >= 40 and all(k in REPLIES for k in ISSUE_KINDS)


@pytest.mark.parametrize("name", list(REPLIES))
def test_each_reply_as_the_release_reads_it(name):
    case = REPLIES[name]
    rel, ours = case["release"], parse_reference(case["text"], case["t"])
    if "raises" in rel:   # the release crashes here; ours refuses (documented in the module)
        assert isinstance(ours, ParseFailure) and ours.code == "bad_answer"
        return
    alarm = rel["valid"] and rel["pred_step"] >= 0          # infer_local.py's walk rule
    if not rel["valid"]:
        assert isinstance(ours, ParseFailure), ours
    elif not alarm:
        assert isinstance(ours, Verdict) and not ours.alarm
    else:
        assert isinstance(ours, Verdict) and ours.alarm
        assert (ours.step, ours.agent, ours.reason) == (rel["pred_step"], rel["pred_agent"], rel["pred_reason"])


@pytest.mark.parametrize("name", ISSUE_KINDS)
def test_strict_parser_refuses_the_issue_kinds(name):
    case = REPLIES[name]
    assert isinstance(parse_verdict(case["text"], case["t"]), ParseFailure)
    assert isinstance(parse_reference(case["text"], case["t"]), Verdict)
    assert parse_with("strict") is parse_verdict


def test_total_on_what_the_release_crashes_on():
    for bad in (None, 3, b"<answer>{}</answer>", "<answer>" + "{" * 10_000 + "}" * 10_000 + "</answer>"):
        assert isinstance(parse_reference(bad), ParseFailure)
    with pytest.raises(ValueError, match="parser must be one of"):
        parse_with("lenient")


class _Replay:
    """An auditor that answers each (run, prefix) with the golden script's reply, parsed strictly
    (as every backend does); the walker re-reads it with --parser reference."""

    def __new__(cls, runs):
        from eval.auditors import AuditResult, Auditor

        class Replay(Auditor):
            name = "replay"

            def audit(self, traj, t):
                r = runs[traj.id]["replies"]
                raw = r.get("full" if traj.label.verdict == "SAFE" and t == len(traj.steps) - 1 else str(t),
                            GOLDEN["safe_reply"])
                return AuditResult(parse_verdict(raw, t), t=t, raw=raw)

        return Replay()


def _trajs():
    from aftraj.schema import Label, Step, Trajectory

    out = []
    for r in GOLDEN["runs"]:
        agent = r["agent"] or "A"
        steps = [Step(j, "user" if j == 0 else agent, "message", f"step {j}") for j in range(r["n_steps"])]
        lb = (Label("SAFE", "verified_safe") if r["gt_step"] == -1 else
              Label("UNSAFE", "injected", decisive_step=r["gt_step"], decisive_agent=r["agent"], reason="x"))
        out.append(Trajectory(id=r["id"], family_id=r["id"], domain=r["domain"], source="golden",
                              task="t", steps=steps, label=lb))
    return out


def test_walk_and_metrics_reproduce_the_release_scoring():
    from eval.metrics import summarize
    from eval.report import parser_counts
    from eval.walker import WalkConfig, walk

    runs = {r["id"]: r for r in GOLDEN["runs"]}
    trajs = _trajs()
    preds = walk(_Replay(runs), trajs, WalkConfig(protocol="reference", parser="reference"), progress=False)
    m, rel = summarize(preds, n_boot=10), GOLDEN["aggregate"]
    for ours, theirs in (("exact_f1", "exact_f1"), ("step_precision", "precision"), ("step_recall", "recall"),
                         ("far", "far"), ("step_acc", "step_acc")):
        assert 100 * m[ours] == pytest.approx(rel[theirs], abs=1e-9), ours
    assert m["ass"] == pytest.approx(rel["ass_mean"])
    by_id = {p["id"]: p for p in preds}
    for s in GOLDEN["per_sample"]:   # per run: the release's predicted step and detection prefix
        p = by_id[s["conv_id"]]
        assert (p["k_hat"] if p["alarmed"] else -1) == s["pred_step"], s["conv_id"]
        if s["gt_step"] != -1:
            assert p["calls"] == s["num_calls"]
    # the strict parser scores the same replies lower, and the report says how many it refused
    strict = summarize(walk(_Replay(runs), trajs, WalkConfig(protocol="reference"), progress=False), n_boot=10)
    assert strict["exact_f1"] < m["exact_f1"]
    c = parser_counts(preds)
    assert c["reference_accepts"] >= 6 and c["strict_failures"] > c["reference_accepts"]
    assert {"missing_think", "text_outside_blocks", "bad_answer", "step_out_of_range"} <= set(c["accepted_by_code"])


def test_every_report_counts_what_the_reference_rules_accept(tmp_path):
    """metrics.json, report.md and the console line count the strict failures the release's rules
    accept, whichever parser the run used (the counts differ: the walks stop at other prefixes)."""
    from eval.report import call_line, write_report
    from eval.walker import WalkConfig, walk

    runs = {r["id"]: r for r in GOLDEN["runs"]}
    for parser in ("strict", "reference"):
        preds = walk(_Replay(runs), _trajs(), WalkConfig(protocol="reference", parser=parser), progress=False)
        m = write_report(preds, tmp_path / parser, meta={"auditor": "replay", "protocol": "reference",
                                                         "parser": parser, "data": "golden"}, n_boot=10)
        sv = m["calls"]["strict_vs_reference"]
        assert sv["reference_accepts"] >= 6 and sv["completions"] == m["calls"]["n"]
        line = f"strict parse failures the release's parser (--parser reference) accepts: {sv['reference_accepts']} of"
        assert line in call_line(m["calls"]) and line in (tmp_path / parser / "report.md").read_text()
        assert "parser " + parser in (tmp_path / parser / "report.md").read_text()
        assert json.loads((tmp_path / parser / "metrics.json").read_text())["calls"]["strict_vs_reference"] == sv
