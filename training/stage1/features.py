"""Frozen-layer features (`feature_cache: true`, with `trainable_layers: N` and `batching:
per_pair`): when only the top N decoder layers train, the input of layer L-N for every token of
every pair never changes, so it is computed once, in the same pass as the reference log-probs,
and each step runs the top N layers (and the final norm and head) only.

On a 2-core CPU a SmolLM2-135M step over ~1,100-token prompts is mostly the 30-layer forward;
with `trainable_layers: 2` a cached step runs 2 of them (`benchmarks/stage1_feature_cache.py`
prints the ratio). The loss, its gradients and the trained weights equal the uncached path's
(tests/training/test_stage1_features.py); the exported model is the whole model, unchanged in
form. Memory: (prompt + 2 completions) x hidden size floats a pair, e.g. ~2.9 MB for a
1,100-token SmolLM2 pair, ~0.9 GB for 300 pairs (float32, held in RAM for the run).

    feats = build(model, pairs, n_top=2)          # [(prompt (1, P, d), completions (2, W-1, d))] + ref logps
    with top_layers_only(model, 2):
        c, r = pair_token_logps(model, p.prompt_ids, [p.chosen_ids, p.rejected_ids], embeds=feats[i])
"""

from __future__ import annotations

from aftraj.scoring import SharedPrompts, decoder_layers, pair_features, top_layers_only  # noqa: F401  (the one definition)


def nbytes(features) -> int:
    return sum(t.numel() * t.element_size() for pair in features for t in pair)
