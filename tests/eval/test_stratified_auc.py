"""The per-step stratified AUC (eval.metrics.stratified_auc) against a brute-force pairwise
recount on random data, its bootstrap interval, and the reason it exists: a length-only scorer
looks good globally on a corpus whose failed runs are longer, and is 0.5 once stratified."""

from __future__ import annotations

import numpy as np
import pytest

from aftraj.ranking import auc
from eval.metrics import _weighted_auc_num, stratified_auc


def _random_preds(rng, n=40):
    preds = []
    for _ in range(n):
        steps = int(rng.integers(1, 12))
        unsafe = bool(rng.random() < 0.5)
        k = int(rng.integers(0, steps)) if unsafe else None
        trace = [{"t": t, "confidence": float(rng.integers(0, 6)) / 5 if rng.random() > 0.1 else None}
                 for t in range(steps)]
        preds.append({"gold": "UNSAFE" if unsafe else "SAFE", "k_star": k, "n_steps": steps, "trace": trace})
    return preds


def _brute(preds, start, positive):
    """Independent recount: every (positive, negative) pair of prefixes at the same step."""
    per_step = {}
    steps = {e["t"] for p in preds for e in p["trace"]}
    for t in sorted(steps):
        if t < start:
            continue
        wins = pairs = 0.0
        for a in preds:
            for ea in a["trace"]:
                if ea["t"] != t or ea["confidence"] is None:
                    continue
                if not (a["gold"] == "UNSAFE" and (positive == "outcome" or t >= a["k_star"])):
                    continue
                for b in preds:
                    for eb in b["trace"]:
                        if eb["t"] != t or eb["confidence"] is None:
                            continue
                        if b["gold"] == "UNSAFE" and (positive == "outcome" or t >= b["k_star"]):
                            continue
                        pairs += 1
                        wins += 1.0 if ea["confidence"] > eb["confidence"] else (
                            0.5 if ea["confidence"] == eb["confidence"] else 0.0)
        if pairs:
            per_step[t] = wins / pairs
    return per_step


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("positive", ["verdict", "outcome"])
@pytest.mark.parametrize("start", [0, 3])
def test_stratified_auc_equals_brute_force(seed, positive, start):
    preds = _random_preds(np.random.default_rng(seed))
    got = stratified_auc(preds, start, n_boot=0, positive=positive)
    want = _brute(preds, start, positive)
    assert got["n_steps"] == len(want) > 0
    assert set(got["per_step"]) == {str(t) for t in want}
    for t, a in want.items():
        assert got["per_step"][str(t)] == pytest.approx(a)
    assert got["auc"] == pytest.approx(np.mean(list(want.values())))
    assert got["ci"] is None and got["start_step"] == start and got["positive"] == positive


def test_bootstrap_interval_and_weighted_numerator():
    rng = np.random.default_rng(5)
    preds = _random_preds(rng, 80)
    a = stratified_auc(preds, 0, n_boot=300, seed=1)
    assert a["ci"][0] <= a["auc"] <= a["ci"][1] and a["ci"][1] - a["ci"][0] < 0.5
    assert stratified_auc(preds, 0, n_boot=300, seed=1)["ci"] == a["ci"]        # seeded
    # the O(R (P + N)) numerator equals the pairwise one, with weights and ties
    p, n = rng.integers(0, 4, 30).astype(float), rng.integers(0, 4, 25).astype(float)
    W = rng.integers(0, 3, (4, 55)).astype(float)
    G = (p[:, None] > n[None, :]) + 0.5 * (p[:, None] == n[None, :])
    assert np.allclose(_weighted_auc_num(p, W[:, :30], n, W[:, 30:]), ((W[:, :30] @ G) * W[:, 30:]).sum(1))
    assert _weighted_auc_num(p, np.ones((1, 30)), n, np.ones((1, 25)))[0] / (30 * 25) == pytest.approx(auc(p, n))
    with pytest.raises(ValueError, match="positive"):
        stratified_auc(preds, positive="both")


def test_length_only_scorer_global_high_stratified_half():
    """Failed runs are longer; the scorer returns the prefix length. Pooled over all prefixes it
    ranks failing prefixes high; within each step every prefix ties, so 0.5."""
    rng = np.random.default_rng(0)
    preds = []
    for i in range(200):
        unsafe = i % 2 == 0
        n = int(rng.integers(12, 30)) if unsafe else int(rng.integers(4, 16))
        k = int(rng.integers(1, n)) if unsafe else None
        preds.append({"gold": "UNSAFE" if unsafe else "SAFE", "k_star": k, "n_steps": n,
                      "trace": [{"t": t, "confidence": min(1.0, (t + 1) / 30)} for t in range(n)]})
    for positive in ("verdict", "outcome"):
        pos = [e["confidence"] for p in preds for e in p["trace"]
               if p["gold"] == "UNSAFE" and (positive == "outcome" or e["t"] >= p["k_star"])]
        neg = [e["confidence"] for p in preds for e in p["trace"]
               if not (p["gold"] == "UNSAFE" and (positive == "outcome" or e["t"] >= p["k_star"]))]
        global_auc = auc(pos, neg)
        strat = stratified_auc(preds, 0, n_boot=200, positive=positive)
        assert global_auc > 0.7
        assert strat["auc"] == pytest.approx(0.5) and strat["ci"] == pytest.approx([0.5, 0.5])
