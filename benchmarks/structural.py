"""Benchmark the structural monitor on 2,000 trajectories: fit time (embedding included, cold
embedding cache; then a refit with the cache warm) and per-prefix query latency (one new prefix
= one retrieval + score; its step texts are already embedded), for the structural method and
the embedding baseline, plus the cost of tagging one unseen step (two texts through MiniLM).

    .venv/bin/python benchmarks/structural.py                          # the 2k scripted corpus (built if absent)
    .venv/bin/python benchmarks/structural.py --data runs/aftraj-2k/corpus.jsonl --n 2000

Queries are prefixes of the fitted runs; retrieval excludes the query's own family, so each
query sees only other tasks, as a held-out run would. Last line:
fit_s=… query_p50_ms=… query_p99_ms=… (wall clock; structural method, raw score, cold
per-prefix cache). CPU times are printed above it: on a shared machine they say what one core
does, the wall clock what the load left.
"""

from __future__ import annotations

import argparse
import os

# One BLAS thread: the machine is shared, and CPU time per query then means one core's work.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from aftraj.readers import load_trajectories  # noqa: E402
from aftraj.structural.config import load_structural_config  # noqa: E402
from aftraj.structural.embed import EmbeddingCache, make_embedder  # noqa: E402
from aftraj.structural.monitor import StructuralMonitor  # noqa: E402


def corpus(path: str | None, tmp: Path) -> Path:
    if path:
        return Path(path)
    default = REPO / "runs" / "aftraj-2k" / "corpus.jsonl"
    if default.is_file():
        return default
    from aftraj.corpus.build import build_corpus
    from aftraj.corpus.config import load_corpus_config

    build_corpus(load_corpus_config(REPO / "configs/corpus/aftraj-2k-scripted.yaml"), tmp / "c", progress=False)
    return tmp / "c" / "corpus.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="trajectory file (default: runs/aftraj-2k/corpus.jsonl, built if absent)")
    ap.add_argument("--n", type=int, default=2000, help="trajectories to fit")
    ap.add_argument("--queries", type=int, default=2000, help="prefixes to time")
    ap.add_argument("--config", default=str(REPO / "configs/structural/default.yaml"))
    ap.add_argument("--embedder", choices=("minilm", "hashing"), help="override the config's embedder")
    ap.add_argument("--threads", type=int, help="torch threads while embedding (default: the config's, 2)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = load_structural_config(args.config)
    if args.threads is not None:
        cfg = cfg.replace(embed_threads=args.threads)
    if args.embedder:
        cfg = cfg.replace(embedder=args.embedder)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trajs = load_trajectories(corpus(args.data, tmp))[: args.n]
        print(f"{len(trajs)} trajectories, {sum(len(t.steps) for t in trajs)} steps; embedder {cfg.embedder}, "
              f"{cfg.embed_threads} torch thread(s)")

        # --- fit, cold cache (embedding included), then warm
        emb = make_embedder(cfg.embedder, threads=cfg.embed_threads, batch_size=cfg.embed_batch,
                            max_tokens=cfg.embed_max_tokens)
        t0, c0 = time.perf_counter(), time.process_time()
        mon = StructuralMonitor.fit(trajs, cfg, cache=EmbeddingCache(emb, tmp / "e.npz"), log=print)
        fit_s, fit_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        mon.cache.save()
        t0 = time.perf_counter()
        StructuralMonitor.fit(trajs, cfg, cache=EmbeddingCache(emb, tmp / "e.npz"))
        fit_warm_s = time.perf_counter() - t0

        # --- per-prefix query latency
        rng = random.Random(args.seed)
        pool = [(tr, t) for tr in trajs for t in range(1, len(tr.steps))]
        sample = rng.sample(pool, min(args.queries, len(pool)))
        k = cfg.top_k[min(1, len(cfg.top_k) - 1)]
        lat = {}
        for method in ("structural", "baseline"):
            mon._raw.clear()
            times, cpu = [], []
            for tr, t in sample:
                a, b = time.perf_counter(), time.thread_time()
                mon.score(tr, t, method, k, "raw")
                times.append(time.perf_counter() - a)
                cpu.append(time.thread_time() - b)
            lat[method] = np.array(times) * 1e3
            print(f"{method:<10} query p50 {np.percentile(lat[method], 50):.2f} ms  p99 "
                  f"{np.percentile(lat[method], 99):.2f} ms wall; CPU p50 {np.percentile(cpu, 50) * 1e3:.2f} ms "
                  f"p99 {np.percentile(cpu, 99) * 1e3:.2f} ms  ({len(times)} prefixes, k={k})")

        # --- tagging an unseen step: two new texts through the embedder, nearest centroids
        tag = []
        for i in range(30):
            txt = [f"Reviewer message: unseen remark number {i} about the plan", f"error: unseen failure {i}"]
            a = time.perf_counter()
            act_vecs, obs_vecs = mon.cache.embed(txt[:1]), mon.cache.embed(txt[1:])
            mon.vocab.tag(act_vecs, obs_vecs)
            tag.append(time.perf_counter() - a)
        tag_ms = float(np.percentile(tag, 50) * 1e3)
    info = mon.info
    print(f"fit CPU time {fit_cpu_s:.1f} s (wall {fit_s:.1f} s; the gap is other processes on the machine)")
    print(f"fit: {info['n_action_texts']} action + {info['n_observation_texts']} observation texts embedded in "
          f"{info['embed_s']:.1f} s; vocabulary {info['vocab_size']} tokens; {info['n_entries']} distinct "
          f"prefixes of {info['n_prefixes']}; refit with a warm cache {fit_warm_s:.1f} s; "
          f"unseen step tagging p50 {tag_ms:.1f} ms; baseline query p50 "
          f"{np.percentile(lat['baseline'], 50):.2f} ms")
    s = lat["structural"]
    print(f"fit_s={fit_s:.1f} query_p50_ms={np.percentile(s, 50):.2f} query_p99_ms={np.percentile(s, 99):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
