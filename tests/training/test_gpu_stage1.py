"""Phase 1 of the one GPU check (`scripts/gpu_check.sh`; the script itself:
tests/training/test_gpu_check_script.py): its Python halves on CPU with tiny shapes (default
suite): prepare (exact-length prompts, the check config), the trainer's stop-at-2 / resume-to-4 /
export in process, verify (its assertions and figures)."""

from __future__ import annotations

import json
import re

import pytest

LINE = re.compile(r"^gpu_check: peak_alloc_gib=(\S+) peak_reserved_gib=(\S+) micro_step_s=(\S+) "
                  r"prod_peak_gib≈(\S+) prod_step_s≈(\S+) prod_epoch_h≈(\S+) prod_run_h≈(\S+) ", re.M)


@pytest.fixture(scope="module")
def tiny_check(tmp_path_factory):
    from training.stage1 import gpu_check
    from training.stage1.config import load_stage1_config
    from training.stage1.trainer import train

    root = tmp_path_factory.mktemp("gpu-check")
    assert gpu_check.main(["prepare", "--root", str(root), "--tiny"]) == 0
    cfg = load_stage1_config(root / "stage1-gpu-check.yaml")
    train(cfg, phase="train", stop_at_step=gpu_check.STOP_AT, progress=False)
    train(cfg, phase="train", resume=True, progress=False)
    return root, cfg


def test_prepared_prompts_are_exactly_the_budget(tiny_check):
    from transformers import AutoTokenizer

    from training.stage1 import gpu_check
    from aftraj.tokens import chat_prompt_ids

    root, cfg = tiny_check
    tok = AutoTokenizer.from_pretrained(root / "model")
    records = [json.loads(x) for x in (root / "run" / "preferences.jsonl").read_text().splitlines()]
    assert [len(chat_prompt_ids(tok, r["messages"])) for r in records] == [gpu_check.TINY_PROMPT_TOKENS] * 8
    assert (cfg.max_steps, cfg.num_epochs, cfg.sdpa_math_kernel, cfg.export_dtype) == (4, None, False, "bfloat16")
    assert cfg.optimizer == "adamw_bnb_8bit" and cfg.mixed_precision == "bf16"   # production's, kept


def test_verify_passes_on_the_run_and_prints_the_extrapolation(tiny_check, capsys, tmp_path):
    from training.stage1 import gpu_check

    root, _ = tiny_check
    fig = gpu_check.verify(root, pairs=1100, require_cuda=False, figures_dir=tmp_path / "figs")
    assert fig["prod_steps"] == 69 and 2 <= fig["prod_epochs"] <= 3
    assert 2.0 < fig["params_check_b"] < 2.05 and 7.6 < fig["params_prod_b"] < 7.7   # Qwen2.5-7B: 7.62B
    assert 4.6 < fig["compute_ratio"] < 5.0
    out = capsys.readouterr().out
    assert LINE.search(out)
    assert f"micro_step_s={fig['micro_step_s']}" in out.splitlines()       # one key=value line a figure
    assert json.loads((tmp_path / "figs" / "gpu_check.json").read_text()) == fig


def test_check_disk_fits_a_bare_machine():
    """The GPU run's folder: model (bf16), two checkpoints (fp32 weights + 8-bit Adam), the bf16
    export, within 40 GiB of a 64 GiB disk (14 layers and no save_total_limit wrote ~65 GiB)."""
    import yaml

    from training.stage1 import gpu_check

    p = gpu_check.qwen2_params(gpu_check.CHECK)
    gib = (2 * p + 2 * 6 * p + 2 * p) / 2 ** 30
    assert gib < 40, gib
    raw = yaml.safe_load(gpu_check.PRODUCTION.read_text())
    raw.update(save_total_limit=2)                          # what check_config writes
    assert gpu_check.STEPS // gpu_check.STOP_AT == raw["save_total_limit"]   # checkpoint-2 kept for verify


def test_verify_fails_when_the_optimizer_did_not_round_trip(tiny_check, tmp_path):
    import shutil

    from training.stage1 import gpu_check

    root, _ = tiny_check
    bad = tmp_path / "bad"
    shutil.copytree(root, bad)
    cfg_text = (bad / "stage1-gpu-check.yaml").read_text().replace(str(root), str(bad))
    (bad / "stage1-gpu-check.yaml").write_text(cfg_text)
    info = json.loads((bad / "run" / "run.json").read_text())
    info["invocations"][1]["optimizer_checksum_restored"][0][1] += 1.0
    (bad / "run" / "run.json").write_text(json.dumps(info))
    with pytest.raises(AssertionError, match="optimizer checksum"):
        gpu_check.verify(bad, require_cuda=False)


def test_verify_refuses_without_cuda(tiny_check, monkeypatch):
    import torch

    from training.stage1 import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # a GPU machine runs it too

    with pytest.raises(SystemExit, match="no CUDA"):
        gpu_check.main(["verify", "--root", str(tiny_check[0])])
