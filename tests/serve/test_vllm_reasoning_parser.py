"""A serve config may name a vLLM reasoning parser only if the model's tokenizer holds the
parser's markers as single vocabulary entries: vLLM builds the parser when the engine starts and
raises otherwise (`vllm/reasoning/basic_parsers.py`, BaseThinkingReasoningParser: `self.vocab.get(
start_token) is None` -> RuntimeError). Qwen2.5-7B-Instruct has no `<think>`/`</think>` tokens;
neither has the tiny Qwen2 tokenizer (same pre-tokenizer), so it stands in for it here.

    pytest tests/serve/test_vllm_reasoning_parser.py -q
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from serve.config import ConfigError, load_serve_config
from serve.vllm import REASONING_PARSER_TOKENS, check_reasoning_parser

REPO = Path(__file__).resolve().parents[2]
H200 = REPO / "configs" / "serve" / "vllm-qwen2.5-7b-h200.yaml"


def test_production_serve_config_starts_on_a_qwen2_tokenizer(tiny_model_dir):
    """The H200 config against a Qwen2-family tokenizer without think tokens: must pass (with
    `reasoning_parser: deepseek_r1` vLLM would die at start-up after all the training)."""
    cfg = dataclasses.replace(load_serve_config(H200), model=str(tiny_model_dir))
    check_reasoning_parser(cfg)


def test_a_parser_whose_tokens_are_missing_is_refused_naming_them(tiny_model_dir):
    cfg = dataclasses.replace(load_serve_config(H200), model=str(tiny_model_dir), reasoning_parser="deepseek_r1")
    with pytest.raises(ConfigError, match=r"reasoning_parser.*deepseek_r1.*<think>") as e:
        check_reasoning_parser(cfg)
    assert str(tiny_model_dir) in str(e.value)


def test_a_parser_whose_tokens_are_single_ids_is_accepted(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<think>", "</think>"], special_tokens=False)
    tok.save_pretrained(tmp_path)
    assert len(tok("<think>", add_special_tokens=False)["input_ids"]) == 1
    cfg = dataclasses.replace(load_serve_config(H200), model=str(tmp_path), reasoning_parser="deepseek_r1")
    check_reasoning_parser(cfg)


def test_an_unknown_parser_is_refused(tiny_model_dir):
    cfg = dataclasses.replace(load_serve_config(H200), model=str(tiny_model_dir), reasoning_parser="my_parser")
    with pytest.raises(ConfigError, match="my_parser"):
        check_reasoning_parser(cfg)
    assert "deepseek_r1" in REASONING_PARSER_TOKENS


def test_serve_vllm_refuses_the_parser_before_starting_vllm(tiny_model_dir, tmp_path, capsys):
    import sys

    from aftraj.cli import main

    cfg = tmp_path / "v.yaml"       # an interpreter that exists: only the parser check can refuse
    cfg.write_text(f"kind: vllm\nprofile: cpu\npython: {sys.executable}\nmodel: {tiny_model_dir}\n"
                   f"reasoning_parser: deepseek_r1\nhealth_timeout_s: 1\n")
    assert main(["serve", "vllm", "--config", str(cfg)]) == 2
    assert "reasoning_parser" in capsys.readouterr().err
