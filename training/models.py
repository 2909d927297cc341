"""Model builders: a tiny Qwen2 with a locally trained tokenizer (tests, seconds to build), and
local folders for real models. Nothing here downloads.

    python -c "from training.models import build_tiny_model; build_tiny_model('runs/tiny-qwen2')"
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
