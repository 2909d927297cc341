"""Prefix retrieval over token sequences: token n-grams (trigrams) -> MinHash signatures
(datasketch, 512 permutations) -> MinHashLSH prefilter -> exact Jaccard rerank -> optional
shift-aware windowed edit-distance rerank (rapidfuzz) -> neighbours outside the query's family.

Every prefix of every fitted trajectory is indexed; identical token prefixes share one entry
whose members are the runs (family, failed?, at/after k*?, next token) that pass through it.

    index = PrefixIndex(cfg)
    index.add(tokens, family="f1", failed=True, past=[False, True, ...])
    index.build()
    hits = index.query(tokens[:5], family="f2")     # ranked Hit(entry, sim, members)
"""

from __future__ import annotations

import heapq
import struct
from dataclasses import dataclass

import numpy as np

BOS = -1   # padding before the first token, so a run's first tokens form their own n-grams
END = -2   # "no next token": the run ended at this prefix


def shingles(tokens, n: int) -> frozenset[tuple[int, ...]]:
    seq = [BOS] * (n - 1) + [int(t) for t in tokens]
    return frozenset(tuple(seq[i: i + n]) for i in range(len(seq) - n + 1))


def windowed_edit_similarity(q, c, window: int, shift: int) -> float:
    """Normalised Levenshtein similarity of the query's last `window` tokens against the
    candidate's window ending at len(c) - s for s = 0..shift (the best one): two prefixes that
    end the same way score high even when one has a few more or fewer steps."""
    from rapidfuzz.distance.Levenshtein import normalized_similarity

    w = min(window, len(q))
    qw = list(q[-w:])
    best = 0.0
    for s in range(0, shift + 1):
        end = len(c) - s
        if end < 1:
            break
        best = max(best, normalized_similarity(qw, c[max(0, end - w): end]))
        if best == 1.0:
            break
    return best


@dataclass
class Hit:
    entry: int            # index of the prefix entry
    sim: float            # final similarity (Jaccard, or blended with the edit similarity)
    jaccard: float
    members: np.ndarray   # member ids counted as neighbours (the query's family excluded)


