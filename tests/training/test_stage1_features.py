"""The frozen-layer feature cache (`feature_cache: true`, `aftraj.scoring.pair_features`): scoring
from the captured features through the top layers equals scoring the whole model, gradients
included; a training run with the cache gives the uncached run's losses and weights; the model is
whole again after `top_layers_only`, even on an error; the config refuses what the cache cannot do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aftraj.config import ConfigError
from aftraj.scoring import pair_features, pair_token_logps, top_layers_only
from training.common import freeze_below
from training.stage1.config import load_stage1_config
from training.stage1.trainer import train

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "stage1" / "tiny-cpu.yaml"
PROMPT, COMPS = [5, 9, 11, 30, 2, 7, 13, 21], [[40, 41, 42, 43], [40, 50]]


def _model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa",
                                                dtype=torch.float32)


@pytest.mark.parametrize("n_top", [1, 2])
def test_scoring_from_features_equals_the_whole_model_with_gradients(tiny_model_dir, n_top):
    model = _model(tiny_model_dir)
    freeze_below(model, n_top)
    feats, ref = pair_features(model, PROMPT, COMPS, n_top)
    assert feats[0].shape[:2] == (1, len(PROMPT)) and feats[1].shape[:2] == (2, 3)

    whole = pair_token_logps(model, PROMPT, COMPS)
    (whole[0].sum() - 2 * whole[1].sum()).backward()
    g_whole = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)

    n_layers = len(model.model.layers)
    with top_layers_only(model, n_top):
        assert len(model.model.layers) == n_top
        cached = pair_token_logps(model, PROMPT, COMPS, embeds=feats)
    (cached[0].sum() - 2 * cached[1].sum()).backward()
    assert len(model.model.layers) == n_layers and model.config.num_hidden_layers == n_layers
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == list(range(n_layers))

    for a, b, r in zip(whole, cached, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a, r, atol=1e-5)
    g_cached = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(g_cached) == set(g_whole) and len(g_whole) > 0
    for n in g_whole:
        assert torch.allclose(g_whole[n], g_cached[n], atol=1e-5, rtol=1e-4), n
    # the frozen layers (and the embeddings) get no gradient on either path
    frozen = [*model.model.layers[:n_layers - n_top], model.model.embed_tokens]
    assert all(p.grad is None for mod in frozen for p in mod.parameters())


def test_the_wrong_features_give_other_log_probs(tiny_model_dir):
    # the cached path reads the features, not the ids: zeroed features change the answer
    model = _model(tiny_model_dir)
    feats, _ = pair_features(model, PROMPT, COMPS, 1)
    with torch.no_grad(), top_layers_only(model, 1):
        right = pair_token_logps(model, PROMPT, COMPS, embeds=feats)
        wrong = pair_token_logps(model, PROMPT, COMPS, embeds=(torch.zeros_like(feats[0]), feats[1]))
    assert not torch.allclose(right[0], wrong[0], atol=1e-3)


def test_top_layers_only_restores_the_model_after_an_error(tiny_model_dir):
    model = _model(tiny_model_dir)
    layers = model.model.layers
    with pytest.raises(RuntimeError, match="boom"), top_layers_only(model, 1):
        raise RuntimeError("boom")
    assert model.model.layers is layers and model.config.num_hidden_layers == len(layers)
    with pytest.raises(ValueError, match="decoder layers"), top_layers_only(model, len(layers) + 1):
        pass


def _cfg(tiny_model_dir, corpus, out, **over):
    base = {"model": str(tiny_model_dir), "data": str(corpus), "output_dir": str(out),
            "samples_per_prompt": 0, "per_device_batch_size": 2, "max_steps": 4, "save_steps": 4,
            "report_to": [], "learning_rate": 1e-3, "batching": "per_pair", "trainable_layers": 1,
            "decision_coef": 1.0, "margin_tokens": 6}
    return load_stage1_config(TINY, {**base, **over})


def test_a_run_with_the_cache_equals_the_run_without(tiny_model_dir, handmade_corpus, tmp_path):
    from safetensors.torch import load_file

    plain = train(_cfg(tiny_model_dir, handmade_corpus, tmp_path / "plain"), progress=False)
    cached = train(_cfg(tiny_model_dir, handmade_corpus, tmp_path / "cached", feature_cache=True), progress=False)
    for a, b in zip(plain.history, cached.history, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3, abs=1e-6)
    assert plain.history[-1]["loss"] != pytest.approx(plain.history[0]["loss"], abs=1e-4)   # it trained
    wa = load_file(str(plain.final_dir / "model.safetensors"))
    wb = load_file(str(cached.final_dir / "model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(wa) == set(wb)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5), k
    moved = [k for k in wa if not torch.equal(wa[k], base[k])]
    assert moved and all(".layers.1." in k or k.startswith("model.norm") for k in moved), moved
    info = json.loads((tmp_path / "cached" / "run.json").read_text())["invocations"][-1]["feature_cache"]
    assert info["pairs"] > 0 and info["bytes"] > 0


@pytest.mark.parametrize("over, key", [
    ({"trainable_layers": None}, "trainable_layers"),
    ({"batching": "padded"}, "batching"),
    ({"reference": "live"}, "reference"),
])
def test_the_config_refuses_what_the_cache_cannot_do(tiny_model_dir, handmade_corpus, tmp_path, over, key):
    with pytest.raises(ConfigError, match=key):
        _cfg(tiny_model_dir, handmade_corpus, tmp_path / "x", feature_cache=True, **over)


def test_under_bf16_the_capture_runs_in_the_steps_precision(tiny_model_dir, handmade_corpus, tmp_path, monkeypatch):
    # mixed_precision bf16 (the CPU configs' "auto" on an AVX512-BF16 CPU): the features and the
    # reference come from bf16-autocast forwards, as the steps' are, so the cached run still equals
    # the uncached one (a float32 capture of the unwrapped model was ~2.5x slower and not the
    # precision the steps train in)
    import training.stage1.trainer as trainer

    real, seen = trainer.pair_features, []

    def spy(*a, **kw):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        feats, lps = real(*a, **kw)
        assert all(f.dtype == torch.float32 for f in feats)
        return feats, lps

    monkeypatch.setattr(trainer, "pair_features", spy)
    plain = train(_cfg(tiny_model_dir, handmade_corpus, tmp_path / "plain", mixed_precision="bf16"), progress=False)
    cached = train(_cfg(tiny_model_dir, handmade_corpus, tmp_path / "cached", feature_cache=True,
                        mixed_precision="bf16"), progress=False)
    assert seen and all(seen)
    for a, b in zip(plain.history, cached.history, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-3)


def test_prompts_in_turn_share_their_beginning_and_capture_what_they_capture_alone(tiny_model_dir):
    # stage 1's capture runs a run's pre, post and twin pairs in turn (SharedPrompts): each prompt
    # from where it leaves the last, its shared part's features the last prompt's; the features and
    # log-probs equal each pair captured alone
    from aftraj.scoring import SharedPrompts

    model = _model(tiny_model_dir)
    stem = list(range(50, 90))
    prompts = [stem + [5, 9], stem + [5, 11, 12], stem[:30] + [7, 7, 8], [3, 4] + stem]
    shared = SharedPrompts(model)
    reused = []
    for p in prompts:
        (fp, fc), lps = pair_features(model, p, COMPS, 1, shared=shared)
        reused.append(shared.cache.reused)
        (ap, ac), alone = pair_features(model, p, COMPS, 1)
        assert fp.shape == ap.shape and fc.shape == ac.shape
        torch.testing.assert_close(fp, ap, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fc, ac, atol=1e-5, rtol=1e-5)
        for x, y in zip(lps, alone, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert reused == [0, len(stem) + 1, 30, 0]          # the last shares nothing at its start
