"""Packed prefixes (aftraj.scoring.Pack): one forward over every prefix of a run gives each
prefix's next-token logits as if it ran alone, with sdpa's boolean mask and eager's additive one,
and through the top layers from frozen-layer features."""

import platform
import sys

import pytest
import torch

from aftraj.scoring import Pack, packed_logits


def _alone(model, seq):
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]


def _seqs():
    g = torch.Generator().manual_seed(0)
    stable = torch.randint(5, 200, (40,), generator=g).tolist()
    tail = lambda t: [3, 7 + t, 9, 11]                      # noqa: E731  a per-prefix suffix
    # prefix t: the stable part up to its own end, then its own suffix (the last is the longest)
    return [stable[: 10 + 10 * t] + tail(t) for t in range(4)] + [stable[:25]]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_each_packed_sequence_has_the_logits_it_has_alone(tiny_model_dir, impl):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=impl).eval()
    seqs = _seqs()
    pack = Pack(seqs, base=3)
    assert len(pack) < sum(map(len, seqs))                   # the shared part runs once
    assert pack.last[4] == 24                                # a prefix of the base ends inside it
    with torch.no_grad():
        got = packed_logits(model, pack)
    assert got.shape[0] == len(seqs)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(got[i], _alone(model, s), atol=1e-4, rtol=1e-4)
    # a block that could see another block's tokens (no mask) gives other logits: the mask matters
    with torch.no_grad():
        leaky = model(input_ids=torch.tensor([pack.ids]), position_ids=torch.tensor([pack.pos]),
                      use_cache=False).logits[0, pack.last]
    assert not torch.allclose(leaky[1], got[1], atol=1e-3)


def test_the_top_layers_from_frozen_features_give_the_same_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from aftraj.scoring import top_layers_only

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    seqs = _seqs()
    pack = Pack(seqs)
    layers = model.model.layers
    seen = []
    h = layers[len(layers) - 1].register_forward_pre_hook(
        lambda _m, a, kw: seen.append((a[0] if a else kw["hidden_states"]).detach().clone()), with_kwargs=True)
    with torch.no_grad():
        full = packed_logits(model, pack)
    h.remove()
    with torch.no_grad(), top_layers_only(model, 1):
        # the hook saw the base's forward, then the blocks'
        top = packed_logits(model, pack, embeds=torch.cat(seen, dim=1))
    assert len(seen) == 2 and torch.cat(seen, dim=1).shape[1] == len(pack)
    torch.testing.assert_close(top, full, atol=1e-5, rtol=1e-5)


def test_gradients_through_the_cache_are_those_of_each_sequence_alone(tiny_model_dir):
    # training reads the packed logits: a loss on them has the gradient the same loss has summed
    # over each sequence run alone (the blocks' gradient flows through the base's cache)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    seqs = _seqs()
    pack = Pack(seqs, base=3)
    target = torch.arange(len(seqs)) + 5
    w = model.model.layers[0].self_attn.q_proj.weight

    def grad(loss):
        model.zero_grad()
        loss.backward()
        return w.grad.clone()

    packed = grad(torch.nn.functional.cross_entropy(packed_logits(model, pack), target, reduction="sum"))
    alone = grad(sum(torch.nn.functional.cross_entropy(
        model(input_ids=torch.tensor([s]), use_cache=False).logits[0, -1:], target[i:i + 1], reduction="sum")
        for i, s in enumerate(seqs)))
    assert packed.abs().sum() > 0
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)


def test_the_mask_covers_the_blocks_rows_only():
    pack = Pack(_seqs(), base=3)
    m = pack.mask("sdpa")
    assert m.shape == (1, 1, len(pack) - pack.base_len, len(pack)) and m.dtype == torch.bool
    start, end, share = pack.blocks[0]
    row = m[0, 0, 0]                                          # a block's first token
    assert row[:share].all() and not row[share:start].any() and row[start] and not row[start + 1:].any()


def test_bad_packs_are_refused():
    with pytest.raises(ValueError, match="empty"):
        Pack([[1, 2], []])
    with pytest.raises(ValueError, match="attn_implementation"):
        Pack([[1, 2, 3]]).mask("flash_attention_2")


def _rss_bytes() -> int:
    import os
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="malloc_trim is glibc's: elsewhere release_freed_memory is a no-op (tested below)")
def test_release_freed_memory_returns_the_holes_between_kept_tensors():
    # the capture loops' pattern: tensors kept among freed ones of the same size; glibc keeps the
    # freed ones resident (a stage-1 capture held 9.4 GB of heap for 1.45 GB of features)
    from aftraj.scoring import release_freed_memory

    torch.ones(4 << 20, dtype=torch.uint8)          # freed: mmap threshold raised, 1 MiB tensors from the heap
    kept, made = [], [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(400)]
    for i, t in enumerate(made):
        if i % 10 == 9:
            kept.append(t)
    del made, t
    before = _rss_bytes()
    assert release_freed_memory() is True
    assert before - _rss_bytes() > 150 << 20, "the ~360 MiB freed between the kept tensors stayed resident"
    assert all(int(k[0]) == 1 and int(k[-1]) == 1 for k in kept)     # what is kept is untouched


def test_release_freed_memory_is_a_no_op_without_glibc(monkeypatch):
    import aftraj.scoring as sc

    monkeypatch.setattr(sc, "_MALLOC_TRIM", False)
    assert sc.release_freed_memory() is False


def test_the_kv_cache_goes_by_the_name_the_installed_transformers_takes(tiny_model_dir):
    # transformers 5.24 renamed forward's past_key_values to cache (the old name warns, removal in
    # 5.40); the GPU script's 5.17 knows only past_key_values: the name comes from the signature
    import warnings

    from transformers import AutoModelForCausalLM

    from aftraj.scoring import PrefixCache, cache_of, pair_token_logps, past

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return None

    assert past(Old(), "c") == {"past_key_values": "c"}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    pc = PrefixCache(model)
    seq = _seqs()[3]                                         # 44 tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)      # no deprecated keyword on any forward
        with torch.no_grad():
            pc.run(seq + [5, 6], logits_to_keep=1)
            out = pc.run(seq + [7], logits_to_keep=1)          # from the kept cache
            got = pair_token_logps(model, seq, [[3, 4], [8]], prefix_cache=pc)
    assert pc.reused == len(seq) - 1 and cache_of(out) is not None   # the prompt ran from the cache
    want = pair_token_logps(model, seq, [[3, 4], [8]])
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want, strict=True))
