"""The `openai` policy and judge end to end against a real vLLM CPU server serving a random
tiny model (marker `vllm`; the fixture lives in tests/eval/conftest.py):

    VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python -m pytest -m vllm tests/aftraj/corpus
    bash scripts/test_vllm.sh tests/aftraj/corpus      # creates .venv-vllm first if needed

A tiny random model writes nonsense: every rollout fails or is cut, tool calls are malformed;
the pipeline must record reasons and never crash."""

from __future__ import annotations

import pytest

from aftraj.corpus.build import build_corpus
from aftraj.corpus.config import EndpointConfig, config_from_dict
from aftraj.corpus.diagnose import OpenAIJudge, diagnose
from aftraj.corpus.policies import OpenAIPolicy
from aftraj.corpus.rollout import run_rollout
from aftraj.corpus.tasks import generate_tasks
from aftraj.corpus.templates import TEMPLATES
from aftraj.schema import Label, Trajectory

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("domain", list(TEMPLATES))
def test_one_rollout_per_template_on_vllm(domain, vllm_server, sandbox):
    url, name, _ = vllm_server
    ep = EndpointConfig(backend="openai", model=name, base_url=url, max_tokens=48, timeout_s=120, retries=1)
    tpl, task = TEMPLATES[domain], generate_tasks(domain, 1, 0)[0]
    policy = OpenAIPolicy(ep)
    r = run_rollout(tpl, task, policy, seed=0, sandbox=sandbox, max_steps=8)
    print(f"\n[{domain}] termination={r.termination} steps={len(r.turns)} calls={policy.chat.n_calls} "
          f"check={r.check_reason[:80]!r} notes={r.notes[:3]} first_reply={r.turns[1].content[:80]!r}")
    assert r.model == name and r.backend == "openai" and len(r.turns) >= 2
    assert r.termination != "cancelled", r.notes   # the server answered every call
    steps = [t.to_step(i, "x") for i, t in enumerate(r.turns)]
    Trajectory(id="x", family_id="f", domain=domain, source="t", task="q", steps=steps,
               label=Label("SAFE", "verified_safe"))
    assert policy.chat.n_calls >= 1 and r.check_reason
    if not r.success:
        d = diagnose(tpl, task, policy, r, OpenAIJudge(ep), seed=0, sandbox=sandbox, max_steps=8)
        assert d.reason   # accepted or not, with a recorded reason


def test_build_with_vllm_policy_and_judge(vllm_server, tmp_path):
    url, name, _ = vllm_server
    ep = {"backend": "openai", "model": name, "base_url": url, "max_tokens": 48, "timeout_s": 120, "retries": 1}
    cfg = config_from_dict({"name": "vllm-tiny", "max_steps": 8, "tasks": {"math": 1, "coding": 1, "agentic": 1},
                            "policy": ep, "judge": ep})
    res = build_corpus(cfg, tmp_path / "out")
    print(f"\n[build] rejections={[(x['task'], x['predicate'], x['reason'][:60]) for x in res.records['rejections']]} "
          f"diagnoses={[(d['accepted'], d['reason'][:80]) for d in res.records['diagnoses']]}")
    assert len(res.records["rejections"]) + res.stats["total"]["trajectories"] >= 3
    assert all(x["reason"] for x in res.records["rejections"])
    assert (tmp_path / "out" / "stats.md").is_file()
