"""The gateway with an in-process auditor (`auditor.backend: hf-steps`, issue 44): each event is
one incremental forward on the run's KV cache and its score is the one a fresh reading of the
whole run gives; the ALARM names the step that crossed and its agent; tenants with one run id
never share the auditor's state; the runs it keeps are bounded and ended on eviction; a slow
auditor still answers within the deadline with the fold."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
from fastapi.testclient import TestClient

from aftraj.config import ConfigError
from eval.auditors import get_auditor
from serve.config import ApiKey, AuditorConfig, GatewayConfig, hash_key
from serve.router import build_app
from serve.service import GatewayService

KEY_A, KEY_B = "key-a-secret", "key-b-secret"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
CONTENT = ["read the task: add 17 and 25", "17 + 25 = 42", "check: 42 - 25 = 17, so 42 holds",
           "the answer is 42", "final: 42", "done"]


@pytest.fixture(scope="module")
def steps_model(tiny_model_dir, tmp_path_factory):
    """A step-scored checkpoint folder: the tiny Qwen2 with std 0.3 weights (scores that depend
    on the content) and the reading's bounds, as `aftraj train steps` writes final/."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aftraj.prompt import STEP_DECISIONS, STEP_READING_VERSION, STEP_TAG, step_decision_ids

    out = tmp_path_factory.mktemp("steps-final")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "steps_reading.json").write_text(json.dumps({
        "version": STEP_READING_VERSION, "tag": STEP_TAG, "decision_words": list(STEP_DECISIONS),
        "decision_ids": list(step_decision_ids(tok)), "max_tokens": 4096, "max_step_tokens": 512,
        "keep_tokens": 0, "mixed_precision": "no"}))
    return out


def _cfg(tmp_path, model_dir, **auditor) -> GatewayConfig:
    a = AuditorConfig(backend="hf-steps", deadline_s=auditor.pop("deadline_s", 60.0),
                      max_sessions=auditor.pop("max_sessions", 64),
                      options={"model": str(model_dir), "reason": "none", **auditor})
    return GatewayConfig(ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}",
                         api_keys=(ApiKey("a", hash_key(KEY_A)), ApiKey("b", hash_key(KEY_B))), auditor=a)


def _service(cfg):
    """The gateway as `aftraj serve gateway` builds it: the in-process auditor from the config."""
    from aftraj.commands.serve import build_auditor

    return GatewayService(cfg, auditor=build_auditor(cfg.auditor))


def _post(c, run, i, content, agent="solver", headers=A):
    r = c.post(f"/v1/runs/{run}/events", headers=headers, json={"events": [
        {"event_id": f"{run}/{i}", "seq": i, "kind": "message", "agent": agent, "payload": {"content": content}}]})
    assert r.status_code == 200, r.text
    return r.json()


def _new_run(c, run="r1", headers=A):
    r = c.post("/v1/runs", json={"run_id": run, "task": "add 17 and 25", "agents": ["solver", "checker"],
                                 "category": "math"}, headers=headers)
    assert r.status_code == 201, r.text


def _logit(p: float) -> float:
    return math.log(p) - math.log1p(-p)


def test_every_event_scores_as_a_fresh_reading_of_the_run_and_tenants_do_not_share(tmp_path, steps_model):
    svc = _service(_cfg(tmp_path, steps_model, threshold=1e9))
    with TestClient(build_app(svc)) as c:
        _new_run(c)
        got = [_post(c, "r1", i + 1, text, "solver" if i % 2 == 0 else "checker") for i, text in enumerate(CONTENT)]
        assert all(v["decision"] == "CONTINUE" and v["auditor"] == "ok" for v in got)
        # after the first event each one fed only its own step onto the cache
        assert all(v["cached_tokens"] > 0 for v in got[1:]) and got[0]["cached_tokens"] == 0
        traj = svc.trajectory(svc.runs["a/r1"])
        fresh = get_auditor("hf-steps", model=str(steps_model), reason="none", threshold=1e9)
        want = [fresh.audit(traj, t).decision_log_odds for t in range(len(CONTENT))]
        assert [_logit(v["confidence"]) for v in got] == pytest.approx(want, abs=1e-3)
        assert len({round(x, 3) for x in want}) > 1
        # tenant b, same run id, other words: its own state (a's cache would give a's scores)
        _new_run(c, headers=B)
        vb = _post(c, "r1", 1, "the answer is 7", headers=B)
        tb = svc.trajectory(svc.runs["b/r1"])
        assert _logit(vb["confidence"]) == pytest.approx(fresh.audit(tb, 0).decision_log_odds, abs=1e-3)
        assert vb["cached_tokens"] == 0
        assert set(svc.auditor.sessions) == {"a/r1", "b/r1"}


