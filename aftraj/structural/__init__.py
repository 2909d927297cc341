"""The structural monitor: an LLM-free failure score from the *shape* of a trajectory.

Steps become typed tokens (k-means over all-MiniLM-L6-v2 embeddings of their action and
observation texts, then over the pairs); a prefix's neighbours are retrieved among prefixes of
finished runs of other families (token trigrams -> MinHash -> LSH -> Jaccard -> windowed edit
distance); the fraction of failed neighbours is the score. An embedding-retrieval baseline sits
beside it. Modules: config, embed, tokens, retrieval, signals, monitor, tune.

    aftraj structural fit --data runs/aftraj-2k --out runs/structural
    aftraj eval --auditor structural:runs/structural --data runs/aftraj-2k/test.jsonl --all-prefixes --out runs/eval-structural
"""
