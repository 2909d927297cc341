"""Teacher-forced scoring of completions under a causal LM: the per-token log-probs that stage 1's
per-pair loss (`training/stage1/loss.py`, `trainer.py`) and the boundary probe (`eval/probe.py`)
both read. torch is imported when called, so the core package imports without it.

    from aftraj.scoring import pair_token_logps
    safe_lp, alarm_lp = pair_token_logps(model, prompt_ids, [safe_ids, alarm_ids])
"""

from __future__ import annotations

import contextlib

MIXED_PRECISION = ("no", "bf16", "auto")


def resolve_mixed_precision(mp: str) -> str:
    """"auto" -> "bf16" where the device computes bf16 natively (a CUDA GPU that supports it, or a
    CPU with AVX512-BF16 / AMX-BF16; elsewhere bf16 autocast is emulated and slower), else "no"."""
    if mp != "auto":
        return mp
    import torch

    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    from pathlib import Path

    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "no"
    return "bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "no"


_MALLOC_TRIM = None


def release_freed_memory() -> bool:
    """Give the C heap's free pages back to the OS (glibc's `malloc_trim(0)`; a no-op returning
    False elsewhere). CPU tensors come from malloc: between a long loop's long-lived tensors (a
    feature cache) its freed activations stay resident, several times the live data, so the
    capture loops call this as they go and the step trainer every few dozen steps. Not after every
    training step: a step's freed activations are what the next step reuses, and handing them back
    makes it fault every page in again (the figures: benchmarks/README.md)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        _MALLOC_TRIM = False
        try:
            import ctypes

            fn = ctypes.CDLL("libc.so.6").malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _MALLOC_TRIM = fn
        except (OSError, AttributeError):      # not glibc (macOS, musl): nothing to do
            pass
    return bool(_MALLOC_TRIM and _MALLOC_TRIM(0))


def autocast(mixed_precision: str, device):
    """bf16 autocast on `device` (a torch.device or its type) when `mixed_precision` resolves to
    "bf16" (float32 weights; ~2.5x a 1,100-token SmolLM2 forward on an AVX512-BF16 CPU), else a no-op."""
    import torch

    kind = getattr(device, "type", device)
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=resolve_mixed_precision(mixed_precision) == "bf16")


def past(model, cache) -> dict:
    """The forward keyword that hands `model` a KV cache: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name warns, and goes in 5.40); 5.17, the GPU script's pin,
    knows only the old one. Read from the forward's signature (through its decorators; a PEFT
    model's from its base model's, which it passes the keyword on to)."""
    import inspect

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model   # a PEFT model passes it on
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return {"cache" if "cache" in params else "past_key_values": cache}


def cache_of(out):
    """The KV cache a forward returned (`cache` from transformers 5.24, `past_key_values` before)."""
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


def decision_ids(tok, t: int, alarm) -> tuple[list[int], list[int], int]:
    """(SAFE ids, ALARM ids, decision position) of the canonical completions on prefix t: the
    canonical SAFE completion and `alarm` (a Verdict) formatted, and their first divergence."""
    from aftraj.tokens import completion_ids, first_divergence
    from aftraj.verdict import canonical_completion, format_completion

    s = completion_ids(tok, canonical_completion(t))[0]
    a = completion_ids(tok, format_completion(alarm))[0]
    d = first_divergence(s, a)
    if d is None:
        raise ValueError("the SAFE and ALARM completions do not diverge under this tokenizer")
    return s, a, d


class PrefixCache:
    """The KV cache of the last sequence run through it, so that the next sequence sharing its
    beginning runs only its own rest: the probe's pre, post and twin prompts of one run share the
    chat template and steps 0..k*-1 (~90 % of a 1,000-token prompt). Inference only (no grad).
    Equal to running each sequence whole (tests/aftraj/test_scoring_pack.py).

        pc = PrefixCache(model)
        out = pc.run(ids, logits_to_keep=1)        # cache_of(out): all of ids, the caller's
    """

    def __init__(self, model, min_shared: int = 16):
        self.model, self.min_shared = model, min_shared
        self.ids: list[int] = []
        self.cache = None
        self.reused = 0                                   # tokens of the last sequence taken from the cache

    def run(self, ids: list[int], **kw):
        import copy

        import torch

        # the shared prefix's length (the first difference, else the shorter one)
        n = next((j for j, (x, y) in enumerate(zip(self.ids, ids, strict=False)) if x != y),
                 min(len(self.ids), len(ids)))
        n = min(n, len(ids) - 1)                          # at least one token runs: its logits are read
        cache = None
        if self.cache is not None and n >= self.min_shared:
            cache = copy.deepcopy(self.cache)
            if len(self.ids) > n:
                cache.crop(n - len(self.ids))             # negative: tokens to drop (every transformers 5)
        else:
            n = 0
        self.reused = n
        device = next(self.model.parameters()).device
        out = self.model(input_ids=torch.tensor([ids[n:]], device=device),
                         position_ids=torch.arange(n, len(ids), device=device)[None],
                         **past(self.model, cache), use_cache=True, **kw)
        self.ids, self.cache = list(ids), cache_of(out)
        # the caller may extend its copy
        setattr(out, "cache" if getattr(out, "cache", None) is not None else "past_key_values", copy.deepcopy(self.cache))
        return out


def pair_token_logps(model, prompt_ids: list[int], completions: list[list[int]], *, embeds=None,
                     prefix_cache: PrefixCache | None = None) -> list:
    """Per-token log-probs of each completion after one prompt, with no padding mask: the prompt
    runs once (one row, the causal kernel) and its KV cache is shared by the completions, which run
    together right-padded (a padded tail is never attended by the real tokens before it, so no mask
    is needed). Gradients flow through the cache into the prompt's forward. Equal to scoring each
    prompt + completion on its own (tests/training/test_stage1_loss.py), at about a third of the
    cost for ~700-token prompts and ~60-token completions. Returns one tensor per completion.

    `embeds` = (prompt (1, P, d), completions (n, W-1, d)): the inputs of the model's first layer
    for the two forwards, in place of the token embeddings (stage 1's frozen-layer features,
    `pair_features` below, cached by `training/stage1/trainer.py`; the ids still pick the scored
    tokens). `prefix_cache` (`PrefixCache`, no grad, no embeds): the prompt runs from where it
    leaves the last one scored."""
    import torch

    device = next(model.parameters()).device
    if prefix_cache is not None:
        if embeds is not None:
            raise ValueError("pair_token_logps: prefix_cache reads token ids, not embeds")
        out = prefix_cache.run(prompt_ids, logits_to_keep=1)
    else:
        p = torch.tensor([prompt_ids], device=device)
        first_in = {"input_ids": p} if embeds is None else {"inputs_embeds": embeds[0]}
        out = model(**first_in, use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1:]                                   # predicts completion token 0
    cache = cache_of(out)
    n, width = len(completions), max(map(len, completions))
    ids = torch.tensor([c + [c[-1]] * (width - len(c)) for c in completions], device=device)
    if width > 1:
        cache.batch_repeat_interleave(n)
        pos = torch.arange(len(prompt_ids), len(prompt_ids) + width - 1, device=device).expand(n, -1)
        rest_in = {"input_ids": ids[:, :-1]} if embeds is None else {"inputs_embeds": embeds[1]}
        rest = model(**rest_in, **past(model, cache), position_ids=pos, use_cache=True).logits
        logits = torch.cat([first.expand(n, -1, -1), rest], dim=1)
    else:
        logits = first.expand(n, -1, -1)
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[..., None])[..., 0]
    return [lp[i, : len(c)] for i, c in enumerate(completions)]


# --------------------------------------------------------------------------- packed prefixes

class Pack:
    """Token sequences that share their beginnings, packed for two forwards (every prefix of a run:
    each prefix's prompt is the run's longest prompt up to its own last step, then a few tokens of
    its own). The `base` sequence runs first, causally (the unmasked kernel) with its KV cache kept;
    each other sequence adds only its tokens after its longest common prefix with the base, as a
    block that attends to that common prefix in the cache and causally to itself, at the positions
    it has in its own sequence; the blocks run together in a second forward over the cache, under a
    (blocks x all) mask. So the logits at `last[i]` are those of sequence i run alone
    (tests/aftraj/test_scoring_pack.py). One masked forward over every packed token (an N x N mask)
    computed the same, ~1.5x slower under bf16 autocast and ~1.2x in float32 on a 2,900-token
    SmolLM2 run, with an N x N mask to keep.

        pack = Pack([ids_0, ids_1, ..., ids_T])       # base: the last (longest) one
        logits = packed_logits(model, pack)           # (len(seqs), vocab): what follows each
    """

    def __init__(self, seqs: list[list[int]], base: int = -1):
        if not seqs:
            raise ValueError("Pack needs at least one sequence")
        root = list(seqs[base])
        if not root:
            raise ValueError("Pack: the base sequence is empty")
        ids, pos, last, blocks = list(root), list(range(len(root))), [], []
        for s in seqs:
            if not s:
                raise ValueError("Pack: an empty sequence has no last token")
            n = min(len(s), len(root))
            share = next((j for j in range(n) if s[j] != root[j]), n)
            if share == len(s):              # s is a prefix of the base: its last token is the base's
                last.append(share - 1)
                continue
            start = len(ids)
            ids.extend(s[share:])
            pos.extend(range(share, len(s)))
            blocks.append((start, len(ids), share))
            last.append(len(ids) - 1)
        self.ids, self.pos, self.last = ids, pos, last
        self.base_len, self.blocks = len(root), blocks

    def __len__(self) -> int:
        return len(self.ids)

    def mask(self, attn_implementation: str = "sdpa", dtype=None):
        """The (1, 1, M, N) attention mask of the blocks' forward (M block tokens, N = all packed
        tokens: the base's cache, then the blocks), as this model's attention reads it as-is
        (transformers passes a 4D mask through): boolean for `sdpa` (True attends), additive float
        (0 / dtype min) for `eager`. FlashAttention takes no arbitrary mask."""
        import torch

        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"a packed forward needs attn_implementation 'sdpa' or 'eager', got {attn_implementation!r}")
        n, b = len(self.ids), self.base_len
        keep = torch.zeros(n - b, n, dtype=torch.bool)
        for start, end, share in self.blocks:
            keep[start - b:end - b, :share] = True
            keep[start - b:end - b, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril_()
        if attn_implementation == "sdpa":
            return keep[None, None]
        dtype = dtype or torch.float32
        return torch.zeros(n - b, n, dtype=dtype).masked_fill_(~keep, torch.finfo(dtype).min)[None, None]


def packed_logits(model, pack: Pack, *, embeds=None, mask=None):
    """(len(seqs), vocab) logits after each packed sequence's last token: the base's forward
    (causal, its cache kept), then the blocks' over that cache (`Pack`); the head runs at those
    positions only. Gradients flow through the cache into the base's forward. `embeds` (1, N, d):
    the first layer's input for every packed token in place of the token embeddings (frozen-layer
    features, `capture` in `training/prefixes/trainer.py`); `mask` reuses `pack.mask(...)` built
    before."""
    import torch

    device = next(model.parameters()).device
    b = pack.base_len
    ids = torch.tensor([pack.ids], device=device)
    pos = torch.tensor([pack.pos], device=device)

    def inputs(sl):
        return {"input_ids": ids[:, sl]} if embeds is None else {"inputs_embeds": embeds[:, sl]}

    in_base = sorted({i for i in pack.last if i < b})        # the base's own last token is one
    in_blocks = sorted({i for i in pack.last if i >= b})
    out = model(**inputs(slice(0, b)), position_ids=pos[:, :b], use_cache=bool(in_blocks),
                logits_to_keep=torch.tensor(in_base, device=device))
    logits, at = out.logits[0], {i: j for j, i in enumerate(in_base)}
    if in_blocks:
        if mask is None:
            impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
            mask = pack.mask(impl, next(model.parameters()).dtype)
        rest = model(**inputs(slice(b, None)), position_ids=pos[:, b:], **past(model, cache_of(out)),
                     attention_mask=mask.to(device), use_cache=True,
                     logits_to_keep=torch.tensor([i - b for i in in_blocks], device=device)).logits[0]
        at.update({i: len(in_base) + j for j, i in enumerate(in_blocks)})
        logits = torch.cat([logits, rest])
    return logits[torch.tensor([at[i] for i in pack.last], device=device)]


# --------------------------------------------------------------------------- frozen-layer features
# (stage 1's feature cache, training/stage1/trainer.py, and the probe's shared trunk, eval/probe.py)

def decoder_layers(model):
    """(the inner model, its decoder layers) of a causal LM with `model.layers` (Llama, Qwen2, ...)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"feature_cache needs a decoder with model.layers; {type(model).__name__} has none")
    return inner, layers


@contextlib.contextmanager
def top_layers_only(model, n_top: int):
    """Run `model` as if it had only its top `n_top` decoder layers (which then read
    `inputs_embeds` as their input): the layer list, the config's layer count (the KV cache's
    size) and each attention's cache index are swapped for the duration and restored after."""
    import torch

    inner, layers = decoder_layers(model)
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
        for a, i in zip(attns, saved_idx, strict=True):
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
        self.cache = PrefixCache(model)
        self.prompt = None                                # the last prompt's features (1, P, d)


def pair_features(model, prompt_ids: list[int], completions: list[list[int]], n_top: int, *,
                  shared: SharedPrompts | None = None):
    """One pair scored by the whole model (`pair_token_logps`), with the input of decoder layer
    L - n_top captured on both forwards. Returns ((prompt (1, P, d), completions (n, W-1, d)),
    [per-token log-probs of each completion]). A one-token-wide pair has no second forward; its
    completions feature is an empty (n, 0, d) tensor. `shared`: the prompt runs from where it
    leaves the last one `shared` saw."""
    import torch

    _, layers = decoder_layers(model)
    seen: list[torch.Tensor] = []

    def grab(_mod, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    handle = layers[len(layers) - n_top].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
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
