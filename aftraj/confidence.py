"""P(UNSAFE) from the log-probabilities of the verdict token (DESIGN §3, "Confidence").

The verdict value is the first token after `<answer>{"answer":`: a quote opens "SAFE", a digit
opens a step number (UNSAFE). Given the chosen token pieces of a completion and, per position,
the top alternatives with their log-probabilities (what vLLM/OpenAI return with `top_logprobs`,
or the `hf` backend's top-k), the confidence is the probability mass on digit-led alternatives
over the mass on quote- and digit-led ones at that position. Whitespace-only tokens before the
value are skipped. None when the completion never reaches the verdict value.

    p = p_unsafe(['<answer>', '{"', 'answer', '":', ' "', 'SAFE'], [..., {' "': -0.1, ' 3': -2.4}, ...])
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence

_ROUNDING = 1e-3        # a log-prob a little above 0 is rounding; more is no log-prob
_BEFORE_VALUE = re.compile(r'<answer>\s*\{\s*"answer"\s*:\s*\Z')


def verdict_position(pieces: Sequence[str]) -> int | None:
    """Index of the token that starts the verdict value, or None."""
    text = ""
    for i, piece in enumerate(pieces):
        if piece.strip() and _BEFORE_VALUE.search(text):
            return i
        text += piece
    return None


def p_unsafe_at(top: Mapping[str, float] | Iterable[tuple[str, float]]) -> float | None:
    """P(UNSAFE) from the alternatives (text -> log-prob) at the verdict position; None if
    neither a quote- nor a digit-led alternative is among them. A value that is no log-prob (not
    a number, not finite, above 0 beyond rounding) is skipped: an odd endpoint never raises."""
    safe = unsafe = 0.0
    for cand, lp in (top.items() if isinstance(top, Mapping) else top):
        s = cand.lstrip() if isinstance(cand, str) else ""
        if (not s or type(lp) not in (int, float) or not math.isfinite(lp) or lp > _ROUNDING):
            continue
        lp = min(lp, 0.0)
        if s[0] == '"':
            safe += math.exp(lp)
        elif s[0].isdigit():
            unsafe += math.exp(lp)
    if safe + unsafe == 0.0:
        return None
    return min(1.0, max(0.0, unsafe / (safe + unsafe)))


def p_unsafe(pieces: Sequence[str], tops: Sequence[Mapping[str, float]]) -> float | None:
    i = verdict_position(pieces)
    return None if i is None or i >= len(tops) else p_unsafe_at(tops[i])


def p_unsafe_from_logprobs(content: Sequence[Mapping] | None) -> float | None:
    """P(UNSAFE) from an OpenAI-style `choices[0].logprobs.content` list (each entry: token,
    logprob, top_logprobs); None without log-probabilities. Used by the `openai` auditor and
    the gateway."""
    if not content:
        return None
    pieces = [str(c.get("token", "")) for c in content]
    tops = [{str(x.get("token", "")): x.get("logprob") for x in (c.get("top_logprobs") or [])
             if isinstance(x, Mapping)} or {str(c.get("token", "")): c.get("logprob")} for c in content]
    return p_unsafe(pieces, tops)
