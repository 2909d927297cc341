"""The one AUC (`aftraj.ranking.auc`), which eval's stratified AUC and the decision trainers'
held-out AUC read: hand-counted cases with ties, and an independent pairwise recount."""

import math
import random

from aftraj.ranking import auc


def test_hand_counted_cases():
    assert auc([2.0, 3.0], [0.0, 1.0]) == 1.0
    assert auc([0.0], [1.0]) == 0.0
    assert auc([1.0], [1.0]) == 0.5
    assert auc([], [1.0]) is None and auc([1.0], []) is None
    # pos 1, 2, 2 vs neg 1, 2, 3: wins 0 + 0.5 | 1 + 0.5 | 1 + 0.5 = 3.5 of 9 pairs
    assert auc([1, 2, 2], [1, 2, 3]) == 3.5 / 9
    # every score tied: one half, whatever the counts
    assert auc([4.0] * 3, [4.0] * 5) == 0.5


def test_equals_a_pairwise_recount_with_many_ties():
    rng = random.Random(0)
    for _ in range(50):
        pos = [rng.randint(0, 6) / 2 for _ in range(rng.randint(1, 30))]
        neg = [rng.randint(0, 6) / 2 for _ in range(rng.randint(1, 30))]
        pairs = [(p > n) + 0.5 * (p == n) for p in pos for n in neg]
        assert auc(pos, neg) == sum(pairs) / len(pairs)
        assert math.isclose(auc(neg, pos), 1 - auc(pos, neg))
