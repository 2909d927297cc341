"""Stage 2, TRL path, tiny model on CPU: 3 GRPO steps from a "stage-1" folder. Rewards, their
components and the KL are logged; every trainable parameter changes; checkpoints are written;
--resume continues (and reproduces the uninterrupted step 3); the final folder loads in
`aftraj eval --auditor hf`; the data holds train prefixes only, balanced, both gold verdicts.

The init model is the tiny random Qwen2 with its EOS embedding row scaled up, so completions end
at varied lengths. A random model's output is never well-formed, so every completion gets the
malformed score; the length-dependent overlong penalty (buffer = the whole completion here) is
then what differs within a group, and GRPO has a non-zero advantage to follow. Without it every
advantage is 0 and no parameter could change: the test would be vacuous.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from aftraj.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY2 = REPO / "configs" / "stage2" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory, tiny_model_dir) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tmp_path_factory.mktemp("stage1-final")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.eos_token_id] *= 30.0
    model.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d


def _train(init, data, out, *extra) -> int:
    return main(["train", "stage2", "--engine", "trl", "--config", str(TINY2), "--init", str(init),
                 "--data", str(data), "--out", str(out), "--no-progress",
                 "--set", "overlong_buffer_len=23", *extra])


def _metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, init_dir, handmade_corpus):
    base = tmp_path_factory.mktemp("stage2")
    a, b = base / "a", base / "b"
    assert _train(init_dir, handmade_corpus, a) == 0                        # 3 steps
    assert _train(init_dir, handmade_corpus, b, "--max-steps", "2") == 0     # interrupted at 2
    assert _train(init_dir, handmade_corpus, b, "--resume") == 0            # continues to 3
    return {"a": a, "b": b}


@pytest.mark.slow
def test_rewards_components_and_kl_are_logged(runs):
    m = _metrics(runs["a"])
    assert sorted(m) == [1, 2, 3]
    for row in m.values():
        for key in ("reward", "reward_std", "kl", "loss", "reward/format", "reward/what", "reward/where",
                    "reward/who", "reward/overlong_penalty"):
            assert key in row and math.isfinite(row[key]), (key, row)
        assert -2.0 <= row["reward"] <= 3.5
    assert m[1]["kl"] == pytest.approx(0.0, abs=1e-6)     # policy == stage-1 reference at step 1
    assert m[3]["kl"] > 0                                 # and moves away from it
    assert any(row["reward_std"] > 0 for row in m.values())   # a group with a signal
    assert list((runs["a"] / "runs").rglob("events.out.tfevents.*")), "no TensorBoard events"


def test_every_trainable_parameter_changed(runs, init_dir):
    from safetensors.torch import load_file

    base = load_file(str(init_dir / "model.safetensors"))
    final = load_file(str(runs["a"] / "final" / "model.safetensors"))
    assert set(final) == set(base)
    assert [k for k in base if torch.equal(base[k], final[k])] == []


def test_checkpoints_and_run_record(runs, init_dir):
    out = runs["a"]
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-3").is_dir()
    info = json.loads((out / "run.json").read_text())
    assert info["init_model"] == str(init_dir) and info["versions"]["trl"] == "1.16.0"
    stats = json.loads((out / "data" / "stats.json").read_text())
    assert stats["n_safe_gold"] == stats["n_unsafe_gold"] > 0          # balanced, unsafe_fraction 0.5
    for name in ("train.parquet", "val.parquet", "records.jsonl"):
        assert (out / "data" / name).is_file()
    from datasets import load_from_disk

    assert len(load_from_disk(str(out / "data" / "trl"))) == stats["n_prompts"]


def test_resume_continues_and_matches_the_uninterrupted_run(runs):
    a, b = _metrics(runs["a"]), _metrics(runs["b"])
    assert sorted(b) == [1, 2, 3]
    info = json.loads((runs["b"] / "run.json").read_text())
    assert [i["resume_from_step"] for i in info["invocations"]] == [0, 2]
    for step in (1, 2, 3):
        assert b[step]["reward"] == pytest.approx(a[step]["reward"]), step
    assert b[3]["kl"] == pytest.approx(a[3]["kl"], rel=1e-3, abs=1e-6)


def test_refuses_to_clobber_and_resume_without_checkpoint(runs, init_dir, handmade_corpus, tmp_path, capsys):
    assert _train(init_dir, handmade_corpus, runs["a"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert _train(init_dir, handmade_corpus, tmp_path / "empty", "--resume") == 2
    assert _train(init_dir, handmade_corpus, runs["a"], "--resume", "--set", "beta=0.5") == 2
    assert "beta" in capsys.readouterr().err


def test_final_folder_loads_in_aftraj_eval_hf(runs, handmade_corpus, tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", "--auditor", "hf", "--model", str(runs["a"] / "final"),
                 "--data", str(handmade_corpus / "train.jsonl"), "--out", str(out), "--limit", "2",
                 "--max-new-tokens", "4", "--no-progress", "--n-boot", "20"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["overall"]["n"] == 2


def test_micro_batches_of_one_completion_train_the_same_step(tmp_path, init_dir, handmade_corpus):
    """`micro_batch_size: 1` (the CPU configs) runs each of a step's completions through its own
    forward/backward, TRL accumulating, instead of one padded batch (SDPA's masked path: 16.9 GiB
    for one SmolLM2 step): the same completions are generated once a step, and one step trains
    the same weights as the padded batch."""
    from safetensors.torch import load_file

    from training.stage2.config import Stage2Config
    from training.stage2.trl_engine import grpo_args

    args = grpo_args(Stage2Config(prompts_per_step=2, num_generations=4, gradient_accumulation_steps=3,
                                  micro_batch_size=2), tmp_path / "x", progress=False)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation,
            args.generation_batch_size) == (2, 12, 12, 24)       # 2 prompts x 4 x 3 generated a step
    with pytest.raises(Exception, match="micro_batch_size"):
        Stage2Config(prompts_per_step=2, num_generations=4, micro_batch_size=3)
    whole, single = tmp_path / "whole", tmp_path / "single"
    assert _train(init_dir, handmade_corpus, whole, "--max-steps", "1") == 0
    assert _train(init_dir, handmade_corpus, single, "--max-steps", "1", "--set", "micro_batch_size=1") == 0
    a = load_file(str(whole / "final" / "model.safetensors"))
    b = load_file(str(single / "final" / "model.safetensors"))
    base = load_file(str(init_dir / "model.safetensors"))
    moved = [k for k in a if not torch.equal(a[k], base[k])]
    assert moved and all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4) for k in a), \
        max(float((a[k] - b[k]).abs().max()) for k in a)
    assert _metrics(whole)[1]["reward"] == pytest.approx(_metrics(single)[1]["reward"])   # the same completions
