"""Escaping of untrusted trajectory text (DESIGN §3): `escape()` neutralises anything that looks
like one of our tags (`<step`, `<answer` …) or a chat-template special token (`<|im_end|>`,
`<file_sep>`, `<start_of_turn>` …), reversibly, so content can neither close a step nor forge a
verdict. A leaf module: the prompt builder, the released layout, the bounded views and the verdict
formatter all import it, and it imports nothing of aftraj.

    from aftraj.escape import escape, unescape
    assert unescape(escape(text)) == text
"""

from __future__ import annotations

import re

_RESERVED = ("step", "task", "trajectory", "think", "answer", "reference_answer", "summary",
             "coverage", "instruction")
_TAG = r"\s*/?\s*(?:" + "|".join(_RESERVED) + r")(?![\w-])"
# Special and added tokens of other model families that are not of the `<|…|>` form (those, and
# DeepSeek's full-width `<｜…｜>`, are matched by their opening bar). A tokenizer maps such a
# string in step content onto its special id, so its '<' is escaped like ours. A tokenizer whose
# special tokens this misses is reported by `uncovered_special_tokens(tokenizer)`.
FAMILY_MARKERS = (
    # SmolLM2 / StarCoder2 (repository, notebook, issue, commit, fill-in-the-middle markers)
    "repo_name", "reponame", "file_sep", "filename", "gh_stars", "issue_start", "issue_comment",
    "issue_closed", "jupyter_start", "jupyter_text", "jupyter_code", "jupyter_output",
    "jupyter_script", "empty_output", "commit_before", "commit_msg", "commit_after", "fim_prefix",
    "fim_middle", "fim_suffix", "fim_pad", "pr", "pr_status", "pr_is_merged", "pr_base", "pr_file",
    "pr_base_code", "pr_diff", "pr_diff_hunk", "pr_comment", "pr_event_id", "pr_review",
    "pr_review_state", "pr_review_comment", "pr_in_reply_to_review_id",
    "pr_in_reply_to_comment_id", "pr_diff_hunk_comment_line", "code_to_intermediate",
    "intermediate_to_code",
    # Gemma
    "start_of_turn", "end_of_turn", "start_of_image", "end_of_image", "image_soft_token",
    # generic specials (SentencePiece, BERT-likes, multimodal placeholders), Qwen2.5 tool tags, GLM
    "bos", "eos", "pad", "unk", "mask", "sep", "cls", "image", "video", "audio", "tool_call",
    "tool_response", "sop", "eop",
)
_MARKER = r"/?(?:" + "|".join(sorted(FAMILY_MARKERS, key=len, reverse=True)) + r"|extra_id_\d+)>"
# '<' that opens one of our tags, a `<|…|>` or `<｜…｜>` special token, '<s>', a family marker
# ('<file_sep>', '<start_of_turn>') or Llama 2's '<<SYS>>'.
_OPENERS = _TAG + r"|\||\uff5c|/?s>|" + _MARKER + r"|</?SYS>>"
_ESC_LT = re.compile(r"<(?=" + _OPENERS + r")", re.IGNORECASE)
_UNESC_LT = re.compile(r"&lt;(?=" + _OPENERS + r")", re.IGNORECASE)
_ESC_AMP = re.compile(r"&(?=(?:amp;)*lt;)")
_UNESC_AMP = re.compile(r"&amp;(?=(?:amp;)*lt;)")


def escape(text: str) -> str:
    """Neutralise tag and special-token look-alikes: '<step' -> '&lt;step', '<|im_end|>' ->
    '&lt;|im_end|>', '<file_sep>' -> '&lt;file_sep>'; literal '&lt;' -> '&amp;lt;'. Reversible."""
    return _ESC_LT.sub("&lt;", _ESC_AMP.sub("&amp;", text))


def unescape(text: str) -> str:
    return _UNESC_AMP.sub("&", _UNESC_LT.sub("<", text))


def special_token_texts(tokenizer) -> list[str]:
    """Every special or added token string of a Hugging Face tokenizer (what content must not
    spell out)."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        texts.add(getattr(tok, "content", str(tok)))
    return sorted(t for t in texts if t)


def uncovered_special_tokens(tokenizer) -> list[str]:
    """The tokenizer's special/added tokens that `escape` would leave intact in step content
    (empty for Qwen2, SmolLM2, Llama 3, Gemma and DeepSeek tokenizers); check a new model's."""
    return [t for t in special_token_texts(tokenizer) if t in escape(t)]
