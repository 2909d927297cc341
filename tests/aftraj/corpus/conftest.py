"""Fixtures for the corpus-builder tests: the sandbox, in both isolation modes, and the real vLLM
server. The demo build they share (`demo_cfg`, `demo_build`) is in tests/conftest.py, so that the
Hub-dataset tests read the same build."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def sandbox():
    from aftraj.corpus.sandbox import Sandbox

    return Sandbox(timeout_s=2.0, memory_mb=1024)


# --------------------------------------------------------------------------- both isolation modes

@functools.cache
def _namespaces_available() -> bool:
    from aftraj.corpus.sandbox import Sandbox

    with Sandbox(timeout_s=2) as sb:
        return sb.isolation == "namespaces"


@pytest.fixture(scope="session")
def namespaces() -> bool:
    """Whether this kernel lets the sandbox use unprivileged user namespaces."""
    return _namespaces_available()


@pytest.fixture(params=["namespaces", "none"])
def isolation(request):
    """Each sandbox test in both isolation modes: the namespaces (where this kernel allows them)
    and the audit-hook fallback ('none')."""
    if request.param == "namespaces" and not _namespaces_available():
        pytest.skip("this kernel refuses unprivileged user namespaces (the fallback is tested as 'none')")
    return request.param


@pytest.fixture(scope="session")
def make_sandbox():
    """`make_sandbox(isolation, timeout_s=3, memory_mb=1024, **kw)`: a Sandbox in that mode."""
    from aftraj.corpus.sandbox import Sandbox

    def make(isolation: str, *, timeout_s: float = 3, memory_mb: int = 1024, **kw) -> Sandbox:
        return Sandbox(timeout_s=timeout_s, memory_mb=memory_mb, isolation=isolation, **kw)

    return make


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
