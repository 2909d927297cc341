"""Fixtures for the corpus-builder tests: one demo build shared by the session, and the
scripted machinery to replay its trajectories independently of the build."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "configs" / "corpus" / "demo-small.yaml"


@pytest.fixture(scope="session")
def demo_cfg():
    from aftraj.corpus.config import load_corpus_config

    return load_corpus_config(DEMO)


@pytest.fixture(scope="session")
def demo_build(demo_cfg, tmp_path_factory):
    """configs/corpus/demo-small.yaml built once (a few seconds)."""
    from aftraj.corpus.build import build_corpus

    out = tmp_path_factory.mktemp("demo-corpus")
    return build_corpus(demo_cfg, out)


@pytest.fixture(scope="session")
def sandbox():
    from aftraj.corpus.sandbox import Sandbox

    return Sandbox(timeout_s=2.0, memory_mb=1024)
