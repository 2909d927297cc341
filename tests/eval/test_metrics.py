"""eval/metrics.py against hand-computed cases and an independent TP/FP/FN recount."""

from __future__ import annotations

import math
import random

import pytest

from aftraj.verdict import agent_match, step_match
from eval.metrics import (CORE_KEYS, METRICS_VERSION, grouped, stratified_auc, summarize, threshold_sweep,
                          ww_substring_step_match)


def rec(gold, k_star=None, a_star=None, *, alarmed=False, d=None, k_hat=None, a_hat=None, n=10,
        calls=1, pf=0, subset="s", domain="math", trace=None):
    return {"id": f"r{random.random()}", "gold": gold, "k_star": k_star, "a_star": a_star,
            "alarmed": alarmed, "d": d, "k_hat": k_hat, "a_hat": a_hat, "n_steps": n,
            "calls": calls, "parse_failures": pf, "prompt_tokens": 100 * calls,
            "completion_tokens": 10 * calls, "cached_tokens": 50 * calls, "latencies_s": [0.1] * calls,
            "subset": subset, "domain": domain, "trace": trace or [], "trace_complete": False}


def hand_set():
    return [
        # unsafe, alarmed on time, right step, agent right after trim+casefold
        rec("UNSAFE", 3, "Coder", alarmed=True, d=3, k_hat=3, a_hat="  coder ", calls=4, n=8),
        # unsafe, alarmed late, wrong step (off by 1), right agent
        rec("UNSAFE", 2, "Planner", alarmed=True, d=4, k_hat=1, a_hat="Planner", calls=5, n=6, pf=1),
        # unsafe, never alarmed
        rec("UNSAFE", 5, "X", calls=7, n=7),
        # unsafe, gold 1 but predicted 12: wrong under integer equality, right under substring
        rec("UNSAFE", 1, "Y", alarmed=True, d=12, k_hat=12, a_hat="Z", calls=13, n=14),
        # safe, false alarm
        rec("SAFE", alarmed=True, d=2, k_hat=0, a_hat="Y", calls=3, n=5, domain="coding"),
        # safe, quiet
        rec("SAFE", calls=5, n=5, domain="coding"),
    ]


def test_hand_computed():
    m = summarize(hand_set(), n_boot=200)
    # |U| = 4, |A| = 4, hits = 1, agent hits = 2, U∩A = 3, S = 2, S∩A = 1
    assert m["n"] == 6 and m["n_safe"] == 2 and m["n_unsafe"] == 4
    assert m["step_recall"] == pytest.approx(1 / 4)
    assert m["step_precision"] == pytest.approx(1 / 4)
    assert m["step_acc"] == m["step_recall"]
    assert m["exact_f1"] == pytest.approx(1 / 4)
    assert m["agent_acc"] == pytest.approx(2 / 4)
    assert m["ass"] == pytest.approx((0 + 1 + 11) / 3)
    assert m["far"] == pytest.approx(1 / 2)
    assert m["detection_rate"] == pytest.approx(3 / 4)
    assert m["alarm_delay"] == pytest.approx((0 + 2 + 11) / 3)
    assert m["steps_saved"] == pytest.approx(((8 - 1 - 3) + (6 - 1 - 4) + (14 - 1 - 12)) / 3)
    assert m["parse_failure_rate"] == pytest.approx(1 / 37)
    assert m["calls_per_traj"] == pytest.approx(37 / 6)
    assert m["cached_prompt_fraction"] == pytest.approx(0.5)
    assert m["ww_substring_step_acc"] == pytest.approx(2 / 4)   # 3~3 and 1~12
    assert m["deployable"] is False
    for k in CORE_KEYS:
        assert k in m
    for k in ("exact_f1", "far", "ass", "agent_acc"):
        lo, hi = m[f"{k}_ci"]
        assert lo <= m[k] <= hi


def test_matching_rules():
    assert agent_match(" WebSurfer ", "websurfer") and not agent_match("Web Surfer", "WebSurfer")
    assert not agent_match(None, "a")
    assert step_match(3, 3) and not step_match(1, 12) and not step_match("3", 3) and not step_match(True, 1)
    assert ww_substring_step_match(12, 1) and not ww_substring_step_match(2, 1)


def test_empty_denominators_are_null():
    # No alarms: ASS and precision are null (with null intervals); recall is 0.
    m = summarize([rec("UNSAFE", 1, "a", calls=3), rec("UNSAFE", 2, "b", calls=3)], n_boot=50)
    assert m["ass"] is None and m["ass_ci"] is None
    assert m["step_precision"] is None and m["step_recall"] == 0.0 and m["exact_f1"] == 0.0
    # No safe trajectories (Who&When): FAR null, deployable unknown.
    assert m["far"] is None and m["far_ci"] is None and m["deployable"] is None
    assert summarize([], n_boot=10)["n"] == 0


