"""Parts of the structural monitor: config bounds, step texts, embedding cache, MiniLM loading,
k-means, task-message dropping, retrieval (family exclusion, Jaccard, windowed edit distance),
fold signals and the top-k fail fraction."""

from __future__ import annotations

import numpy as np
import pytest

from aftraj.schema import Step
from aftraj.config import ConfigError
from aftraj.structural.config import StructuralConfig, load_structural_config


# --------------------------------------------------------------------------- config

def test_default_config_loads():
    from pathlib import Path

    cfg = load_structural_config(Path(__file__).resolve().parents[3] / "configs/structural/default.yaml")
    assert cfg.embedder == "minilm" and cfg.num_perm == 512 and cfg.shingle == 3 and 50 <= cfg.n_tokens <= 60


@pytest.mark.parametrize("key,bad,good", [
    ("embedder", "bert", "hashing"), ("embed_threads", 0, 1), ("embed_batch", 0, 1), ("embed_max_tokens", 7, 8),
    ("k_action", 1, 2), ("k_observation", 1, 2), ("n_tokens", 1, 2), ("kmeans_iters", 0, 1), ("seed", -1, 0),
    ("shingle", 0, 1), ("num_perm", 15, 16), ("max_candidates", 0, 1), ("edit_window", 0, 1),
    ("edit_shift", -1, 0), ("auc_start", -1, 0), ("baseline_last_n", 0, 1),
    ("lsh_threshold", 0.0, 1.0), ("lsh_threshold", 1.01, 0.01), ("min_similarity", -0.1, 0.0),
    ("min_similarity", 1.1, 1.0), ("edit_weight", 1.5, 1.0), ("edit_weight", -0.5, 0.0),
    ("tune_fraction", 0.0, 0.5), ("tune_fraction", 1.0, 0.99), ("edit_rerank", 1, False),
    ("neighbour_label", "both", "verdict"), ("top_k", (), (1,)), ("top_k", (0,), (1,)),
    ("aggregations", ("mean",), ("cummax",)), ("aggregations", (), ("raw",)), ("k_action", True, 3),
])
def test_config_bounds_both_sides(key, bad, good):
    with pytest.raises(ConfigError, match=key.split("[")[0]):
        StructuralConfig(**{key: bad})
    assert getattr(StructuralConfig(**{key: good}), key) == good