def test_a_crossing_alarms_naming_the_step_and_its_agent(tmp_path, steps_model):
    (tmp_path / "probe").mkdir()
    probe = _service(_cfg(tmp_path / "probe", steps_model, threshold=1e9))
    with TestClient(build_app(probe)) as c:
        _new_run(c)
        lo = [_logit(_post(c, "r1", i + 1, text, "solver" if i % 2 == 0 else "checker")["confidence"])
              for i, text in enumerate(CONTENT)]
    t = next(t for t in range(1, len(lo)) if lo[t] > max(lo[:t]) + 1e-3)
    thr = (lo[t] + max(lo[:t])) / 2
    svc = _service(_cfg(tmp_path, steps_model, threshold=thr))
    with TestClient(build_app(svc)) as c:
        _new_run(c)
        got = [_post(c, "r1", i + 1, text, "solver" if i % 2 == 0 else "checker") for i, text in enumerate(CONTENT[: t + 1])]
        assert [v["decision"] for v in got] == ["CONTINUE"] * t + ["ALARM"]
        assert (got[-1]["k"], got[-1]["agent"]) == (t, "solver" if t % 2 == 0 else "checker")
        assert "threshold" in got[-1]["reason"]            # reason: none gives the score's line


def test_sessions_are_bounded_and_ended_when_the_gateway_evicts_a_run(tmp_path, steps_model):
    svc = _service(_cfg(tmp_path, steps_model, threshold=1e9, max_sessions=2))
    with TestClient(build_app(svc)) as c:
        for run in ("r1", "r2", "r3"):
            _new_run(c, run)
            _post(c, run, 1, f"step of {run}")
        assert list(svc.auditing.audited) == ["a/r2", "a/r3"] and set(svc.auditor.sessions) == {"a/r2", "a/r3"}
        svc.cache.drop(svc.runs["a/r3"])
        svc.auditing.pool.submit(lambda: None).result(timeout=10)      # the end ran on the auditor's thread
        assert set(svc.auditor.sessions) == {"a/r2"}
        # the evicted run comes back from the ledger and is read again from its first step
        v = _post(c, "r3", 2, "more")
        assert v["auditor"] == "ok" and v["cached_tokens"] == 0 and "a/r3" in svc.auditor.sessions


def test_a_slow_auditor_answers_within_the_deadline_with_the_fold(tmp_path, steps_model):
    svc = _service(_cfg(tmp_path, steps_model, threshold=1e9, deadline_s=0.5))
    release = threading.Event()
    real = svc.auditor.audit
    svc.auditor.audit = lambda traj, t: (release.wait(10), real(traj, t))[1]
    with TestClient(build_app(svc)) as c:
        _new_run(c)
        t0 = time.perf_counter()
        v = _post(c, "r1", 1, "hello")
        assert time.perf_counter() - t0 < 3.0
        assert v["auditor"] == "unavailable" and "deadline" in v["auditor_error"] and v["action"] == "warn"
        release.set()


def test_config_names_what_is_wrong(tmp_path, steps_model):
    from aftraj.commands.serve import build_auditor

    with pytest.raises(ConfigError, match="backend"):
        AuditorConfig(backend="No Such Auditor")
    with pytest.raises(ConfigError, match="auditor.backend"):        # checked where the gateway is built
        build_auditor(AuditorConfig(backend="no-such-auditor"))
    with pytest.raises(ConfigError, match="auditor.options"):
        build_auditor(AuditorConfig(backend="hf-steps", options={"model": str(tmp_path / "missing")}))
    with pytest.raises(ConfigError, match="auditor.backend"):        # the service needs the built auditor
        GatewayService(_cfg(tmp_path, steps_model))
    with pytest.raises(ConfigError, match="options"):
        AuditorConfig(backend="openai", base_url="http://x/v1", model="m", options={"model": "x"})
    with pytest.raises(ConfigError, match="options"):
        AuditorConfig(backend="hf-steps", options={"not an identifier": 1})
    with pytest.raises(ConfigError, match="max_sessions"):
        AuditorConfig(backend="hf-steps", max_sessions=0)


def test_the_shipped_steps_gateway_config_validates():
    from pathlib import Path

    from serve.config import load_serve_config

    cfg = load_serve_config(Path(__file__).resolve().parents[2] / "configs/serve/gateway-steps.yaml")
    assert cfg.auditor.backend == "hf-steps" and cfg.auditor.options["model"] == "runs/steps-smollm2/final"
