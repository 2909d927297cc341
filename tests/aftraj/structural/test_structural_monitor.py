"""The structural monitor end to end on a small synthetic corpus: it separates failing from
safe runs of unseen families, is strictly online, survives save/load, tags unseen steps without
refitting; its auditors walk in the evaluation harness and report the stratified AUC with an
interval; `aftraj structural fit` and `aftraj eval --auditor structural:DIR` work."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from aftraj.schema import Label, Step


def _auc(pos, neg):
    from aftraj.ranking import auc

    return auc(pos, neg)


@pytest.mark.parametrize("method", ["structural", "baseline"])
def test_scores_separate_failing_runs_of_unseen_families(fitted, method):
    mon, held = fitted
    last = {t.id: mon.score(t, len(t.steps) - 1, method, 5, "raw") for t in held}
    pos = [last[t.id] for t in held if t.label.unsafe]
    neg = [last[t.id] for t in held if not t.label.unsafe]
    assert pos and neg and _auc(pos, neg) > 0.9


def test_vocabulary_and_tokens(fitted):
    mon, held = fitted
    assert 2 <= mon.vocab.size <= mon.cfg.n_tokens
    t = held[0]
    toks = mon.tokens(t, len(t.steps) - 1)
    assert len(toks) == len(t.steps) - 1                 # the task message is dropped
    assert all(0 <= x < mon.vocab.size for x in toks)
    assert mon.tokens(t, 0) == []


def test_strictly_online_prefix_scores_read_only_their_prefix(fitted):
    mon, held = fitted
    for traj in held[:6]:
        for t in range(len(traj.steps)):
            # the steps after t and the label are gone: the score cannot depend on them
            cut = replace(traj, steps=traj.steps[: t + 1], label=Label("SAFE", "verified_safe"))
            for method in ("structural", "baseline"):
                for agg in ("raw", "cummean", "cummax"):
                    assert mon.score(traj, t, method, 3, agg) == mon.score(cut, t, method, 3, agg)


def test_aggregations(fitted):
    mon, held = fitted
    traj = next(t for t in held if t.label.unsafe)
    n = len(traj.steps)
    raw = [mon.score(traj, t, "structural", 5, "raw") for t in range(1, n)]
    assert mon.score(traj, n - 1, "structural", 5, "cummax") == pytest.approx(max(raw))
    assert mon.score(traj, n - 1, "structural", 5, "cummean") == pytest.approx(np.mean(raw))
    assert mon.score(traj, 0, "structural", 5, "raw") == mon.prior      # the task message alone: the prior
    with pytest.raises(ValueError, match="not in the fitted grid"):
        mon.score(traj, 1, "structural", 4, "raw")


def test_unseen_step_is_tagged_without_refit(fitted):
    mon, held = fitted
    traj = held[0]
    novel = Step(index=len(traj.steps), agent="Auditor", kind="message",
                 content="Something never seen in the corpus: quaternion flux capacitor.")
    longer = replace(traj, steps=tuple(traj.steps) + (novel,))
    size, cent = mon.vocab.size, mon.vocab.pair_centroids.copy()
    toks = mon.tokens(longer, len(longer.steps) - 1)
    assert 0 <= toks[-1] < size and mon.vocab.size == size and np.array_equal(mon.vocab.pair_centroids, cent)


def test_save_load_round_trip(fitted, tmp_path):
    from aftraj.structural.monitor import StructuralMonitor

    mon, held = fitted
    mon.save(tmp_path / "m")
    back = StructuralMonitor.load(tmp_path / "m")
    for traj in held[:4]:
        for t in range(len(traj.steps)):
            for method in ("structural", "baseline"):
                assert back.score(traj, t, method, 5, "cummax") == mon.score(traj, t, method, 5, "cummax")
    with pytest.raises(FileNotFoundError, match="structural fit"):
        StructuralMonitor.load(tmp_path / "nothing")


def test_signals_of_a_looping_run(fitted):
    mon, held = fitted
    bad = next(t for t in held if t.label.unsafe)
    good = next(t for t in held if not t.label.unsafe)
    sb, sg = mon.signals(bad, len(bad.steps) - 2), mon.signals(good, len(good.steps) - 1)
    assert sb["loop_length"] >= 4 and sb["repeated_bigrams"] >= 1     # error / retry / error / retry
    assert sg["loop_length"] < sb["loop_length"]
    assert sb["next_token_entropy"] is not None and sb["n_neighbours"] > 0


def test_tuning_and_auditors_in_the_harness(fitted, tmp_path):
    from eval.structural_tune import tune
    from eval.auditors import get_auditor
    from eval.report import write_report
    from eval.walker import WalkConfig, walk

    mon, held = fitted
    tune_set = [t for t in held if int(t.family_id[1:]) < 20]
    test_set = [t for t in held if int(t.family_id[1:]) >= 20]
    mon.tuned = tune(mon, tune_set)
    for method in ("structural", "baseline"):
        tu = mon.tuned[method]
        assert tu["k"] in mon.cfg.top_k and tu["aggregation"] in mon.cfg.aggregations
        assert tu["threshold"] is not None and len(tu["grid"]) == len(mon.cfg.top_k) * len(mon.cfg.aggregations)
    mon.save(tmp_path / "m")
    for spec in ("structural", "structural-baseline"):
        aud = get_auditor(f"{spec}:{tmp_path / 'm'}")
        preds = walk(aud, test_set, WalkConfig(all_prefixes=True), progress=False)
        for p, traj in zip(preds, test_set, strict=True):
            assert p["trace_complete"] and all(e["confidence"] is not None for e in p["trace"])
            for e in p["trace"]:
                assert e["alarm"] == (e["confidence"] >= aud.threshold)
                if e["alarm"]:
                    assert e["k"] == e["t"] and e["agent"] == traj.steps[e["t"]].agent
        m = write_report(preds, tmp_path / spec, meta={"auditor": aud.label, "protocol": "strict"}, n_boot=200)
        sa = m["stratified_auc"]
        assert sa["auc"] is not None and sa["ci"][0] <= sa["auc"] <= sa["ci"][1]
        assert m["stratified_auc_outcome"]["auc"] is not None and m["threshold_sweep"]
        assert "Per-step stratified ROC AUC" in (tmp_path / spec / "report.md").read_text()
    with pytest.raises(ValueError, match="structural:DIR"):
        get_auditor("structural")


def test_cli_fit_then_eval(synthetic_runs, tmp_path, capsys):
    from aftraj.cli import main
    from aftraj.schema import write_jsonl

    fit = [t for t in synthetic_runs if int(t.family_id[1:]) < 18]
    test = [t for t in synthetic_runs if int(t.family_id[1:]) >= 18]
    write_jsonl(fit, tmp_path / "fit.jsonl")
    write_jsonl(test, tmp_path / "test.jsonl")
    cfg = tmp_path / "s.yaml"
    cfg.write_text("embedder: hashing\nk_action: 8\nk_observation: 4\nn_tokens: 12\nnum_perm: 128\n"
                   "top_k: [3, 5]\naggregations: [raw, cummax]\ntune_fraction: 0.3\n")
    out = tmp_path / "mon"
    assert main(["structural", "fit", "--data", str(tmp_path / "fit.jsonl"), "--out", str(out),
                 "--config", str(cfg)]) == 0
    meta = json.loads((out / "monitor.json").read_text())
    assert set(meta["tuned"]) == {"structural", "baseline"} and meta["info"]["n_trajectories"] < len(fit)
    assert (out / "embeddings.npz").is_file()
    assert main(["eval", "--auditor", f"structural:{out}", "--data", str(tmp_path / "test.jsonl"),
                 "--all-prefixes", "--auc-start", "1", "--out", str(tmp_path / "ev"), "--no-progress",
                 "--n-boot", "100"]) == 0
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["stratified_auc"]["start_step"] == 1 and metrics["stratified_auc"]["ci"]
    assert "structural tune: walks of" in capsys.readouterr().err     # the tune walks' progress
    unsafe = next(t for t in test if t.label.unsafe)
    assert main(["structural", "show", "--model", str(out), "--data", str(tmp_path / "test.jsonl"),
                 "--id", unsafe.id]) == 0
    shown = capsys.readouterr().out.splitlines()
    th = meta["tuned"]["structural"]["threshold"]
    assert f"structural {th:.3f}" in shown[1] and "'!' = score >= threshold" in shown[1]
    rows = [r for r in shown if r.startswith("  t=")]
    k = unsafe.label.decisive_step
    assert [i for i, r in enumerate(rows) if r.endswith("<- k*")] == [k]
    assert main(["structural", "show", "--model", str(out), "--data", str(tmp_path / "test.jsonl"),
                 "--id", unsafe.id, "--json"]) == 0
    js = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["is_k_star"] for r in js].index(True) == k
    for r, line in zip(js, rows, strict=True):   # '!' exactly where the score reaches the tuned threshold
        assert r["structural_alarm"] == (r["structural"] >= th - 1e-4) or abs(r["structural"] - th) < 1e-4
        assert ("structural=" + f"{r['structural']:.3f}" + ("!" if r["structural_alarm"] else " ")) in line
    assert any(r["structural_alarm"] for r in js) and not all(r["structural_alarm"] for r in js), js
    # the tune split may not share a family with the fit split
    assert main(["structural", "fit", "--data", str(tmp_path / "fit.jsonl"), "--tune", str(tmp_path / "fit.jsonl"),
                 "--out", str(tmp_path / "bad"), "--config", str(cfg)]) == 2
    assert "both the fit and the tune split" in capsys.readouterr().err
