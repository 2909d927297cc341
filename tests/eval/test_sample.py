"""`--sample N`: a stratified, seeded sample (eval/sample.py) and its CLI wiring."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from eval.sample import stratified_sample, stratum


def _pool(make_traj):
    # 30 safe math, 10 unsafe math, 8 safe coding, 2 unsafe coding
    out, i = [], 0
    for domain, n_safe, n_unsafe in (("math", 30, 10), ("coding", 8, 2)):
        for _ in range(n_safe):
            out.append(make_traj(i, 6, None, domain))
            i += 1
        for _ in range(n_unsafe):
            out.append(make_traj(i, 6, 3, domain))
            i += 1
    return out


def test_allocation_is_proportional_and_keeps_input_order(make_traj):
    pool = _pool(make_traj)
    s = stratified_sample(pool, 10, seed=0)
    assert len(s) == 10
    got = Counter((t.domain, t.label.verdict) for t in s)
    # quotas 6, 2, 1.6, 0.4 -> largest remainder 6, 2, 2, 0 -> the empty stratum takes one from the largest
    assert got == {("math", "SAFE"): 5, ("math", "UNSAFE"): 2, ("coding", "SAFE"): 2, ("coding", "UNSAFE"): 1}
    order = [pool.index(t) for t in s]
    assert order == sorted(order)


def test_every_stratum_is_represented_when_n_allows(make_traj):
    pool = _pool(make_traj)
    s = stratified_sample(pool, 4, seed=3)
    assert {stratum(t) for t in s} == {stratum(t) for t in pool}
    # one fewer than the strata: some stratum must go without, and the size still holds
    assert len(stratified_sample(pool, 3, seed=3)) == 3


def test_seeded_and_bounded(make_traj):
    pool = _pool(make_traj)
    a, b = stratified_sample(pool, 12, seed=1), stratified_sample(pool, 12, seed=1)
    assert [t.id for t in a] == [t.id for t in b]
    assert [t.id for t in a] != [t.id for t in stratified_sample(pool, 12, seed=2)]
    assert len(stratified_sample(pool, len(pool), seed=0)) == len(pool)       # n == len: all
    assert len(stratified_sample(pool, len(pool) + 5, seed=0)) == len(pool)   # n > len: all
    assert len(stratified_sample(pool, len(pool) - 1, seed=0)) == len(pool) - 1
    with pytest.raises(ValueError, match="n >= 1"):
        stratified_sample(pool, 0)


def test_cli_sample_is_recorded(tmp_path, make_traj):
    from aftraj.cli import main
    from aftraj.schema import write_jsonl

    data = tmp_path / "runs.jsonl"
    write_jsonl(_pool(make_traj), data)
    out = tmp_path / "out"
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--sample", "10",
                 "--sample-seed", "5", "--out", str(out), "--no-progress", "--n-boot", "50"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["n_trajectories"] == 10 and m["sample"] == {"n": 10, "seed": 5}
    ids = [json.loads(x)["id"] for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert ids == [t.id for t in stratified_sample(_pool(make_traj), 10, seed=5)]
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--sample", "0",
                 "--out", str(tmp_path / "o2"), "--no-progress"]) == 2
