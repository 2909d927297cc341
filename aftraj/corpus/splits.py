"""Train/val/test splits by family (= task), stratified by domain and seeded: no family is in two
splits, and each domain is cut in the configured proportions.

    from aftraj.corpus.splits import assign_splits
    split_of = assign_splits(trajs, train=0.8, val=0.1, test=0.1, seed=0)   # family_id -> split
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from aftraj.schema import Trajectory

SPLITS = ("train", "val", "test")


def _rank(seed: int, family: str) -> str:
    return hashlib.sha256(f"{seed}\x1f{family}".encode()).hexdigest()


def assign_splits(trajs: Iterable[Trajectory], *, train: float, val: float, test: float,
                  seed: int) -> dict[str, str]:
    """family_id -> split. Within each domain families are ordered by a seeded hash and cut."""
    by_domain: dict[str, set[str]] = {}
    for t in trajs:
        by_domain.setdefault(t.domain, set()).add(t.family_id)
    out: dict[str, str] = {}
    for domain in sorted(by_domain):
        fams = sorted(by_domain[domain], key=lambda f: (_rank(seed, f), f))
        n = len(fams)
        n_test = round(n * test)
        n_val = round(n * val)
        if n >= 3:  # every split gets at least one family when the domain has enough
            n_test = max(n_test, 1) if test > 0 else 0
            n_val = max(n_val, 1) if val > 0 else 0
        for i, f in enumerate(fams):
            out[f] = "test" if i < n_test else ("val" if i < n_test + n_val else "train")
    return out

