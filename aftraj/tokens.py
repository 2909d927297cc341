"""The prompt budget's token counter: one rule for stage 1, the `hf` and `openai` auditors and
the gateway — tokens of the text under the served model's tokenizer, no special tokens added.

    from aftraj.tokens import tokenizer_counter
    count = tokenizer_counter("runs/stage1/final")        # a model folder, or a tokenizer object
    render_prompt(traj, t, budget, count_tokens=count)
"""

from __future__ import annotations

from collections.abc import Callable


def tokenizer_counter(tokenizer) -> Callable[[str], int]:
    """`len(tok(text, add_special_tokens=False).input_ids)` for a tokenizer or a model folder."""
    if isinstance(tokenizer, str) or hasattr(tokenizer, "__fspath__"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    tok = tokenizer
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])