class PrefixIndex:
    def __init__(self, cfg):
        from datasketch import MinHash

        self.cfg = cfg
        self.entries: list[tuple[int, ...]] = []
        self._entry_of: dict[tuple[int, ...], int] = {}
        self._members: list[list[int]] = []
        # member columns (one member = one run passing through one entry)
        self.m_family: list[int] = []
        self.m_failed: list[bool] = []
        self.m_past: list[bool] = []
        self.m_next: list[int] = []
        self.families: dict[str, int] = {}
        self._proto = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
        self._shingle_hv: dict[tuple[int, ...], np.ndarray] = {}
        self._built = False

    # ------------------------------------------------------------------ building

    def family_id(self, family: str) -> int:
        return self.families.setdefault(family, len(self.families))

    def add(self, tokens, *, family: str, failed: bool, past) -> None:
        """Index every prefix of one run; past[i] is whether prefix i (tokens[:i+1]) is at or
        after the run's decisive step."""
        if self._built:
            raise RuntimeError("PrefixIndex.add after build()")
        fam = self.family_id(family)
        tokens = [int(t) for t in tokens]
        for i in range(len(tokens)):
            key = tuple(tokens[: i + 1])
            e = self._entry_of.get(key)
            if e is None:
                e = self._entry_of[key] = len(self.entries)
                self.entries.append(key)
                self._members.append([])
            self._members[e].append(len(self.m_family))
            self.m_family.append(fam)
            self.m_failed.append(bool(failed))
            self.m_past.append(bool(past[i]))
            self.m_next.append(tokens[i + 1] if i + 1 < len(tokens) else END)

    def build(self) -> None:
        from datasketch import MinHashLSH

        self.m_family = np.asarray(self.m_family, np.int64)
        self.m_failed = np.asarray(self.m_failed, bool)
        self.m_past = np.asarray(self.m_past, bool)
        self.m_next = np.asarray(self.m_next, np.int64)
        self.members = [np.asarray(m, np.int64) for m in self._members]
        self.shingle_sets = [shingles(e, self.cfg.shingle) for e in self.entries]
        self.lsh = MinHashLSH(threshold=self.cfg.lsh_threshold, num_perm=self.cfg.num_perm)
        with self.lsh.insertion_session() as session:
            for i, sh in enumerate(self.shingle_sets):
                session.insert(i, self._minhash(sh), check_duplication=False)
        self._built = True

    def _hv(self, sh: tuple[int, ...]) -> np.ndarray:
        hv = self._shingle_hv.get(sh)
        if hv is None:
            from datasketch import MinHash

            m = MinHash(num_perm=self.cfg.num_perm, seed=self.cfg.seed, permutations=self._proto.permutations,
                        scheme=self._proto.scheme)
            m.update(struct.pack(f"<{len(sh)}q", *sh))
            hv = self._shingle_hv[sh] = m.hashvalues
        return hv

    def _minhash(self, sh: frozenset):
        from datasketch import MinHash

        sig = np.minimum.reduce([self._hv(s) for s in sh])
        return MinHash(seed=self.cfg.seed, hashvalues=sig, permutations=self._proto.permutations,
                       scheme=self._proto.scheme)

    # ------------------------------------------------------------------ querying

    def query(self, tokens, family: str | None) -> list[Hit]:
        """Entries similar to `tokens` (similarity >= min_similarity), best first, each with its
        members outside `family` (entries with none left are dropped)."""
        if not self._built:
            raise RuntimeError("PrefixIndex.query before build()")
        tokens = tuple(int(t) for t in tokens)
        if not tokens:
            return []
        cfg = self.cfg
        qs = shingles(tokens, cfg.shingle)
        cands = self.lsh.query(self._minhash(qs))
        own = self.families.get(family) if family is not None else None
        nq = len(qs)
        sets = self.shingle_sets
        scored = []
        for e in cands:
            inter = len(qs & sets[e])
            scored.append((inter / (nq + len(sets[e]) - inter), -e))
        hits = []
        for jac, e in heapq.nlargest(cfg.max_candidates, scored):   # highest Jaccard, then lowest entry
            e = -e
            sim = jac
            if cfg.edit_rerank:
                ed = windowed_edit_similarity(tokens, self.entries[e], cfg.edit_window, cfg.edit_shift)
                sim = (1 - cfg.edit_weight) * jac + cfg.edit_weight * ed
            if sim < cfg.min_similarity:
                continue
            mem = self.members[e]
            if own is not None:
                mem = mem[self.m_family[mem] != own]
            if len(mem):
                hits.append(Hit(e, sim, jac, mem))
        hits.sort(key=lambda h: (-h.sim, h.entry))
        return hits

    def arrays(self) -> dict[str, np.ndarray]:
        """What `from_arrays` needs to rebuild the index (the LSH is rebuilt, not stored)."""
        lens = np.array([len(e) for e in self.entries], np.int64)
        flat = np.array([t for e in self.entries for t in e], np.int64)
        mlen = np.array([len(m) for m in self.members], np.int64)
        mflat = np.concatenate(self.members) if self.members else np.zeros(0, np.int64)
        fams = sorted(self.families, key=self.families.get)
        return {"entry_lens": lens, "entry_tokens": flat, "member_lens": mlen, "member_ids": mflat,
                "m_family": self.m_family, "m_failed": self.m_failed, "m_past": self.m_past,
                "m_next": self.m_next, "families": np.array(fams, dtype=str)}

    @classmethod
    def from_arrays(cls, cfg, z) -> PrefixIndex:
        idx = cls(cfg)
        ends = np.cumsum(z["entry_lens"])
        toks = z["entry_tokens"].tolist()
        idx.entries = [tuple(toks[e - n: e]) for n, e in zip(z["entry_lens"].tolist(), ends.tolist(), strict=True)]
        idx._entry_of = {e: i for i, e in enumerate(idx.entries)}
        mends = np.cumsum(z["member_lens"])
        ids = z["member_ids"]
        idx._members = [ids[e - n: e].tolist() for n, e in zip(z["member_lens"].tolist(), mends.tolist(), strict=True)]
        idx.m_family, idx.m_failed = z["m_family"].tolist(), z["m_failed"].tolist()
        idx.m_past, idx.m_next = z["m_past"].tolist(), z["m_next"].tolist()
        idx.families = {f: i for i, f in enumerate(z["families"].tolist())}
        idx.build()
        return idx


__all__ = ["BOS", "END", "Hit", "PrefixIndex", "shingles", "windowed_edit_similarity"]
