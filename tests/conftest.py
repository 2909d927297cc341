"""Shared fixtures. Tests run on CPU with no network; Who&When is the repository's own copy
(eval/data/who_and_when), read-only."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WHO_AND_WHEN = REPO / "eval" / "data" / "who_and_when"


@pytest.fixture(scope="session")
def ww_dir() -> Path:
    assert WHO_AND_WHEN.is_dir(), f"Who&When is expected at {WHO_AND_WHEN}"
    return WHO_AND_WHEN


@pytest.fixture(scope="session")
def ww_trajs(ww_dir):
    from aftraj.readers import load_trajectories

    return load_trajectories(ww_dir, "whoandwhen")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised tiny Qwen2 + locally trained tokenizer (a few seconds)."""
    from training.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
