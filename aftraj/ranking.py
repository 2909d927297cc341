"""The one ROC AUC (Mann-Whitney): P(a positive scores above a negative), ties one half. The
metrics module's per-step stratified AUC and the decision trainers' held-out AUC both read it
(a floor module: training and eval may not import each other).

    from aftraj.ranking import auc
    auc([2.0, 3.0], [0.0, 1.0])        # 1.0
    auc([1.0], [1.0])                  # 0.5: a tie counts one half
    auc([], [1.0])                     # None: no positive
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def auc(pos: Iterable[float], neg: Iterable[float]) -> float | None:
    """Share of (positive, negative) pairs where the positive scores higher, a tie one half; None
    without both a positive and a negative. Exact: a sum of integers and halves over the number
    of pairs, in O((P + N) log N)."""
    pos, neg = [float(v) for v in pos], sorted(float(v) for v in neg)
    if not pos or not neg:
        return None
    twice = 0
    for v in pos:
        below, upto = bisect.bisect_left(neg, v), bisect.bisect_right(neg, v)
        twice += below + upto          # 2 * (below + (upto - below) / 2)
    return twice / (2 * len(pos) * len(neg))
