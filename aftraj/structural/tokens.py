"""Typed step tokens: k-means over action embeddings and over observation embeddings, then over
the (action class, observation class) pairs (each pair represented by its two concatenated
centroids), giving a small vocabulary (~50-60 tokens). A trajectory becomes a token sequence;
its initial task message is dropped. Unseen steps are tagged by nearest centroid, never refit.

    from aftraj.structural.tokens import Vocabulary, kmeans
    vocab = Vocabulary.fit(action_vecs, action_w, obs_vecs, obs_w, pairs, pair_w, cfg)
    token = vocab.tag(action_vec, obs_vec)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aftraj.schema import Trajectory


def first_step(traj: Trajectory) -> int:
    """Index of the first step that gets a token: 1 when step 0 is the initial task message (its
    content holds the task text), else 0."""
    if traj.steps and traj.task and traj.task.strip() and traj.task.strip() in traj.steps[0].content:
        return 1
    return 0


def kmeans(x: np.ndarray, k: int, *, weights: np.ndarray | None = None, iters: int = 60,
           seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Weighted Lloyd k-means with k-means++ seeding (numpy, deterministic for a seed).
    Returns (centroids (k', d), labels (n,)); k' = min(k, number of distinct rows)."""
    x = np.asarray(x, np.float64)
    n = len(x)
    if n == 0:
        raise ValueError("kmeans: no points")
    w = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    distinct = len(np.unique(x, axis=0))
    k = min(k, distinct)
    rng = np.random.default_rng(seed)
    xx = (x * x).sum(1)

    def d2(c: np.ndarray) -> np.ndarray:
        return np.maximum(xx[:, None] - 2 * x @ c.T + (c * c).sum(1)[None, :], 0.0)

    centres = [x[rng.choice(n, p=w / w.sum())]]
    dmin = d2(np.array(centres))[:, 0]
    for _ in range(1, k):
        p = w * dmin
        i = rng.choice(n, p=p / p.sum()) if p.sum() > 0 else int(rng.integers(n))
        centres.append(x[i])
        dmin = np.minimum(dmin, d2(x[i][None])[:, 0])
    c = np.array(centres)
    labels = np.full(n, -1)
    for _ in range(iters):
        new = d2(c).argmin(1)
        if np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            m = labels == j
            if m.any():
                c[j] = (x[m] * w[m, None]).sum(0) / w[m].sum()
            else:  # an empty cluster takes the point farthest from its centre
                far = int((d2(c)[np.arange(n), labels] * w).argmax())
                c[j] = x[far]
    return c.astype(np.float32), d2(c).argmin(1)


def nearest(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Index of the nearest centroid (Euclidean) for each row of x."""
    x = np.atleast_2d(x).astype(np.float32)
    return (-2 * x @ c.T + (c * c).sum(1)[None, :]).argmin(1)


@dataclass
class Vocabulary:
    action_centroids: np.ndarray   # (k_a, d)
    obs_centroids: np.ndarray      # (k_o, d)
    pair_centroids: np.ndarray     # (n_tokens, 2d)
    pair_table: dict[tuple[int, int], int]  # seen (action class, observation class) -> token

    @property
    def size(self) -> int:
        return len(self.pair_centroids)

    @classmethod
    def fit(cls, action_vecs: np.ndarray, action_w: np.ndarray, obs_vecs: np.ndarray, obs_w: np.ndarray,
            step_pairs: list[tuple[int, int]], cfg) -> tuple[Vocabulary, np.ndarray, np.ndarray]:
        """action_vecs/obs_vecs: distinct texts' embeddings with their counts; step_pairs: for every
        step, (row of its action text, row of its observation text). Returns the vocabulary and
        the action and observation class of every distinct text."""
        ac, a_lab = kmeans(action_vecs, cfg.k_action, weights=action_w, iters=cfg.kmeans_iters, seed=cfg.seed)
        oc, o_lab = kmeans(obs_vecs, cfg.k_observation, weights=obs_w, iters=cfg.kmeans_iters, seed=cfg.seed + 1)
        counts: dict[tuple[int, int], int] = {}
        for ai, oi in step_pairs:
            key = (int(a_lab[ai]), int(o_lab[oi]))
            counts[key] = counts.get(key, 0) + 1
        keys = sorted(counts)
        pv = np.array([np.concatenate([ac[a], oc[o]]) for a, o in keys])
        pc, p_lab = kmeans(pv, cfg.n_tokens, weights=np.array([counts[k] for k in keys], float),
                           iters=cfg.kmeans_iters, seed=cfg.seed + 2)
        table = {k: int(t) for k, t in zip(keys, p_lab, strict=True)}
        return cls(ac, oc, pc, table), a_lab, o_lab

    def tag_classes(self, a: int, o: int) -> int:
        t = self.pair_table.get((a, o))
        if t is None:  # an unseen pair: nearest pair centroid
            v = np.concatenate([self.action_centroids[a], self.obs_centroids[o]])
            t = int(nearest(v, self.pair_centroids)[0])
        return t

    def tag(self, action_vecs: np.ndarray, obs_vecs: np.ndarray) -> np.ndarray:
        """Tokens of steps given their action and observation embeddings (rows)."""
        a = nearest(action_vecs, self.action_centroids)
        o = nearest(obs_vecs, self.obs_centroids)
        return np.array([self.tag_classes(int(i), int(j)) for i, j in zip(a, o, strict=True)], dtype=np.int64)

    def arrays(self) -> dict[str, np.ndarray]:
        keys = sorted(self.pair_table)
        return {"action_centroids": self.action_centroids, "obs_centroids": self.obs_centroids,
                "pair_centroids": self.pair_centroids,
                "pair_keys": np.array(keys, dtype=np.int64).reshape(-1, 2),
                "pair_tokens": np.array([self.pair_table[k] for k in keys], dtype=np.int64)}

    @classmethod
    def from_arrays(cls, z) -> Vocabulary:
        table = {(int(a), int(o)): int(t) for (a, o), t in zip(z["pair_keys"], z["pair_tokens"], strict=True)}
        return cls(np.asarray(z["action_centroids"]), np.asarray(z["obs_centroids"]),
                   np.asarray(z["pair_centroids"]), table)


__all__ = ["Vocabulary", "first_step", "kmeans", "nearest"]