def test_config_file_errors_name_file_and_key(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("k_actoin: 3\n")
    with pytest.raises(ConfigError, match=r"x\.yaml.*k_actoin"):
        load_structural_config(p)
    p.write_text("n_tokens: 0\n")
    with pytest.raises(ConfigError, match=r"x\.yaml: n_tokens"):
        load_structural_config(p)
    p.write_text("top_k: [5, 10]\naggregations: [raw]\n")
    assert load_structural_config(p).top_k == (5, 10)


# --------------------------------------------------------------------------- step texts, embeddings

def test_action_and_observation_texts():
    from aftraj.structural.embed import NO_OBSERVATION, action_text, observation_text

    call = Step(index=1, agent="Solver", kind="tool_call", content="Computing 12 + 30.", tool="calc",
                arguments={"expr": "12+30"})
    res = Step(index=2, agent="environment", kind="tool_result", content="= 42", tool="calc")
    err = Step(index=3, agent="environment", kind="tool_result", content="", tool="calc", error="timeout after 5 s")
    assert action_text(call) == 'Solver tool_call calc({"expr": "#+#"}): Computing # + #.'
    assert observation_text(call) == NO_OBSERVATION
    assert action_text(res) == "environment tool_result calc" and observation_text(res) == "= #"
    assert observation_text(err) == "error: timeout after # s"


class _Counting:
    name = "hashing"

    def __init__(self):
        from aftraj.structural.embed import HashingEmbedder

        self.inner, self.calls = HashingEmbedder(), []

    def __call__(self, texts):
        self.calls.append(list(texts))
        return self.inner(texts)


def test_embedding_cache_embeds_each_text_once_and_persists(tmp_path):
    from aftraj.structural.embed import EmbeddingCache

    emb = _Counting()
    c = EmbeddingCache(emb, tmp_path / "e.npz")
    v = c.embed(["a b", "c d", "a b"])
    assert v.shape == (3, 384) and np.allclose(v[0], v[2]) and emb.calls == [["a b", "c d"]]
    c.embed(["c d", "e f"])
    assert emb.calls[-1] == ["e f"] and (c.hits, c.misses) == (2, 3)
    c.save()
    emb2 = _Counting()
    c2 = EmbeddingCache(emb2, tmp_path / "e.npz")
    assert len(c2) == 3 and np.allclose(c2.embed(["e f"]), c.embed(["e f"])) and emb2.calls == []

    class Other(_Counting):
        name = "minilm"
    assert len(EmbeddingCache(Other(), tmp_path / "e.npz")) == 0   # another embedder's vectors are not mixed in


@pytest.mark.slow  # loads all-MiniLM-L6-v2 from its package: 3-10 s on a loaded 2-core machine
def test_minilm_from_the_package_embeds_offline():
    from aftraj.structural.embed import MiniLMEmbedder, minilm_dir

    d = minilm_dir()
    assert (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file()
    v = MiniLMEmbedder(d, threads=1)(["The verifier says the answer is correct.",
                                      "The checker confirms that the result is right.",
                                      "search_agent tool_call lookup(doc_id)"])
    assert v.shape == (3, 384) and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2     # paraphrases are closer than unrelated texts


# --------------------------------------------------------------------------- tokens

def test_kmeans_separates_blobs_and_is_deterministic():
    from aftraj.structural.tokens import kmeans, nearest

    rng = np.random.default_rng(0)
    centres = np.array([[0, 0], [10, 0], [0, 10]], float)
    x = np.concatenate([c + rng.normal(0, 0.3, (50, 2)) for c in centres])
    c1, l1 = kmeans(x, 3, seed=1)
    c2, l2 = kmeans(x, 3, seed=1)
    assert np.array_equal(l1, l2) and np.allclose(c1, c2)
    for b in range(3):
        assert len(set(l1[b * 50:(b + 1) * 50])) == 1          # each blob is one cluster
    assert len(set(l1)) == 3
    assert np.array_equal(nearest(x, c1), l1)
    c, lab = kmeans(np.array([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]), 5)
    assert len(c) == 2 and lab[0] == lab[1] != lab[2]           # k capped by the distinct points


def test_first_step_drops_only_the_task_message(synthetic_runs):
    from dataclasses import replace

    from aftraj.structural.tokens import first_step

    t = synthetic_runs[0]
    assert first_step(t) == 1
    other = replace(t, steps=tuple(replace(s, content="hello") if s.index == 0 else s for s in t.steps))
    assert first_step(other) == 0


# --------------------------------------------------------------------------- retrieval

def test_windowed_edit_similarity():
    from aftraj.structural.retrieval import windowed_edit_similarity

    assert windowed_edit_similarity([1, 2, 3, 4], [1, 2, 3, 4], 8, 0) == 1.0
    # the candidate has one more step at its end: shift 1 aligns the windows, shift 0 does not
    assert windowed_edit_similarity([1, 2, 3], [1, 2, 3, 9], 3, 1) == 1.0
    assert windowed_edit_similarity([1, 2, 3], [1, 2, 3, 9], 3, 0) < 1.0
    assert windowed_edit_similarity([5, 5], [7, 7], 2, 2) == 0.0


def _index(cfg, runs):
    from aftraj.structural.retrieval import PrefixIndex

    idx = PrefixIndex(cfg)
    for fam, toks, failed in runs:
        idx.add(toks, family=fam, failed=failed, past=[failed] * len(toks))
    idx.build()
    return idx


def test_retrieval_never_returns_the_query_family(fitted):
    mon, held = fitted
    idx = mon.index
    families = {v: k for k, v in idx.families.items()}
    n_checked = 0
    for fam_name in list(idx.families)[:8]:
        for entry in idx.entries[:60]:
            hits = idx.query(entry, fam_name)
            for h in hits:
                assert len(h.members)
                assert all(families[f] != fam_name for f in idx.m_family[h.members])
                n_checked += len(h.members)
    assert n_checked > 100     # the check is not vacuous
    # without exclusion the same query does find members of that family
    entry = idx.entries[0]
    fam0 = families[int(idx.m_family[idx.members[0][0]])]
    assert any(families[f] == fam0 for h in idx.query(entry, None) for f in idx.m_family[h.members])


def test_retrieval_jaccard_threshold_and_order():
    from aftraj.structural.retrieval import shingles

    cfg = StructuralConfig(embedder="hashing", num_perm=128, lsh_threshold=0.1, min_similarity=0.4,
                           edit_rerank=False)
    idx = _index(cfg, [("a", [1, 2, 3, 4, 5], True), ("b", [1, 2, 3, 9, 9], False), ("c", [7, 8, 7, 8, 7], False)])
    q = [1, 2, 3, 4]
    hits = idx.query(q, "z")
    assert hits and [h.sim for h in hits] == sorted((h.sim for h in hits), reverse=True)
    for h in hits:
        qs, es = shingles(q, 3), shingles(idx.entries[h.entry], 3)
        assert h.jaccard == pytest.approx(len(qs & es) / len(qs | es)) and h.sim >= 0.4
    assert idx.entries[hits[0].entry] == (1, 2, 3, 4)
    assert all(7 not in idx.entries[h.entry] for h in hits)    # dissimilar runs stay out
    assert idx.query([], "z") == []


def test_fail_frac_counts_a_cut_group_in_proportion():
    from aftraj.structural.monitor import _fail_frac

    counts, fails = np.array([2.0, 4.0]), np.array([2.0, 1.0])
    s = _fail_frac(counts, fails, (1, 2, 4, 6, 10), prior=0.3)
    assert s == {1: 1.0, 2: 1.0, 4: pytest.approx((2 + 2 * 0.25) / 4), 6: 0.5, 10: 0.5}
    assert _fail_frac(np.array([]), np.array([]), (3,), prior=0.3) == {3: 0.3}


# --------------------------------------------------------------------------- signals

def test_signals():
    from aftraj.structural.signals import loop_length, next_token_entropy, repeated_ngrams

    assert repeated_ngrams([3, 4, 3, 4, 3, 4], 2) == {(3, 4): 3, (4, 3): 2}
    assert repeated_ngrams([1, 2, 3], 2) == {}
    assert loop_length([1, 2, 3, 4]) == 0
    assert loop_length([9, 3, 4, 3, 4, 3, 4]) == 6
    assert loop_length([1, 5, 5, 5]) == 3
    assert next_token_entropy(np.array([5, 5, 7, 7])) == pytest.approx(1.0)
    assert next_token_entropy(np.array([5, 5, 5])) == 0.0
    assert next_token_entropy(np.array([], int)) is None


def test_embedding_reports_progress_per_batch(capsys, monkeypatch):
    """The fit's embedding (17 silent minutes on the 2k corpus, issue 25) reports counts: a line
    per interval and one at the end, under the description the fit gives."""
    import types

    import torch

    from aftraj.structural.embed import DIM, EmbeddingCache, MiniLMEmbedder

    class Tok:
        def __call__(self, texts, **kw):
            ones = torch.ones(len(texts), 3, dtype=torch.long)
            return {"input_ids": ones, "attention_mask": ones}

    class Model:
        def __call__(self, **enc):
            return types.SimpleNamespace(last_hidden_state=torch.ones(enc["input_ids"].shape[0], 3, DIM))

    monkeypatch.setenv("AFTRAJ_PROGRESS_INTERVAL", "0")     # a line per batch
    emb = MiniLMEmbedder(model_dir="/nonexistent", batch_size=2)
    emb._tok, emb._model = Tok(), Model()
    cache = EmbeddingCache(emb)
    vecs = cache.embed([f"text {i}" for i in range(5)], progress="structural fit: embedding action texts")
    assert vecs.shape == (5, DIM)
    lines = capsys.readouterr().err.splitlines()
    assert [x.split(",")[0] for x in lines[:3]] == [
        f"structural fit: embedding action texts: {n}/5 text ({100 * n // 5 if n < 5 else 100} %)" for n in (2, 4, 5)]
    cache.embed([f"text {i}" for i in range(5)])              # all cached, no description: silent
    assert capsys.readouterr().err == ""
