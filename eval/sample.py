"""A stratified, seeded sample of trajectories (the evaluation's `--sample N`).

Strata are (domain, subset, gold verdict): each stratum gets its share of N by largest remainder
(every non-empty stratum at least one while N allows), drawn at random with a fixed seed, and the
sample keeps the input order. The same (data, N, seed) always gives the same trajectories, so two
auditors evaluated with one `--sample` see exactly the same runs.

    aftraj eval --auditor rules --data out/demo/corpus --sample 40 --out runs/rules-40
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from aftraj.schema import Trajectory


def stratum(t: Trajectory) -> tuple[str, str, str]:
    return (t.domain or "", str(t.meta.get("subset", t.source)), t.label.verdict)


def stratified_sample(trajs: Sequence[Trajectory], n: int, seed: int = 0) -> list[Trajectory]:
    """`n` trajectories of `trajs` (all of them when n >= len), stratified as the module says."""
    if n < 1:
        raise ValueError(f"a sample needs n >= 1, got {n}")
    if n >= len(trajs):
        return list(trajs)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(trajs):
        groups.setdefault(stratum(t), []).append(i)
    keys = sorted(groups)
    quota = {k: n * len(groups[k]) / len(trajs) for k in keys}
    take = {k: int(quota[k]) for k in keys}
    # largest remainders first; ties broken by stratum name, so the allocation is deterministic
    for k in sorted(keys, key=lambda k: (-(quota[k] - take[k]), k))[: n - sum(take.values())]:
        take[k] += 1
    # a stratum left empty takes one from the largest allocation while that keeps at least one
    for k in keys:
        if take[k] == 0:
            donor = max(keys, key=lambda d: (take[d], d))
            if take[donor] > 1:
                take[donor] -= 1
                take[k] = 1
    rng = random.Random(seed)
    chosen = sorted(i for k in keys for i in rng.sample(groups[k], take[k]))
    return [trajs[i] for i in chosen]
