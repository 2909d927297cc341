"""Signals of a token prefix that the fold (or any rule) can use beside the score: repeated
token n-grams (loops) and the entropy of the neighbours' next token (how constrained the next
action is; low = the retrieved runs all did the same thing next).

    from aftraj.structural.signals import repeated_ngrams, next_token_entropy
    repeated_ngrams([3, 4, 3, 4, 3, 4], n=2)      # {(3, 4): 3, (4, 3): 2}
    next_token_entropy(np.array([5, 5, 7]))       # 0.918 bits
"""

from __future__ import annotations

from collections import Counter

import numpy as np


def repeated_ngrams(tokens, n: int = 2) -> dict[tuple[int, ...], int]:
    """Token n-grams occurring more than once in the prefix, with their counts."""
    c = Counter(tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1))
    return {g: k for g, k in c.items() if k > 1}


def loop_length(tokens, max_period: int = 6) -> int:
    """Length of the longest run at the END of the prefix that repeats with some period
    p <= max_period (tokens[-i] == tokens[-i-p]); 0 when the last step does not repeat."""
    best = 0
    n = len(tokens)
    for p in range(1, max_period + 1):
        run = 0
        while run + p < n and tokens[n - 1 - run] == tokens[n - 1 - run - p]:
            run += 1
        if run:
            best = max(best, run + p)
    return best


def next_token_entropy(next_tokens: np.ndarray, weights: np.ndarray | None = None) -> float | None:
    """Shannon entropy (bits) of the distribution of the neighbours' next tokens (END = the
    neighbour's run stopped there); None without neighbours."""
    nt = np.asarray(next_tokens)
    if nt.size == 0:
        return None
    w = np.ones(len(nt)) if weights is None else np.asarray(weights, float)
    vals, inv = np.unique(nt, return_inverse=True)
    p = np.bincount(inv, weights=w, minlength=len(vals))
    p = p[p > 0] / p.sum()
    return float(-(p * np.log2(p)).sum() + 0.0)


__all__ = ["loop_length", "next_token_entropy", "repeated_ngrams"]