def _recount(preds):
    """Independent TP/FP/FN formulation (DESIGN §6), written without eval.metrics."""
    tp = sum(1 for p in preds if p["gold"] == "UNSAFE" and p["alarmed"] and p["k_hat"] == p["k_star"])
    fp = sum(1 for p in preds if p["alarmed"]) - tp
    fn = sum(1 for p in preds if p["gold"] == "UNSAFE") - tp
    f1 = 2 * tp / (2 * tp + fp + fn) if (2 * tp + fp + fn) else None
    unsafe = [p for p in preds if p["gold"] == "UNSAFE"]
    safe = [p for p in preds if p["gold"] == "SAFE"]
    ua = [p for p in unsafe if p["alarmed"]]
    agent = sum(1 for p in ua if p["a_hat"].strip().lower() == p["a_star"].strip().lower())
    return {"exact_f1": f1,
            "step_recall": tp / len(unsafe) if unsafe else None,
            "step_precision": tp / (tp + fp) if tp + fp else None,
            "agent_acc": agent / len(unsafe) if unsafe else None,
            "ass": sum(abs(p["k_hat"] - p["k_star"]) for p in ua) / len(ua) if ua else None,
            "far": sum(p["alarmed"] for p in safe) / len(safe) if safe else None}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_independent_recount_randomised(seed):
    rng = random.Random(seed)
    preds = []
    for _ in range(rng.randint(20, 60)):
        n = rng.randint(2, 15)
        if rng.random() < 0.6:
            k = rng.randrange(n)
            alarmed = rng.random() < 0.7
            d = rng.randrange(n) if alarmed else None
            preds.append(rec("UNSAFE", k, rng.choice(["A", "B", "C"]), alarmed=alarmed, d=d,
                             k_hat=(k if rng.random() < 0.4 else rng.randrange(d + 1)) if alarmed else None,
                             a_hat=rng.choice(["A", " b", "c ", "D"]) if alarmed else None, n=n))
        else:
            alarmed = rng.random() < 0.3
            d = rng.randrange(n) if alarmed else None
            preds.append(rec("SAFE", alarmed=alarmed, d=d, k_hat=d, a_hat="A" if alarmed else None, n=n))
    m, r = summarize(preds, n_boot=0), _recount(preds)
    for k, v in r.items():
        assert m[k] == (pytest.approx(v) if v is not None else None), k


def test_bootstrap_is_seeded_and_grouped():
    preds = hand_set()
    a, b = summarize(preds, seed=7), summarize(preds, seed=7)
    assert a["exact_f1_ci"] == b["exact_f1_ci"]
    g = grouped(preds, n_boot=50)
    assert set(g) == {"overall", "by_subset", "by_domain"}
    assert set(g["by_domain"]) == {"math", "coding"}
    assert g["by_domain"]["coding"]["far"] == 0.5 and g["by_domain"]["math"]["far"] is None
    assert METRICS_VERSION


def test_stratified_auc_and_sweep():
    def tr(confs, k):  # a fully scored trajectory; gold UNSAFE from k on when k is not None
        return [{"t": t, "alarm": c >= 0.5, "k": (k if c >= 0.5 else None), "agent": "A" if c >= 0.5 else None,
                 "confidence": c, "step_agent": "A"} for t, c in enumerate(confs)]

    p1 = rec("UNSAFE", 1, "A", n=3, trace=tr([0.1, 0.9, 0.8], 1), alarmed=True, d=1, k_hat=1, a_hat="A")
    p2 = rec("SAFE", n=3, trace=tr([0.2, 0.3, 0.6], None), alarmed=True, d=2, k_hat=2, a_hat="A")
    for p in (p1, p2):
        p["trace_complete"] = True
    auc = stratified_auc([p1, p2])
    # t=0: no positive; t=1: 0.9 vs 0.3 -> 1; t=2: 0.8 vs 0.6 -> 1
    assert auc["auc"] == 1.0 and auc["n_steps"] == 2
    sweep = {round(r["threshold"], 4): r for r in threshold_sweep([p1, p2])}
    assert set(sweep) == {0.0, 0.1, 0.2, 0.3, 0.6, 0.8, 0.9, 1.0}
    assert sweep[0.8]["far"] == 0.0 and sweep[0.8]["step_acc"] == 1.0
    assert sweep[0.6]["far"] == 1.0 and sweep[0.6]["step_acc"] == 1.0
    assert sweep[0.1]["step_acc"] == 0.0          # alarms at t=0, blaming step 0
    assert sweep[1.0]["far"] == 0.0 and sweep[1.0]["step_acc"] == 0.0
    p2["trace_complete"] = False
    assert threshold_sweep([p1, p2]) is None
    assert not math.isnan(auc["auc"])


def test_cost_when_prices_given():
    preds = [rec("UNSAFE", 1, "a", calls=2)]   # 200 prompt (100 cached), 20 completion tokens
    m = summarize(preds, n_boot=0, prices={"prompt": 1.0, "cached": 0.1, "completion": 4.0})
    assert m["cost_per_traj"] == pytest.approx((100 * 1.0 + 100 * 0.1 + 20 * 4.0) / 1e6)
    assert "cost_per_traj" not in summarize(preds, n_boot=0)


