"""The prompt budget's token counter: one rule for stage 1, the `hf` and `openai` auditors and
the gateway — tokens of the text under the served model's tokenizer, no special tokens added.

    from aftraj.tokens import tokenizer_counter
    count = tokenizer_counter("runs/stage1/final")        # a model folder, or a tokenizer object
    render_prompt(traj, t, budget, count_tokens=count)

The budget itself, also one rule (`prompt_budget`): a run's configs give `max_prompt_tokens` (the
templated prompt: system + user turns + generation prompt) and render() gets that less
TEMPLATE_MARGIN. Stage 1, stage 2 and the paper sequence's evaluation call it; the response
budget is stage 2's `max_completion_length`, and prompt + response must fit the server's
`max_model_len` (checked by `scripts/reproduce_paper.sh --dry-run`, training/reproduce.py).
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


TEMPLATE_MARGIN = 32   # tokens the chat template adds around render()'s text (Qwen2: ~20)


def prompt_budget(max_prompt_tokens: int) -> int:
    """The render() budget for prompts that must stay within `max_prompt_tokens` once templated."""
    if not isinstance(max_prompt_tokens, int) or max_prompt_tokens <= TEMPLATE_MARGIN:
        raise ValueError(f"max_prompt_tokens must be an integer > {TEMPLATE_MARGIN}, got {max_prompt_tokens!r}")
    return max_prompt_tokens - TEMPLATE_MARGIN
