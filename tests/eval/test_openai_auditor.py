"""The `openai` backend over real HTTP against a fake OpenAI-compatible server on 127.0.0.1
(retries, timeouts, concurrency, usage with cached tokens, logprob confidence, methods)."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from eval.auditors import get_auditor
from eval.auditors.openai import AuditorError
from eval.metrics import summarize
from eval.walker import WalkConfig, walk


@pytest.fixture
def corpus(make_traj):
    return [make_traj(i, n, k) for i, (n, k) in enumerate([(6, 3), (5, None), (8, 0), (7, 6), (4, None)])]


def auditor(fake, spec="openai", **kw):
    kw = {"endpoint": fake.url, "concurrency": 4, "timeout": 5.0, "retries": 3, "backoff": 0.01, **kw}
    return get_auditor(spec, **kw)


def test_walk_through_http(fake_openai, corpus):
    fake_openai.delay_s = 0.01                        # calls take a while: they must overlap
    with auditor(fake_openai) as aud:
        assert aud.api_model == "fake-auditor"       # discovered from GET /models
        preds = walk(aud, corpus, WalkConfig(max_in_flight=8), progress=False)
    for p, t in zip(preds, corpus, strict=True):
        if t.label.unsafe:
            k = t.label.decisive_step
            assert p["alarmed"] and p["d"] == k and p["k_hat"] == k and p["a_hat"] == t.label.decisive_agent
            assert p["confidence"] == pytest.approx(1 / (1 + math.exp(-2.3)), rel=1e-6)
        else:
            assert not p["alarmed"] and p["calls"] == len(t.steps)
        assert p["prompt_tokens"] > 0 and p["completion_tokens"] > 0
    # the prompt layout is prefix-stable: most prompt tokens after the first call were cached
    m = summarize(preds, n_boot=0)
    assert m["cached_prompt_fraction"] > 0.5 and m["exact_f1"] == 1.0 and m["far"] == 0.0
    body = fake_openai.bodies[0]
    assert body["logprobs"] is True and body["top_logprobs"] == 20 and body["temperature"] == 0.0
    assert body["messages"][0]["role"] == "system" and "<trajectory>" in body["messages"][1]["content"]
    assert fake_openai.max_in_flight > 1                # calls overlapped across trajectories


def test_reasoning_parser_split_is_reassembled(fake_openai, corpus):
    """vLLM with --reasoning-parser returns <think> text as reasoning_content: still parsed."""
    fake_openai.reasoning_split = True
    with auditor(fake_openai) as aud:
        preds = walk(aud, corpus, WalkConfig(max_in_flight=4), progress=False)
    m = summarize(preds, n_boot=0)
    assert m["parse_failure_rate"] == 0.0 and m["exact_f1"] == 1.0


def test_concurrency_limit(fake_openai, corpus):
    fake_openai.delay_s = 0.05
    with auditor(fake_openai, concurrency=2) as aud:
        walk(aud, corpus, WalkConfig(max_in_flight=8), progress=False)
    assert fake_openai.max_in_flight == 2


def test_retries_on_503_then_success(fake_openai, corpus):
    with auditor(fake_openai) as aud:
        fake_openai.fail_next = 2
        r = aud.audit(corpus[0], 3)
        assert r.alarm and aud.n_retries == 2


def test_timeout_is_retried(fake_openai, corpus):
    fake_openai.stall_next, fake_openai.stall_s = 1, 1.5
    with auditor(fake_openai, timeout=5.0, attempt_timeout=0.5) as aud:
        t0 = time.perf_counter()
        r = aud.audit(corpus[1], 2)
        assert not r.alarm and aud.n_retries == 1
        assert time.perf_counter() - t0 < 1.4  # the stalled call was abandoned at the timeout


def test_gives_up_with_an_error_result_never_a_verdict(fake_openai, corpus):
    with auditor(fake_openai, retries=1) as aud:
        fake_openai.fail_next = 5
        r = aud.audit(corpus[0], 0)
        assert r.verdict is None and not r.alarm and not r.parse_failed
        assert r.error_kind == "http" and "no answer after 2 attempts" in r.error and "503" in r.error
        fake_openai.fail_next = 0
        fake_openai.status_next = 400
        r = aud.audit(corpus[0], 0)
        assert r.verdict is None and "HTTP 400" in r.error


MODELS = ("json", 200, {"object": "list", "data": [{"id": "m"}]}, {})


@pytest.mark.parametrize("choice, kind", [
    ({"message": {"role": "assistant", "content": None}, "finish_reason": "stop"}, "no_content"),
    ({"message": {"role": "assistant", "content": ""}, "finish_reason": "content_filter"}, "content_filter"),
    ({"message": {"role": "assistant", "content": "x"}, "finish_reason": "error"}, "finish_error"),
])
def test_failed_choices_are_errors_not_parse_failures(misbehaving_server, corpus, choice, kind):
    """Before the one client, these became the parse failure 'empty', i.e. a silent CONTINUE."""
    misbehaving_server.script = [MODELS, ("json", 200, {"choices": [choice]}, {})]
    with get_auditor("openai", endpoint=misbehaving_server.url, timeout=5, retries=0) as aud:
        r = aud.audit(corpus[0], 1)
    assert r.verdict is None and r.error_kind == kind and not r.parse_failed


def test_slow_drip_ends_at_the_deadline(misbehaving_server, corpus):
    """Content-Length 10^9 and a byte every 0.2 s: every read succeeds, yet the call must end
    (before the one client this stalled `aftraj eval` forever)."""
    misbehaving_server.script = [MODELS, ("drip", 10**9, 0.2)]
    with get_auditor("openai", endpoint=misbehaving_server.url, timeout=1.0, retries=0,
                     max_response_bytes=2 * 10**9) as aud:
        t0 = time.perf_counter()
        r = aud.audit(corpus[0], 1)
        assert time.perf_counter() - t0 < 2.0
    assert r.error_kind == "deadline"


def test_oversize_reply_is_an_error(misbehaving_server, corpus):
    misbehaving_server.script = [MODELS, ("chunked", 8 << 20)]
    with get_auditor("openai", endpoint=misbehaving_server.url, timeout=5, retries=0,
                     max_response_bytes=1 << 20) as aud:
        r = aud.audit(corpus[0], 1)
    assert r.error_kind == "oversize"


def test_unreachable_endpoint():
    with pytest.raises(AuditorError, match="no answer"):
        get_auditor("openai", endpoint="http://127.0.0.1:9/v1", retries=0, timeout=1.0)


def test_methods(fake_openai, corpus, make_traj):
    with auditor(fake_openai, spec="openai:all-at-once") as aud:
        assert aud.posthoc and "post-hoc" in aud.label
        preds = walk(aud, corpus, progress=False)
        assert all(p["calls"] == 1 for p in preds)
    with auditor(fake_openai, spec="openai:binary-search") as aud:
        preds = walk(aud, corpus, progress=False)
        for p, t in zip(preds, corpus, strict=True):
            assert p["calls"] <= 4
            assert p["d"] == t.label.decisive_step
    with auditor(fake_openai, reference_answer=True) as aud:
        traj = dataclasses.replace(make_traj(9, 3, None), reference_answer="42")
        aud.audit(traj, 0)
        assert "<reference_answer>\n42\n</reference_answer>" in fake_openai.bodies[-1]["messages"][1]["content"]
    with pytest.raises(ValueError, match="method must be one of"):
        get_auditor("openai:majority", endpoint=fake_openai.url)
    with pytest.raises(ValueError, match="needs --endpoint"):
        get_auditor("openai")


def test_async_walk_matches_round_by_round(fake_openai, corpus):
    """The `submit` path (a call per live walk always in flight) gives the same records as the
    round-by-round `audit_batch` path."""
    fake_openai.delay_s = 0.01
    with auditor(fake_openai) as aud:
        a = walk(aud, corpus, WalkConfig(max_in_flight=3), progress=False)
    with auditor(fake_openai) as aud:
        aud.submit = None                      # force the batch path
        b = walk(aud, corpus, WalkConfig(max_in_flight=3), progress=False)
    keys = ("id", "alarmed", "d", "k_hat", "a_hat", "calls", "parse_failures", "trace")
    strip = [{k: p[k] for k in keys if k != "trace"} | {"ts": [e["t"] for e in p["trace"]]} for p in a]
    assert strip == [{k: p[k] for k in keys if k != "trace"} | {"ts": [e["t"] for e in p["trace"]]}
                     for p in b]


@pytest.mark.parametrize("status", [408, 429, 500, 520])
def test_retryable_statuses_are_retried(fake_openai, corpus, status):
    """The module docstring's promise: 408/409/429 and 5xx are retried (proxies answer 520-529)."""
    with auditor(fake_openai) as aud:
        fake_openai.status_next = status
        r = aud.audit(corpus[0], 3)
        assert r.alarm and aud.n_retries == 1