def test_recompute_from_predictions_file(tmp_path, capsys):
    import json

    from eval.metrics import _main

    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in hand_set()))
    assert _main([str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["overall"]["exact_f1"] == pytest.approx(0.25) and out["metrics_version"] == METRICS_VERSION


def test_decision_log_odds_sweep_and_the_one_threshold_rule(tmp_path, capsys):
    import json

    from aftraj.cli import main
    from eval.metrics import pick_threshold

    def tr(los, k, greedy=()):  # log-odds per prefix; None: the completion never reached the token
        return [{"t": t, "alarm": t in greedy, "k": k if t in greedy else None, "agent": None,
                 "confidence": None, "decision_log_odds": lo, "step_agent": "A"} for t, lo in enumerate(los)]

    u = rec("UNSAFE", 2, "A", n=4, trace=tr([-3.0, -1.0, 2.0, 2.5], 2))
    s1 = rec("SAFE", n=4, trace=tr([-2.0, 1.0, -0.5, None], None, greedy={3}))   # t=3: off the template, alarmed
    s2 = rec("SAFE", n=4, trace=tr([-4.0, -3.5, 0.5, -1.0], None))
    for p in (u, s1, s2):
        p["trace_complete"] = True
    sweep = {r["threshold"]: r for r in threshold_sweep([u, s1, s2], key="decision_log_odds")}
    assert max(sweep) == 3.5                        # one threshold above every value
    assert sweep[2.0]["step_acc"] == 1.0 and sweep[2.0]["far"] == 0.5   # s1 still alarms at t=3 (None)
    assert sweep[0.0]["far"] == 1.0 and sweep[-1.0]["step_acc"] == 0.0   # u alarms at t=1, too early
    assert sweep[3.5]["step_acc"] == 0.0
    assert threshold_sweep([u, s1, s2]) is None      # no confidence: the P(UNSAFE) sweep cannot run
    assert sweep[1.0]["exact_f1"] == sweep[2.0]["exact_f1"] > sweep[0.0]["exact_f1"]
    assert pick_threshold(list(sweep.values()), 0.5)["threshold"] == 2.0   # ties -> the higher threshold
    assert pick_threshold(list(sweep.values()), 0.2)["far"] == 0.5         # none within 0.2: plain optimum
    assert pick_threshold([]) is None
    from eval.report import build_metrics, write_markdown   # report.md shows the decision-token sweep

    m = build_metrics([u, s1, s2], meta={"auditor": "hf"}, n_boot=10)
    write_markdown(m, tmp_path / "report.md")
    md = (tmp_path / "report.md").read_text()
    assert "### Decision-token sweep" in md and "| 2.000 | 50.00 % | 100.00 % | 66.67 % |" in md
    assert "### Threshold sweep" not in md           # no confidence: that sweep has no rows

    run = tmp_path / "val"
    run.mkdir()
    (run / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in (u, s1, s2)))
    assert main(["eval", "tune-threshold", str(run), "--max-far", "0.5", "--out", str(tmp_path / "t.json")]) == 0
    assert capsys.readouterr().out.startswith("threshold 2.0:")
    assert json.loads((tmp_path / "t.json").read_text())["pick"]["threshold"] == 2.0
    assert main(["eval", "tune-threshold", str(tmp_path)]) == 2
    assert "predictions.jsonl: no such file" in capsys.readouterr().err
    (run / "predictions.jsonl").write_text("{bad\n")
    assert main(["eval", "tune-threshold", str(run)]) == 2
    assert "predictions.jsonl:1: not JSON" in capsys.readouterr().err


def test_paired_difference_pairs_by_trajectory():
    from eval.metrics import paired_difference

    a = hand_set()
    for i, p in enumerate(a):
        p["id"] = f"t{i}"
    quiet = [dict(p, alarmed=False, d=None, k_hat=None, a_hat=None) for p in a]
    # hand_set: 1 exact hit of 4 unsafe with 4 alarms -> Exact-F1 2*1/(4+4) = 0.25; quiet: 0
    d = paired_difference(a, list(reversed(quiet)), "exact_f1", n_boot=500, seed=1)
    assert d["a"] == pytest.approx(0.25) and d["b"] == 0.0 and d["diff"] == pytest.approx(0.25)
    assert 0.0 <= d["ci"][0] <= 0.25 <= d["ci"][1] and 0.0 <= d["p_not_above"] < 0.5
    # a run against itself: 0 in every resample, whatever the trajectories' spread
    same = paired_difference(a, a, "exact_f1", n_boot=200)
    assert same["diff"] == 0.0 and same["ci"] == [0.0, 0.0] and same["p_not_above"] == 1.0
    fa = paired_difference(a, quiet, "far", n_boot=200)
    assert fa["diff"] == pytest.approx(0.5)                   # 1 of 2 safe runs alarmed vs none
    with pytest.raises(ValueError, match="same trajectories"):
        paired_difference(a, quiet[:-1], "exact_f1")
    with pytest.raises(ValueError, match="unknown metric"):
        paired_difference(a, quiet, "f1")
    assert paired_difference([p for p in a if p["gold"] == "UNSAFE"], [p for p in quiet if p["gold"] == "UNSAFE"],
                             "far") is None              # no safe run: FAR cannot be measured
