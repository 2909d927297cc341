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
    """configs/corpus/demo-small.yaml built once (a few seconds), with the content-blind floors
    that `aftraj corpus build` passes (stats.json's floors_on_test)."""
    from aftraj.corpus.build import build_corpus
    from eval.auditors.floors import floor_scores

    out = tmp_path_factory.mktemp("demo-corpus")
    return build_corpus(demo_cfg, out, floors=floor_scores)


@pytest.fixture(scope="session")
def sandbox():
    from aftraj.corpus.sandbox import Sandbox

    return Sandbox(timeout_s=2.0, memory_mb=1024)


# The real vLLM CPU server fixture is owned by the evaluation tests (tests/eval/conftest.py);
# reuse it here rather than starting vLLM a second way. Marker `vllm` only.
def _load_eval_conftest():
    import importlib.util

    path = REPO / "tests" / "eval" / "conftest.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_corpus_eval_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_EVAL = _load_eval_conftest()
if _EVAL is not None and hasattr(_EVAL, "vllm_server"):
    vllm_server = _EVAL.vllm_server
else:
    @pytest.fixture(scope="session")
    def vllm_server():
        pytest.fail("tests/eval/conftest.py provides no vllm_server fixture")
