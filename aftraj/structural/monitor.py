"""The structural monitor: fit on finished runs, then score any prefix in milliseconds.

fit: embed every step's action and observation text (cached by text hash), build the token
vocabulary (`tokens.Vocabulary`), turn each run into a token sequence (initial task message
dropped), index every prefix (`retrieval.PrefixIndex`), and index the embedding baseline
(mean of the last N step embeddings). score: a prefix's neighbours are retrieved from other
families only; `fail_frac` of the top k neighbours is its raw score (the fit prior when none
is similar enough); `cummean`/`cummax` aggregate the raw scores of the prefixes so far.
Strictly online: prefix t's score reads steps 0..t only.

    from aftraj.structural.monitor import StructuralMonitor
    mon = StructuralMonitor.fit(train_trajs, cfg, cache_path="runs/structural/embeddings.npz")
    mon.save("runs/structural"); mon = StructuralMonitor.load("runs/structural")
    mon.score(traj, t, method="structural", k=10, aggregation="cummax")
    aftraj structural fit --data runs/aftraj-2k --out runs/structural
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aftraj.schema import Trajectory
from aftraj.structural.config import StructuralConfig
from aftraj.structural.embed import EmbeddingCache, action_text, make_embedder, observation_text
from aftraj.structural.retrieval import PrefixIndex
from aftraj.structural.signals import loop_length, next_token_entropy
from aftraj.structural.tokens import Vocabulary, first_step

METHODS = ("structural", "baseline")
FORMAT_VERSION = 1


@dataclass(frozen=True)
class PrefixScore:
    """The raw (un-aggregated) result for one prefix."""

    scores: dict[int, float]          # k -> fail_frac of the top-k neighbours (the prior when none)
    n_neighbours: int                 # neighbours found (at most max k)
    top_sim: float | None             # similarity of the best neighbour
    next_entropy: float | None        # entropy (bits) of the neighbours' next token


def _fail_frac(counts: np.ndarray, fails: np.ndarray, ks: Sequence[int], prior: float) -> dict[int, float]:
    """Score for each k from ranked groups of neighbours (count, failed count per group): the top
    k neighbours, a group cut by k counting in proportion. Fewer than k: all of them."""
    out = {}
    total = int(counts.sum())
    if total == 0:
        return {k: prior for k in ks}
    cum = np.cumsum(counts)
    cumf = np.cumsum(fails)
    for k in ks:
        if k >= total:
            out[k] = float(cumf[-1] / total)
            continue
        j = int(np.searchsorted(cum, k))          # the group that crosses k
        full_n = cum[j - 1] if j else 0
        full_f = cumf[j - 1] if j else 0
        out[k] = float((full_f + (k - full_n) * fails[j] / counts[j]) / k)
    return out


class StructuralMonitor:
    def __init__(self, cfg: StructuralConfig, vocab: Vocabulary, index: PrefixIndex, base_vecs: np.ndarray,
                 base_family: np.ndarray, base_failed: np.ndarray, base_past: np.ndarray, prior: float,
                 cache: EmbeddingCache, tuned: dict | None = None, info: dict | None = None):
        self.cfg, self.vocab, self.index = cfg, vocab, index
        self.base_vecs, self.base_family = base_vecs, base_family
        self.base_failed, self.base_past = base_failed, base_past
        self.prior, self.cache = prior, cache
        self.tuned = tuned or {}
        self.info = info or {}
        self._tok_cache: dict[tuple[str, str], int] = {}
        self._raw: OrderedDict = OrderedDict()

    # ------------------------------------------------------------------ fit

    @classmethod
    def fit(cls, trajs: Sequence[Trajectory], cfg: StructuralConfig, *, cache: EmbeddingCache | None = None,
            cache_path: str | Path | None = None, log=None, progress: bool = False) -> StructuralMonitor:
        """Fit on `trajs`; `progress`: counts and an ETA while embedding (the fit's cost)."""
        if not trajs:
            raise ValueError("StructuralMonitor.fit: no trajectories")
        log = log or (lambda *_: None)
        t0 = time.perf_counter()
        if cache is None:
            cache = EmbeddingCache(make_embedder(cfg.embedder, threads=cfg.embed_threads,
                                                 batch_size=cfg.embed_batch, max_tokens=cfg.embed_max_tokens),
                                   cache_path)
        # --- distinct texts and their counts
        a_row: dict[str, int] = {}
        o_row: dict[str, int] = {}
        a_w: list[float] = []
        o_w: list[float] = []
        step_rows: list[list[tuple[int, int]]] = []
        for tr in trajs:
            rows = []
            for s in tr.steps[first_step(tr):]:
                a, o = action_text(s), observation_text(s)
                if a not in a_row:
                    a_row[a] = len(a_row)
                    a_w.append(0.0)
                if o not in o_row:
                    o_row[o] = len(o_row)
                    o_w.append(0.0)
                a_w[a_row[a]] += 1
                o_w[o_row[o]] += 1
                rows.append((a_row[a], o_row[o]))
            step_rows.append(rows)
        before = cache.misses
        act_vecs = cache.embed(list(a_row), progress="structural fit: embedding action texts" if progress else None)
        obs_vecs = cache.embed(list(o_row),
                               progress="structural fit: embedding observation texts" if progress else None)
        t_embed = time.perf_counter() - t0
        log(f"embedded {len(a_row)} action and {len(o_row)} observation texts "
            f"({cache.misses - before} new) in {t_embed:.1f} s")
        # --- vocabulary and token sequences (training steps are tagged like unseen ones)
        vocab, _, _ = Vocabulary.fit(act_vecs, np.array(a_w), obs_vecs, np.array(o_w),
                                     [p for rows in step_rows for p in rows], cfg)
        a_cls = _nearest_rows(act_vecs, vocab.action_centroids)
        o_cls = _nearest_rows(obs_vecs, vocab.obs_centroids)
        seqs = [[vocab.tag_classes(int(a_cls[a]), int(o_cls[o])) for a, o in rows] for rows in step_rows]
        # --- prefix index
        index = PrefixIndex(cfg)
        base_vecs, base_family, base_failed, base_past = [], [], [], []
        step_vec_a = act_vecs / np.maximum(np.linalg.norm(act_vecs, axis=1, keepdims=True), 1e-9)
        step_vec_o = obs_vecs / np.maximum(np.linalg.norm(obs_vecs, axis=1, keepdims=True), 1e-9)
        for tr, rows, seq in zip(trajs, step_rows, seqs, strict=True):
            f0 = first_step(tr)
            failed = tr.label.verdict == "UNSAFE"
            ks = tr.label.decisive_step
            past = [failed and ks is not None and f0 + i >= ks for i in range(len(seq))]
            if seq:
                index.add(seq, family=tr.family_id, failed=failed, past=past)
            sv = _normalise(step_vec_a[[a for a, _ in rows]] + step_vec_o[[o for _, o in rows]]) if rows else None
            fam = index.family_id(tr.family_id)
            for i in range(len(seq)):
                lo = max(0, i + 1 - cfg.baseline_last_n)
                base_vecs.append(_normalise(sv[lo: i + 1].mean(0, keepdims=True))[0])
                base_family.append(fam)
                base_failed.append(failed)
                base_past.append(past[i])
        index.build()
        labels = np.array(base_failed if cfg.neighbour_label == "outcome" else base_past, float)
        prior = float(labels.mean()) if len(labels) else 0.5
        info = {"n_trajectories": len(trajs), "n_families": len({t.family_id for t in trajs}),
                "n_prefixes": len(base_family), "n_entries": len(index.entries), "vocab_size": vocab.size,
                "n_action_texts": len(a_row), "n_observation_texts": len(o_row),
                "embedded_new": cache.misses - before, "embed_s": round(t_embed, 3),
                "fit_s": round(time.perf_counter() - t0, 3), "prior": prior}
        log(f"vocabulary {vocab.size} tokens; {len(index.entries)} distinct prefixes of "
            f"{len(base_family)}; fit {info['fit_s']:.1f} s")
        return cls(cfg, vocab, index, np.array(base_vecs, np.float32).reshape(-1, act_vecs.shape[1]),
                   np.array(base_family, np.int64), np.array(base_failed, bool), np.array(base_past, bool),
                   prior, cache, info=info)

    # ------------------------------------------------------------------ tokens

    def prepare(self, requests: Iterable[tuple[Trajectory, int]]) -> None:
        """Embed, in one batch, every step text of these prefixes that the cache lacks (a walk
        calls this once per round, so a new step costs one batched embedding, not one call)."""
        texts = []
        for traj, t in requests:
            for s in traj.steps[first_step(traj): t + 1]:
                texts += [action_text(s), observation_text(s)]
        if texts:
            self.cache.embed(texts)

    def tokens(self, traj: Trajectory, t: int) -> list[int]:
        """Tokens of steps first..t (the initial task message is dropped); steps 0..t only."""
        out = []
        todo = []
        for s in traj.steps[first_step(traj): t + 1]:
            key = (action_text(s), observation_text(s))
            tok = self._tok_cache.get(key)
            out.append(tok)
            if tok is None:
                todo.append((len(out) - 1, key))
        if todo:
            act_vecs = self.cache.embed([k[0] for _, k in todo])
            obs_vecs = self.cache.embed([k[1] for _, k in todo])
            for (i, key), tok in zip(todo, self.vocab.tag(act_vecs, obs_vecs), strict=True):
                self._tok_cache[key] = out[i] = int(tok)
        return out

    def _step_vectors(self, traj: Trajectory, lo: int, hi: int) -> np.ndarray:
        steps = traj.steps[lo: hi + 1]
        act_vecs = self.cache.embed([action_text(s) for s in steps])
        obs_vecs = self.cache.embed([observation_text(s) for s in steps])
        return _normalise(_normalise(act_vecs) + _normalise(obs_vecs))

    # ------------------------------------------------------------------ scores

    def _labels(self) -> np.ndarray:
        return self.index.m_failed if self.cfg.neighbour_label == "outcome" else self.index.m_past

    def raw(self, traj: Trajectory, t: int, method: str = "structural") -> PrefixScore:
        """Raw score of prefix t (steps 0..t only), for every k of the tuning grid."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if not 0 <= t < len(traj.steps):
            raise ValueError(f"prefix {t} out of range for {traj.id!r} ({len(traj.steps)} steps)")
        f0 = first_step(traj)
        ks = self.cfg.top_k
        if t < f0:
            return PrefixScore({k: self.prior for k in ks}, 0, None, None)
        if method == "structural":
            key = (method, traj.family_id, tuple(self.tokens(traj, t)))
        else:
            lo = max(f0, t + 1 - self.cfg.baseline_last_n)
            key = (method, traj.family_id, tuple((action_text(s), observation_text(s)) for s in traj.steps[lo: t + 1]))
        hit = self._raw.get(key)
        if hit is not None:
            self._raw.move_to_end(key)
            return hit
        res = self._structural(list(key[2]), traj.family_id) if method == "structural" else \
            self._baseline(traj, t, f0)
        self._raw[key] = res
        if len(self._raw) > 200_000:
            self._raw.popitem(last=False)
        return res

    def _structural(self, tokens: list[int], family: str) -> PrefixScore:
        hits = self.index.query(tokens, family)
        kmax = max(self.cfg.top_k)
        lab = self._labels()
        counts, fails, members = [], [], []
        n = 0
        for h in hits:
            counts.append(len(h.members))
            fails.append(int(lab[h.members].sum()))
            members.append(h.members)
            n += len(h.members)
            if n >= kmax:
                break
        scores = _fail_frac(np.array(counts, float), np.array(fails, float), self.cfg.top_k, self.prior)
        ent = next_token_entropy(self.index.m_next[np.concatenate(members)]) if members else None
        return PrefixScore(scores, min(n, kmax), hits[0].sim if hits else None, ent)

    def _baseline(self, traj: Trajectory, t: int, f0: int) -> PrefixScore:
        lo = max(f0, t + 1 - self.cfg.baseline_last_n)
        q = _normalise(self._step_vectors(traj, lo, t).mean(0, keepdims=True))[0]
        sims = self.base_vecs @ q
        own = self.index.families.get(traj.family_id)
        if own is not None:
            sims = np.where(self.base_family == own, -np.inf, sims)
        kmax = min(max(self.cfg.top_k), int(np.isfinite(sims).sum()))
        if kmax == 0:
            return PrefixScore({k: self.prior for k in self.cfg.top_k}, 0, None, None)
        top = np.argpartition(-sims, kmax - 1)[:kmax]
        top = top[np.argsort(-sims[top], kind="stable")]
        lab = self.base_failed if self.cfg.neighbour_label == "outcome" else self.base_past
        scores = {k: float(lab[top[:k]].mean()) for k in self.cfg.top_k}
        return PrefixScore(scores, kmax, float(sims[top[0]]), None)

    def score(self, traj: Trajectory, t: int, method: str = "structural", k: int | None = None,
              aggregation: str | None = None) -> float:
        """The aggregated score of prefix t: raw fail_frac at t, or the mean / max of the raw
        scores of prefixes first..t (every one computed from its own prefix only)."""
        tuned = self.tuned.get(method, {})
        k = k if k is not None else tuned.get("k", self.cfg.top_k[0])
        agg = aggregation or tuned.get("aggregation", "raw")
        if k not in self.cfg.top_k:
            raise ValueError(f"k={k} is not in the fitted grid top_k={list(self.cfg.top_k)}")
        if agg == "raw":
            return self.raw(traj, t, method).scores[k]
        f0 = min(first_step(traj), t)
        vals = [self.raw(traj, u, method).scores[k] for u in range(f0, t + 1)]
        if agg == "cummean":
            return float(np.mean(vals))
        if agg == "cummax":
            return float(np.max(vals))
        raise ValueError(f"unknown aggregation {agg!r}")

    def signals(self, traj: Trajectory, t: int) -> dict:
        """Fold-usable signals of prefix t: loop length and repeated bigrams of the tokens, the
        neighbours' next-token entropy, and the best similarity."""
        from aftraj.structural.signals import repeated_ngrams

        toks = self.tokens(traj, t) if t >= first_step(traj) else []
        r = self.raw(traj, t, "structural")
        return {"tokens": toks, "loop_length": loop_length(toks), "repeated_bigrams": len(repeated_ngrams(toks, 2)),
                "next_token_entropy": r.next_entropy, "n_neighbours": r.n_neighbours, "top_similarity": r.top_sim}

    # ------------------------------------------------------------------ persistence

    def save(self, out: str | Path) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        arrays = {f"vocab_{k}": v for k, v in self.vocab.arrays().items()}
        arrays.update({f"index_{k}": v for k, v in self.index.arrays().items()})
        arrays.update(base_vecs=self.base_vecs, base_family=self.base_family, base_failed=self.base_failed,
                      base_past=self.base_past, prior=np.array(self.prior))
        np.savez(out / "monitor.npz", **arrays)
        self.cache.save(out / "embeddings.npz")
        meta = {"format_version": FORMAT_VERSION, "config": self.cfg.to_dict(), "tuned": self.tuned,
                "info": self.info}
        (out / "monitor.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        return out

    @classmethod
    def load(cls, folder: str | Path) -> StructuralMonitor:
        folder = Path(folder)
        meta_path = folder / "monitor.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{folder}: no monitor.json (fit one with `aftraj structural fit "
                                    f"--data CORPUS --out {folder}`)")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            from aftraj.errors import UsageError
            raise UsageError(f"{meta_path}: not valid JSON ({e}); refit") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            from aftraj.errors import UsageError
            raise UsageError(f"{meta_path}: not a fitted monitor (an object with format_version and config "
                             f"expected, got {type(meta).__name__}{'' if not isinstance(meta, dict) else ' without config'}); refit")
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{meta_path}: format_version {meta.get('format_version')!r}, "
                             f"this code reads {FORMAT_VERSION}; refit")
        cfg = StructuralConfig.from_dict(meta["config"], str(meta_path) + ":config")
        with np.load(folder / "monitor.npz", allow_pickle=False) as z:
            vocab = Vocabulary.from_arrays({k[6:]: z[k] for k in z.files if k.startswith("vocab_")})
            index = PrefixIndex.from_arrays(cfg, {k[6:]: z[k] for k in z.files if k.startswith("index_")})
            base = {k: z[k] for k in ("base_vecs", "base_family", "base_failed", "base_past", "prior")}
        cache = EmbeddingCache(make_embedder(cfg.embedder, threads=cfg.embed_threads, batch_size=cfg.embed_batch,
                                             max_tokens=cfg.embed_max_tokens), folder / "embeddings.npz")
        return cls(cfg, vocab, index, base["base_vecs"], base["base_family"], base["base_failed"],
                   base["base_past"], float(base["prior"]), cache, meta.get("tuned"), meta.get("info"))


def _normalise(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-9)


def _nearest_rows(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    from aftraj.structural.tokens import nearest

    return nearest(x, c) if len(x) else np.zeros(0, np.int64)


__all__ = ["METHODS", "PrefixScore", "StructuralMonitor"]
