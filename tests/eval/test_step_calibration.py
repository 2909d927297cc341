"""eval/step_calibration.py: the threshold by the one rule on the held-out walk, and per-(domain,
agent) offsets kept only when a two-fold cross-fit says they help."""

from __future__ import annotations

import random

from eval.step_calibration import check_offsets, fit_offsets, offset_key
from training.common import synthetic_trajectories


def _rows(trajs, biased_agent: str | None, seed: int = 0):
    """Log-odds of a walk: ~+2 at k*, ~-1 elsewhere; `biased_agent`'s steps +2.5 whatever they hold."""
    rng = random.Random(seed)
    rows = []
    for tr in trajs:
        k = tr.label.decisive_step if tr.label.unsafe else None
        for t, s in enumerate(tr.steps):
            v = (2.0 if t == k else -1.0) + rng.gauss(0, 0.6)
            if s.agent == biased_agent:
                v += 2.5
            rows.append({"id": tr.id, "t": t, "alarm": t == k, "step_agent": s.agent, "log_odds": round(v, 4)})
    return rows


def test_offsets_are_kept_when_one_agent_is_biased_and_not_otherwise():
    trajs = synthetic_trajectories(60, seed=2)
    by_id = {t.id: t for t in trajs}
    agents = sorted({s.agent for t in trajs for s in t.steps})
    biased = "Verifier" if "Verifier" in agents else agents[-1]
    rows = _rows(trajs, biased)
    check = check_offsets(rows, by_id, 0.2)
    assert check["kept"] and check["gain_exact_f1"] > 0, check
    fit = fit_offsets(rows, by_id, 0.2)
    keys = {offset_key(by_id[r["id"]], r["t"]) for r in rows}
    key = next(k for k in keys if k.endswith("/" + biased))
    off = lambda k: fit["offsets"].get(k, 0.0)                                    # noqa: E731
    assert all(off(key) <= off(k) - 1.0 for k in keys - {key})        # the biased agent sits lower than all
    assert fit["far"] is None or fit["far"] <= 0.2
    plain = check_offsets(_rows(trajs, None, seed=1), by_id, 0.2)
    assert not plain["kept"] or plain["gain_exact_f1"] <= 0.05
