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

from contextlib import contextmanager

import torch


def _decoder(model):
    """(the inner model, its decoder layers) of a causal LM with `model.layers` (Llama, Qwen2, ...)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"feature_cache needs a decoder with model.layers; {type(model).__name__} has none")
    return inner, layers


@contextmanager
def top_layers_only(model, n_top: int):
    """Run `model` as if it had only its top `n_top` decoder layers (which then read
    `inputs_embeds` as their input): the layer list, the config's layer count (the KV cache's
    size) and each attention's cache index are swapped for the duration and restored after."""
    inner, layers = _decoder(model)
    total = len(layers)
    if not 1 <= n_top <= total:
        raise ValueError(f"n_top={n_top}, but the model has {total} decoder layers")
    top = list(layers)[total - n_top:]
    attns = [layer.self_attn for layer in top]
    saved_idx = [a.layer_idx for a in attns]
    saved_n = inner.config.num_hidden_layers
    inner.layers = torch.nn.ModuleList(top)
    inner.config.num_hidden_layers = n_top
    for i, a in enumerate(attns):
        a.layer_idx = i
    try:
        yield model
    finally:
        for a, i in zip(attns, saved_idx):
            a.layer_idx = i
        inner.config.num_hidden_layers = saved_n
        inner.layers = layers


class SharedPrompts:
    """`pair_features` over pairs in turn whose prompts share their beginnings (a run's pre, post
    and twin pairs: the template and steps 0..k*-1): each prompt runs from where it leaves the last
    one (`aftraj.scoring.PrefixCache`), and its features over the shared part are the last prompt's
    (the same tokens at the same positions). ~2x fewer prompt tokens through the model for stage 1's
    pairs; equal features and log-probs (tests/training/test_stage1_features.py)."""

    def __init__(self, model):
        from aftraj.scoring import PrefixCache

        self.cache = PrefixCache(model)
        self.prompt = None                                # the last prompt's features (1, P, d)


@torch.no_grad()
def pair_features(model, prompt_ids: list[int], completions: list[list[int]], n_top: int, *,
                  shared: SharedPrompts | None = None):
    """One pair scored by the whole model (`pair_token_logps`), with the input of decoder layer
    L - n_top captured on both forwards. Returns ((prompt (1, P, d), completions (n, W-1, d)),
    [per-token log-probs of each completion]). A one-token-wide pair has no second forward; its
    completions feature is an empty (n, 0, d) tensor. `shared`: the prompt runs from where it
    leaves the last one `shared` saw."""
    from aftraj.scoring import pair_token_logps

    _, layers = _decoder(model)
    seen: list[torch.Tensor] = []

    def grab(_mod, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    handle = layers[len(layers) - n_top].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        lps = pair_token_logps(model, prompt_ids, completions, prefix_cache=shared and shared.cache)
    finally:
        handle.remove()
    if shared is not None:
        n = shared.cache.reused
        if n:
            seen[0] = torch.cat([shared.prompt[:, :n], seen[0]], dim=1)
        shared.prompt = seen[0]
    if len(seen) == 1:
        seen.append(seen[0].new_zeros((len(completions), 0, seen[0].shape[-1])))
    if len(seen) != 2:
        raise RuntimeError(f"expected 2 forwards through layer {len(layers) - n_top}, saw {len(seen)}")
    return (seen[0], seen[1]), lps


def nbytes(features) -> int:
    return sum(t.numel() * t.element_size() for pair in features for t in pair)
