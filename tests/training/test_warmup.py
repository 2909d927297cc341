"""Format warm-up (issue 11 item 2, not in the paper): content-independent targets (flipping
labels or rewriting step contents leaves them identical), both verdict kinds drawn, targets parse,
config validation, and a 2-step CPU run on the tiny model whose RUN/final loads with the hf
auditor's loader.

    PYTHONPATH=$PWD pytest tests/training/test_warmup.py -q
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from aftraj.verdict import ParseFailure, parse_verdict
from aftraj.config import ConfigError
from training.common import synthetic_trajectories
from training.warmup.config import WarmupConfig, load_warmup_config
from training.warmup.data import warmup_examples

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _targets(trajs, **kw):
    return [(e["traj_id"], e["t"], e["completion"])
            for e in warmup_examples(trajs, 64, seed=3, alarm_fraction=0.4, **kw)]


def test_targets_never_read_labels_or_content():
    trajs = synthetic_trajectories(12, seed=0)
    base = _targets(trajs)
    flipped = []
    for tr in trajs:   # safe <-> unsafe, every step's content rewritten
        lb = tr.label
        other = next(x.label for x in trajs if x.label.unsafe != lb.unsafe)
        steps = [dataclasses.replace(s, content="rewritten " + s.content[::-1]) for s in tr.steps]
        flipped.append(dataclasses.replace(tr, label=other, steps=steps))
    assert _targets(flipped) == base
    # the prompts did change (the test is not vacuous)
    a = warmup_examples(trajs, 4, seed=3, alarm_fraction=0.4)
    b = warmup_examples(flipped, 4, seed=3, alarm_fraction=0.4)
    assert [x["messages"] for x in a] != [x["messages"] for x in b]


def test_targets_parse_and_mix_alarm_and_safe():
    trajs = synthetic_trajectories(12, seed=0)
    ex = warmup_examples(trajs, 200, seed=0, alarm_fraction=0.3)
    by_id = {tr.id: tr for tr in trajs}
    kinds = []
    for e in ex:
        v = parse_verdict(e["completion"], e["t"])
        assert not isinstance(v, ParseFailure)
        kinds.append(v.decision)
        if v.decision == "UNSAFE":
            assert v.step == e["t"] and v.agent == by_id[e["traj_id"]].steps[e["t"]].agent
    frac = kinds.count("UNSAFE") / len(kinds)
    assert 0.2 < frac < 0.4
    assert {parse_verdict(e["completion"], e["t"]).decision
            for e in warmup_examples(trajs, 50, seed=0, alarm_fraction=0.0)} == {"SAFE"}
    assert {parse_verdict(e["completion"], e["t"]).decision
            for e in warmup_examples(trajs, 50, seed=0, alarm_fraction=1.0)} == {"UNSAFE"}


@pytest.mark.parametrize("key,bad,good", [("alarm_fraction", 1.01, 1.0), ("alarm_fraction", -0.01, 0.0),
                                          ("max_steps", 0, 1), ("batch_size", 0, 1),
                                          ("parse_check_prompts", -1, 0), ("learning_rate", 0.0, 1e-6),
                                          ("finetune", "half", "full"), ("mixed_precision", "fp16", "no"),
                                          ("mixed_precision", "fp16", "auto")])
def test_config_bounds(key, bad, good):
    with pytest.raises(ConfigError, match=key):
        WarmupConfig(**{key: bad})
    assert getattr(WarmupConfig(**{key: good}), key) == good


def test_unknown_key_names_the_file(tmp_path):
    p = tmp_path / "w.yaml"
    p.write_text("max_step: 3\n")
    with pytest.raises(ConfigError, match=r"w\.yaml.*max_step"):
        load_warmup_config(p)


def test_two_steps_on_tiny_model_give_a_loadable_full_model(tiny_model_dir, tmp_path):
    from aftraj.models import load_model_and_tokenizer as load_model
    from training.warmup.trainer import warmup

    cfg = load_warmup_config(CONFIGS / "warmup" / "tiny-cpu.yaml",
                             {"model": str(tiny_model_dir), "output_dir": str(tmp_path / "run")})
    stats = warmup(cfg, progress=False)
    final = tmp_path / "run" / "final"
    assert (final / "config.json").exists() and (final / "tokenizer_config.json").exists()
    model, tok = load_model(final)
    assert tok.chat_template and model.config.use_cache
    saved = json.loads((tmp_path / "run" / "warmup_stats.json").read_text())
    assert saved == stats and saved["steps"] == 2 and saved["n"] == 2
    assert saved["loss_first"] == saved["loss_first"] and saved["loss_last"] < saved["loss_first"] + 1.0
    assert 0.0 <= saved["parse_rate"] <= 1.0


def test_bf16_autocast_trains_in_bf16_and_exports_float32(tiny_model_dir, tmp_path, monkeypatch):
    """mixed_precision: bf16 runs the warm-up's forward under CPU bf16 autocast (float32 weights),
    and the exported model is the config's export dtype."""
    import torch

    from aftraj.models import load_model_and_tokenizer as load_model
    from training.warmup import trainer

    seen = []
    real = trainer.completion_loss

    def spy(model, batch, device):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return real(model, batch, device)

    monkeypatch.setattr(trainer, "completion_loss", spy)
    cfg = load_warmup_config(CONFIGS / "warmup" / "tiny-cpu.yaml",
                             {"model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"),
                              "mixed_precision": "bf16", "parse_check_prompts": 0})
    stats = trainer.warmup(cfg, progress=False)
    assert seen and all(seen) and stats["loss_first"] == stats["loss_first"]
    model, _ = load_model(tmp_path / "run" / "final")
    assert next(model.parameters()).dtype == torch.float32


