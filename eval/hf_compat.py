"""transformers compatibility patches for the in-process decoding engine (`eval.decoding`), in
one place and version-guarded.

Two patches reach into transformers' internals; both change speed, never tokens (the tests
assert patched == unpatched token for token in float32 on CPU):

- `new_cache`: a `DynamicCache` whose full-attention layers are `SlackLayer`s, a subclass of
  transformers' `DynamicLayer` that appends into spare room of a larger buffer instead of
  concatenating (`DynamicLayer.update` copies the whole cache at every decoded token). It relies
  on DynamicLayer's own state (`keys`, `values`, `is_initialized`, `lazy_initialization`,
  `get_seq_length`) and on `DynamicCache(config=…).layers`.
- `masked_gqa`: sets `TRANSFORMERS_SDPA_FORCE_GQA=1` for a block, which transformers' SDPA
  attention (`integrations.sdpa_attention.use_gqa_in_sdpa`) reads at every call: without it a
  grouped-query model's KV heads are repeated (a copy of the whole stacked cache per layer and
  forward) whenever a mask comes with more than one query token, the walk's case throughout; with
  it PyTorch's CPU kernel takes the mask with `enable_gqa`.

The guard: pyproject.toml pins `transformers==5.24.0` (the `train` extra; the verl environment
has its own transformers and never runs this engine). Both patches are applied only on the
transformers major line they were written and tested against, 5.x (`PATCHED_MAJOR`), and only
when the internals they use are there (`DynamicLayer.lazy_initialization`; the environment
variable in `use_gqa_in_sdpa`). On any other version the engine takes transformers' own
`DynamicCache` and runs without the variable: the same tokens, slower, rather than a subclass of
internals that may have changed meaning.

    python -c "from eval.hf_compat import slack_cache_applies, force_gqa_applies; print(slack_cache_applies(), force_gqa_applies())"
"""

from __future__ import annotations

import contextlib
import functools
import os

PATCHED_MAJOR = 5          # the transformers major version the patches are written for (pin: 5.24.0)
FORCE_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"


@functools.cache
def transformers_major() -> int | None:
    """The installed transformers' major version (None when it cannot be read)."""
    import transformers

    try:
        return int(str(transformers.__version__).split(".")[0])
    except ValueError:
        return None


@functools.cache
def slack_cache_applies() -> bool:
    """Whether `new_cache` swaps in SlackLayers: transformers 5.x with DynamicLayer's lazy init."""
    if transformers_major() != PATCHED_MAJOR:
        return False
    from transformers.cache_utils import DynamicLayer

    return all(hasattr(DynamicLayer, a) for a in ("lazy_initialization", "get_seq_length", "crop"))


@functools.cache
def force_gqa_applies() -> bool:
    """Whether `masked_gqa` sets its variable: transformers 5.x whose SDPA attention reads it."""
    if transformers_major() != PATCHED_MAJOR:
        return False
    import inspect

    try:
        from transformers.integrations import sdpa_attention
        return FORCE_GQA_ENV in inspect.getsource(sdpa_attention.use_gqa_in_sdpa)
    except (ImportError, AttributeError, OSError, TypeError):
        return False


@functools.cache
def slack_layer_class():
    from transformers.cache_utils import DynamicLayer

    class SlackLayer(DynamicLayer):
        """A DynamicLayer that appends into spare room of a larger buffer (keys and values are views
        of its first n positions) instead of concatenating (DynamicLayer copies the whole cache at
        every decoded token). Room grows by an eighth (at least 256 positions); crop keeps the
        buffer."""

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, new = self.get_seq_length(), key_states.shape[-2]
            buf = getattr(self, "_buf", None)
            linked = (buf is not None and n > 0 and self.keys.data_ptr() == buf[0].data_ptr()
                      and buf[0].shape[:2] == key_states.shape[:2] and n + new <= buf[0].shape[2])
            if not linked:
                cap = n + new + max(256, (n + new) // 8)
                shape = (*key_states.shape[:2], cap)
                kb = key_states.new_empty((*shape, key_states.shape[-1]))
                vb = value_states.new_empty((*shape, value_states.shape[-1]))
                if n:
                    kb[:, :, :n] = self.keys
                    vb[:, :, :n] = self.values
                buf = self._buf = (kb, vb)
            buf[0][:, :, n:n + new] = key_states
            buf[1][:, :, n:n + new] = value_states
            self.keys, self.values = buf[0][:, :, :n + new], buf[1][:, :, :n + new]
            return self.keys, self.values

    return SlackLayer


def new_cache(config):
    """A DynamicCache for `config`; where the patch applies, its full-attention layers append in
    place (SlackLayer); other layer kinds (sliding windows) keep transformers' own classes."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if slack_cache_applies():
        from transformers.cache_utils import DynamicLayer

        cache.layers = [slack_layer_class()() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@contextlib.contextmanager
def masked_gqa(enabled: bool = True):
    """Let PyTorch's SDPA take grouped KV heads under an attention mask for the block (see the
    module docstring). The engine enables it only on CPU (a CUDA mask with `enable_gqa` would
    leave the fused kernels for the math one) and only where `force_gqa_applies`; the value
    before is restored."""
    if not (enabled and force_gqa_applies()):
        yield
        return
    before = os.environ.get(FORCE_GQA_ENV)
    os.environ[FORCE_GQA_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FORCE_GQA_ENV, None)
        else:
            os.environ[FORCE_GQA_ENV] = before


def keep_rows(cache, keep) -> None:
    """Keep only the batch rows `keep` of a stacked cache, one layer at a time: the copy adds one
    layer's worth of memory, not a second cache."""
    for li, layer in enumerate(cache.layers):
        k, v = layer.keys.index_select(0, keep), layer.values.index_select(0, keep)
        layer.reset()
        cache.update(k, v, li)


def crop_to(cache, n: int) -> None:
    """Keep the first n positions of `cache` (transformers' `crop` takes how many to remove)."""
    cache.crop(-(cache.get_seq_length() - n))
