"""Tokens: the one prompt-budget rule and the one chat-template tokenisation, for stage 1, stage
2, the warm-up, the `hf` and `openai` auditors, the probe and the gateway.

Counting (`count_tokens`, `tokenizer_counter`): tokens of a text under the served model's
tokenizer, no special tokens added. render()'s budget is counted this way, segment by segment
(`approx_tokens`, about 3 characters a token, where no tokenizer is given). A floor module: it
imports nothing of aftraj but `aftraj.errors`.

The budget (`prompt_budget`): a config's `max_prompt_tokens` bounds the *templated* prompt
(system + user turns + the opened generation prompt, what the model reads); render() gets that
less `TEMPLATE_MARGIN`, the room left for the chat template's own tokens (measured with
`template_overhead`: 14 for SmolLM2, 19 for Qwen2's ChatML and the tiny test tokenizer) and for
tokens that segments counted apart gain when joined. Given a tokenizer, `prompt_budget` checks
that its template fits the margin. The hf auditor without `--budget` calls it with the model's
context less `max_new_tokens`. The response budget is stage 2's `max_completion_length`; prompt
+ response must fit the server's `max_model_len` (`scripts/reproduce_paper.sh --dry-run`).

The ids (`chat_prompt_ids`): the chat template rendered to text with the generation prompt
opened (`chat_prompt_text`), then tokenised with no special tokens added: what vLLM's chat
endpoint does, what `apply_chat_template(..., tokenize=True)` gives (tests/test_prompt_budget.py
checks both), and what the hf auditor needs (it locates the stable part in the text).
Completions (`completion_ids`) are tokenised on their own and closed with the EOS token.

    from aftraj.tokens import chat_prompt_ids, prompt_budget, tokenizer_counter
    count = tokenizer_counter("runs/stage1/final")        # a model folder, or a tokenizer object
    msgs = render(traj, t, prompt_budget(8192, tok), count_tokens=count)
    ids = chat_prompt_ids(tok, msgs)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from aftraj.errors import UsageError


class PromptBudgetError(UsageError):
    """The prefix does not fit the budget and no bounded view could make it fit (a UsageError,
    hence a ValueError: the budget is the user's setting)."""


def approx_tokens(text: str) -> int:
    """A cheap, conservative token estimate (about 3 characters a token for English and code)."""
    return len(text) // 3 + 1


TEMPLATE_MARGIN = 32   # tokens the chat template adds around render()'s text (Qwen2: 19, SmolLM2: 14)


def _tokenizer(tokenizer):
    if isinstance(tokenizer, str) or hasattr(tokenizer, "__fspath__"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text`, no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of `text` under `tokenizer`, no special tokens added (the budget's counter)."""
    return len(text_ids(tokenizer, text))


def tokenizer_counter(tokenizer) -> Callable[[str], int]:
    """`count_tokens` bound to a tokenizer or a model folder (render()'s `count_tokens`)."""
    tok = _tokenizer(tokenizer)
    return lambda text: count_tokens(tok, text)


def chat_prompt_text(tokenizer, messages: Sequence[dict]) -> str:
    """The chat template's text of `messages` with the generation prompt opened."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


def chat_prompt_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of the templated prompt exactly as the auditor reads it at inference."""
    return text_ids(tokenizer, chat_prompt_text(tokenizer, messages))


def completion_ids(tokenizer, text: str, max_tokens: int | None = None) -> tuple[list[int], bool]:
    """(ids of `text` closed with the EOS token, cut?): at most `max_tokens` ids."""
    ids = text_ids(tokenizer, text) + [tokenizer.eos_token_id]
    if max_tokens is not None and len(ids) > max_tokens:
        return ids[:max_tokens], True
    return ids, False


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (None when one is a prefix of the other):
    for a SAFE and an ALARM completion of one prompt, the decision token."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def template_overhead(tokenizer) -> int:
    """Tokens the chat template adds around an empty system and user turn, generation prompt opened."""
    return len(chat_prompt_ids(tokenizer, [{"role": "system", "content": ""}, {"role": "user", "content": ""}]))


def prompt_budget(max_prompt_tokens: int, tokenizer=None) -> int:
    """The render() budget for prompts that must stay within `max_prompt_tokens` once templated:
    `max_prompt_tokens - TEMPLATE_MARGIN`. With `tokenizer`, its template must fit the margin."""
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) \
            or max_prompt_tokens <= TEMPLATE_MARGIN:
        raise ValueError(f"max_prompt_tokens must be an integer > {TEMPLATE_MARGIN}, got {max_prompt_tokens!r}")
    if tokenizer is not None:
        over = template_overhead(tokenizer)
        if over > TEMPLATE_MARGIN:
            raise PromptBudgetError(f"the chat template of {getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} "
                                    f"adds {over} tokens, over aftraj.tokens.TEMPLATE_MARGIN={TEMPLATE_MARGIN}: "
                                    f"templated prompts could pass max_prompt_tokens")
    return max_prompt_tokens - TEMPLATE_MARGIN


def check_prompt_length(ids: Sequence[int], max_prompt_tokens: int, what: str) -> None:
    """Raise ValueError when a templated prompt (`what` names it) is over `max_prompt_tokens`: the
    margin did not hold (render() was given `prompt_budget(max_prompt_tokens)`)."""
    if len(ids) > max_prompt_tokens:
        raise ValueError(f"{what} is {len(ids)} tokens, over max_prompt_tokens={max_prompt_tokens} "
                         f"after the chat template")
