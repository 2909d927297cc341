"""Stage 1's production path, in one process (default suite): the preference phase is apart from
the training launch (the launch never samples, sampling never forms a process group, the model
goes to a GPU only for in-process sampling), the FSDP precision policy and the rotary-fp32 check,
gradient sync under FSDP, per-rank optimizer checkpoints (a resume that restores nothing is an
error), the bf16 export. The two-rank FSDP runs are in test_stage1_fsdp.py (`slow`)."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

import training.stage1.preferences as preferences
import training.stage1.trainer as trainer
from aftraj.errors import UsageError
from training.common import fsdp_mixed_precision
from training.stage1.config import load_stage1_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "stage1" / "tiny-cpu.yaml"


def _cfg(tiny_model_dir, corpus, out, **over):
    base = {"model": str(tiny_model_dir), "data": str(corpus), "output_dir": str(out), "samples_per_prompt": 0,
            "per_device_batch_size": 2, "max_steps": 1, "save_steps": 1, "report_to": []}
    return load_stage1_config(TINY, {**base, **over})


def _no_sampling(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("the training launch sampled")
    monkeypatch.setattr(preferences, "make_sampler", boom)
    monkeypatch.setattr(preferences, "build_preferences", boom)


# --------------------------------------------------------------------------- phases

def test_training_launch_never_samples(tiny_model_dir, handmade_corpus, tmp_path, monkeypatch):
    cfg = _cfg(tiny_model_dir, handmade_corpus, tmp_path / "run")
    _no_sampling(monkeypatch)
    with pytest.raises(FileNotFoundError, match="--phase preferences"):
        trainer.train(cfg, phase="train", progress=False)
    monkeypatch.setenv("WORLD_SIZE", "2")          # any multi-process launch, whatever the phase
    with pytest.raises(FileNotFoundError, match="never samples"):
        trainer.train(cfg, phase="all", progress=False)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.undo()
    preferences.sample_preferences(cfg)                # phase 1 ...
    _no_sampling(monkeypatch)
    res = trainer.train(cfg, phase="train", progress=False)   # ... phase 2 reads the cache only
    assert res.last_step == 1 and res.final_dir.is_dir()


def test_preferences_phase_never_forms_a_process_group(tiny_model_dir, handmade_corpus, tmp_path, monkeypatch,
                                                       capsys):
    import accelerate
    import torch.distributed as dist

    from aftraj.cli import main

    def boom(*a, **kw):
        raise AssertionError("the preferences phase formed a process group")
    monkeypatch.setattr(dist, "init_process_group", boom)
    monkeypatch.setattr(accelerate.Accelerator, "__init__", boom)
    out = tmp_path / "prefs"
    args = ["train", "stage1", "--phase", "preferences", "--config", str(TINY), "--out", str(out),
            "--data", str(handmade_corpus), "--model", str(tiny_model_dir), "--set", "samples_per_prompt=2",
            "--set", "sample_max_new_tokens=4", "--set", "report_to=[]"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n_samples"] == 2 * 9
    assert (out / "preferences.jsonl").is_file() and (out / "preference_stats.json").is_file()
    assert not dist.is_initialized()
    assert not list(out.glob("checkpoint-*")) and not (out / "run.json").exists()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="one process"):   # a user error: one line, exit 2
        preferences.sample_preferences(_cfg(tiny_model_dir, handmade_corpus, tmp_path / "other"))


class _FakeModel:
    def __init__(self, moves):
        self.moves = moves

    def to(self, device):
        self.moves.append(str(device))
        return self


class _FakeSampler:
    def sample(self, prompts, k):
        return [["not a verdict"] * k for _ in prompts]


@pytest.mark.parametrize("sampler,loads,moves", [("hf", 1, ["cuda"]), ("openai", 0, [])])
def test_model_is_loaded_and_moved_to_the_gpu_only_for_in_process_sampling(
        sampler, loads, moves, tiny_model_dir, handmade_corpus, tmp_path, monkeypatch):
    loaded, moved, given = [], [], []
    monkeypatch.setattr(preferences, "load_model", lambda cfg, path: loaded.append(path) or _FakeModel(moved))
    monkeypatch.setattr(preferences, "make_sampler", lambda cfg, model, tok: given.append(model) or _FakeSampler())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cfg = _cfg(tiny_model_dir, handmade_corpus, tmp_path / sampler, samples_per_prompt=2, sampler=sampler,
               openai_base_url="http://127.0.0.1:9/v1", openai_model="m")
    stats = preferences.sample_preferences(cfg)
    assert stats["n_samples"] == 2 * 9 and stats["sample_outcomes"]
    assert len(loaded) == loads and moved == moves
    assert (given[0] is None) == (sampler == "openai")


def test_the_process_group_timeout_is_explicit(tiny_model_dir, handmade_corpus, tmp_path, monkeypatch):
    seen = {}
    real = trainer.make_accelerator

    def spy(cfg, out):
        acc = real(cfg, out)
        seen["handlers"] = acc.init_handler
        return acc
    monkeypatch.setattr(trainer, "make_accelerator", spy)
    cfg = _cfg(tiny_model_dir, handmade_corpus, tmp_path / "pg", process_group_timeout_minutes=7)
    trainer.train(cfg, progress=False)
    assert seen["handlers"].timeout.total_seconds() == 7 * 60
    run = json.loads((tmp_path / "pg" / "run.json").read_text())
    assert run["invocations"][-1]["schedule"]["steps"] == 1


# --------------------------------------------------------------------------- precision

def test_fsdp_policy_keeps_reductions_and_buffers_fp32():
    from torch.distributed.fsdp import MixedPrecision

    for mp, param in (("bf16", torch.bfloat16), ("no", torch.float32)):
        cfg = load_stage1_config(TINY, {"mixed_precision": mp})
        assert fsdp_mixed_precision(cfg) == MixedPrecision(
            param_dtype=param, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


def test_rotary_check_fails_on_bf16_buffers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    found = trainer.assert_rotary_fp32(model, "now")
    assert found and all(n.endswith("inv_freq") for n in found)
    for name, buf in model.named_buffers():
        if name.endswith("inv_freq"):
            buf.data = buf.data.to(torch.bfloat16)      # what accelerate's bf16 FSDP policy does
    with pytest.raises(RuntimeError, match="rotary buffers are not float32 now"):
        trainer.assert_rotary_fp32(model, "now")


def test_fsdp_accumulation_never_enters_no_sync():
    from accelerate.utils import DistributedType

    class Acc:
        def __init__(self, kind):
            self.distributed_type = kind

        def no_sync(self, model):
            return "no_sync"
    assert isinstance(trainer._grad_sync(Acc(DistributedType.FSDP), None, last_micro=False), nullcontext)
    assert trainer._grad_sync(Acc(DistributedType.MULTI_GPU), None, last_micro=False) == "no_sync"
    assert isinstance(trainer._grad_sync(Acc(DistributedType.MULTI_GPU), None, last_micro=True), nullcontext)


# --------------------------------------------------------------------------- checkpoints, export

def test_resume_that_restores_nothing_is_an_error(tiny_model_dir, handmade_corpus, tmp_path):
    out = tmp_path / "r"
    cfg = _cfg(tiny_model_dir, handmade_corpus, out, max_steps=2, save_steps=1)
    with pytest.raises(FileNotFoundError, match="restores nothing"):
        trainer.train(cfg, resume=True, progress=False)
    trainer.train(cfg, stop_at_step=1, progress=False)
    state = json.loads((out / "checkpoint-000001" / "trainer_state.json").read_text())
    assert len(state["optimizer_checksum"]) == 1 and state["optimizer_checksum"][0][0] > 0
    opt_file = out / "checkpoint-000001" / "state" / "optimizer_rank0.pt"
    saved = torch.load(opt_file, weights_only=False)
    saved["state_dict"]["state"] = {}                     # an optimizer saved before any step
    saved["checksum"] = [0.0, 0.0, 0.0]
    torch.save(saved, opt_file)
    with pytest.raises(ValueError, match="restore nothing"):
        trainer.train(cfg, resume=True, progress=False)
    opt_file.unlink()
    with pytest.raises(FileNotFoundError, match="no optimizer state for rank 0"):
        trainer.train(cfg, resume=True, progress=False)


def test_optimizer_checksum_detects_a_changed_state():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    assert trainer.optimizer_checksum(opt) == [0.0, 0.0, 0.0]
    p.grad = torch.ones(3)
    opt.step()
    before = trainer.optimizer_checksum(opt)
    assert before[0] == 3 and before != [0.0, 0.0, 0.0]   # step, exp_avg, exp_avg_sq
    opt.state[p]["exp_avg"][0] += 1e-3
    assert trainer.optimizer_checksum(opt) != before


def test_bf16_export_loads(tiny_model_dir, handmade_corpus, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    res = trainer.train(_cfg(tiny_model_dir, handmade_corpus, tmp_path / "x", export_dtype="bfloat16"),
                        progress=False)
    with safe_open(str(res.final_dir / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((res.final_dir / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(res.final_dir, dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for n, b in model.named_buffers() if n.endswith("inv_freq"))


def test_a_second_run_in_one_process_may_change_precision(tmp_path, monkeypatch):
    """accelerate keeps one AcceleratorState per process: without a reset, a bf16 run followed by
    an fp32 one in the same process (warm-up then stage 1, the test suite) raises."""
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_stage1_config(REPO / "configs" / "stage1" / "tiny-cpu.yaml",
                             {"output_dir": str(tmp_path), "mixed_precision": "bf16"})
    trainer.make_accelerator(cfg, tmp_path)
    assert str(AcceleratorState().mixed_precision) == "bf16"
    cfg = load_stage1_config(REPO / "configs" / "stage1" / "tiny-cpu.yaml",
                             {"output_dir": str(tmp_path), "mixed_precision": "no"})
    trainer.make_accelerator(cfg, tmp_path)
    assert str(AcceleratorState().mixed_precision) == "no"