def test_completion_loss_matches_the_masked_full_sequence_loss(tiny_model_dir):
    """The left-padded, last-positions-only loss equals the plain loss with the prompt masked,
    example by example (unpadded), so the logits_to_keep shortcut scores the same tokens."""
    import torch

    from aftraj.models import load_model_and_tokenizer as load_model
    from training.warmup.trainer import _batch, completion_loss

    model, _ = load_model(tiny_model_dir)
    model.float()
    items = [([5, 6, 7, 8, 9, 10], [11, 12, 13]), ([20, 21, 22], [23, 24, 25, 26, 27])]
    got = completion_loss(model, _batch(items, 0), "cpu")
    nll, n = 0.0, 0
    for p, c in items:
        ids = torch.tensor([p + c])
        labels = torch.tensor([[-100] * len(p) + c])
        nll += float(model(input_ids=ids, labels=labels).loss) * len(c)
        n += len(c)
    assert abs(float(got) - nll / n) < 1e-4
    # not vacuous: changing one completion token changes the loss
    other = completion_loss(model, _batch([(p, [c[0] + 1] + c[1:]) for p, c in items], 0), "cpu")
    assert abs(float(other) - float(got)) > 1e-6


def test_check_only_uses_the_same_prefixes_and_writes_parse_check(tiny_model_dir, tmp_path):
    from training.warmup.trainer import check_model

    cfg = load_warmup_config(CONFIGS / "warmup" / "tiny-cpu.yaml",
                             {"model": str(tiny_model_dir), "output_dir": str(tmp_path / "raw")})
    res = check_model(cfg)
    assert res["n"] == 2 and res["parsed"] + sum(res["failure_codes"].values()) == 2
    # every failure (up to the cap) is kept verbatim with its code, for diagnosis
    assert len(res["failures"]) == sum(res["failure_codes"].values())
    assert all(f["code"] in res["failure_codes"] and isinstance(f["text"], str) for f in res["failures"])
    assert json.loads((tmp_path / "raw" / "parse_check.json").read_text()) == res
    assert not (tmp_path / "raw" / "final").exists()


def test_parse_check_keeps_at_most_the_cap_of_failures(tiny_model_dir, tmp_path, monkeypatch):
    import training.warmup.trainer as wt

    monkeypatch.setattr(wt, "MAX_FAILURES_SHOWN", 1)
    cfg = load_warmup_config(CONFIGS / "warmup" / "tiny-cpu.yaml",
                             {"model": str(tiny_model_dir), "output_dir": str(tmp_path / "raw")})
    res = wt.check_model(cfg)
    assert sum(res["failure_codes"].values()) == 2      # the random tiny model never parses
    assert len(res["failures"]) == 1


def test_parse_check_decodes_plain_greedy_whatever_the_checkpoint_says(tiny_model_dir, tmp_path, monkeypatch):
    """A checkpoint's generation_config (Qwen2.5-7B-Instruct's sets repetition_penalty 1.05) must not
    change the parse check's decoding: it is plain greedy, as the evaluation's (issue 46)."""
    import shutil

    import training.warmup.trainer as wt

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    gc = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**gc, "repetition_penalty": 1.05, "top_k": 20}))
    seen = []
    from transformers.generation.utils import GenerationMixin

    real = GenerationMixin.generate

    def spy(self, *a, **kw):
        out = real(self, *a, **kw)
        seen.append(self._prepare_generation_config(None, **kw)[0].repetition_penalty)
        return out

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    cfg = load_warmup_config(CONFIGS / "warmup" / "tiny-cpu.yaml",
                             {"model": str(model_dir), "output_dir": str(tmp_path / "raw")})
    wt.check_model(cfg)
    assert seen and all(p == 1.0 for p in seen), seen
