"""The one OpenAI-compatible client (aftraj.llm_client) against local fake servers that misbehave
on purpose: a slow drip under a huge Content-Length, an oversize body (declared and undeclared),
null content, filtered and errored choices, 429 with Retry-After, 5xx, a closed port.

Each case was first run against the clients this module replaced (per-read timeouts, no size
cap, null content read as ""): the drip ran past every bound, the oversize body was read whole,
null content and content_filter came back as an empty answer."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from aftraj.llm_client import ChatClient, ClientConfig, EndpointError, retry_after_s

OK = {"id": "c", "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": "hello"}}],
      "usage": {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}}
# (the fake server's default reply, OK_COMPLETION in tests/conftest.py, is the same object)

@pytest.fixture
def srv(misbehaving_server):
    return misbehaving_server


def client(url, **kw):
    kw = {"deadline_s": 5.0, "retries": 3, "backoff_s": 0.01, "max_backoff_s": 0.05, **kw}
    return ChatClient(ClientConfig(url, **kw))


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_answer_usage_and_reasoning(srv):
    obj = json.loads(json.dumps(OK))
    obj["choices"][0]["message"]["reasoning_content"] = "think"
    obj["choices"][0]["logprobs"] = {"content": [{"token": "he", "logprob": -0.1, "top_logprobs": []}]}
    srv.script = [("json", 200, obj, {})]
    with client(srv.url) as c:
        r = c.complete(BODY)
    assert r.text == "<think>think</think>hello" and r.first.content == "hello"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens) == (10, 2, 8)
    assert r.logprobs[0]["token"] == "he" and r.attempts == 1 and r.finish_reason == "stop"


def test_slow_drip_under_a_huge_content_length_ends_at_the_deadline(srv):
    """Content-Length 10^9, one byte every 0.1 s: every read succeeds, the call must still end."""
    srv.script = [("drip", 10**9, 0.1)]
    with client(srv.url, deadline_s=1.0, max_response_bytes=2 * 10**9) as c:
        t0 = time.monotonic()
        with pytest.raises(EndpointError) as e:
            c.complete(BODY)
        took = time.monotonic() - t0
    assert e.value.kind == "deadline" and "1 s deadline" in str(e.value)
    assert 0.9 < took < 2.0


def test_async_deadline_too(srv):
    srv.script = [("drip", 10**9, 0.1)]
    c = client(srv.url, deadline_s=0.8, max_response_bytes=2 * 10**9)

    async def go():
        try:
            with pytest.raises(EndpointError, match="deadline"):
                await c.acomplete(BODY)
        finally:
            await c.aclose()

    t0 = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - t0 < 1.8


def test_declared_oversize_is_refused_before_reading(srv):
    srv.script = [("drip", 10**9, 0.1)]
    with client(srv.url, max_response_bytes=1 << 20) as c:
        t0 = time.monotonic()
        with pytest.raises(EndpointError) as e:
            c.complete(BODY)
    assert e.value.kind == "oversize" and "1,000,000,000" in str(e.value)
    assert time.monotonic() - t0 < 1.0 and len(srv.requests) == 1     # not retried


def test_undeclared_oversize_is_abandoned_at_the_cap(srv):
    srv.script = [("chunked", 50 * 1024 * 1024)]
    with client(srv.url, max_response_bytes=1 << 20) as c:
        with pytest.raises(EndpointError) as e:
            c.complete(BODY)
    assert e.value.kind == "oversize" and "passed the cap of 1,048,576" in str(e.value)


@pytest.mark.parametrize("choice, kind", [
    ({"message": {"role": "assistant", "content": None}, "finish_reason": "stop"}, "no_content"),
    ({"message": {"role": "assistant"}, "finish_reason": "length"}, "no_content"),
    ({"message": {"role": "assistant", "content": ""}, "finish_reason": "content_filter"}, "content_filter"),
    ({"message": {"role": "assistant", "content": "x"}, "finish_reason": "error"}, "finish_error"),
    ({"message": "text"}, "malformed"),
    ({"message": {"content": 5}}, "malformed"),
])
def test_failed_choices_are_errors_not_answers(srv, choice, kind):
    srv.script = [("json", 200, {"choices": [choice]}, {})]
    with client(srv.url) as c:
        with pytest.raises(EndpointError) as e:
            c.complete(BODY)
    assert e.value.kind == kind


def test_tool_call_only_reply_is_accepted_when_asked(srv):
    msg = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    srv.script = [("json", 200, {"choices": [{"message": msg, "finish_reason": "tool_calls"}]}, {})]
    with client(srv.url) as c:
        r = c.complete(BODY, require_content=False)
    assert r.first.content is None and r.first.message["tool_calls"]


def test_429_waits_for_retry_after(srv):
    srv.script = [("json", 429, {"error": "slow down"}, {"Retry-After": "0.6"}), ("json", 200, OK, {})]
    with client(srv.url) as c:
        r = c.complete(BODY)
        assert c.n_retries == 1
    assert r.text == "hello" and srv.requests[1] - srv.requests[0] >= 0.55


def test_retry_after_past_the_deadline_gives_up_at_once(srv):
    srv.script = [("json", 429, {"error": "slow down"}, {"Retry-After": "30"}), ("json", 200, OK, {})]
    with client(srv.url, deadline_s=2.0) as c:
        t0 = time.monotonic()
        with pytest.raises(EndpointError, match="would pass the 2 s deadline.*429") as e:
            c.complete(BODY)
    assert time.monotonic() - t0 < 0.5 and e.value.status == 429 and len(srv.requests) == 1


@pytest.mark.parametrize("status", [500, 502, 503, 520, 408])
def test_5xx_is_retried_then_answered(srv, status):
    srv.script = [("json", status, {"error": "x"}, {}), ("json", status, {"error": "x"}, {}), ("json", 200, OK, {})]
    with client(srv.url) as c:
        assert c.complete(BODY).text == "hello" and c.n_retries == 2


def test_4xx_is_not_retried_and_retries_run_out(srv):
    srv.script = [("json", 400, {"error": "bad"}, {})]
    with client(srv.url) as c:
        with pytest.raises(EndpointError, match="HTTP 400") as e:
            c.complete(BODY)
        assert e.value.attempts == 1 and c.n_retries == 0
    srv.script = [("json", 503, {"error": "x"}, {})]
    with client(srv.url, retries=2) as c:
        with pytest.raises(EndpointError, match="no answer after 3 attempts.*503"):
            c.complete(BODY)


def test_closed_port_names_the_connection_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with client(f"http://127.0.0.1:{port}/v1", retries=1) as c:
        with pytest.raises(EndpointError, match="connection error: ConnectError") as e:
            c.models()
    assert e.value.kind == "connect"


def test_stalled_attempt_is_retried_inside_the_deadline():
    calls = []

    async def handler(request):
        calls.append(time.monotonic())
        if len(calls) == 1:
            await asyncio.sleep(5)
        return httpx.Response(200, json=OK)

    c = ChatClient(ClientConfig("http://x/v1", deadline_s=3, attempt_timeout_s=0.3, backoff_s=0.01),
                   transport=httpx.MockTransport(handler))
    t0 = time.monotonic()
    assert c.complete(BODY).text == "hello" and c.n_retries == 1
    assert time.monotonic() - t0 < 1.0
    c.close()


def test_retry_after_forms():
    assert retry_after_s("2") == 2.0 and retry_after_s("-1") == 0.0 and retry_after_s("x") is None
    assert retry_after_s(None) is None
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    import email.utils
    assert 9 < retry_after_s(email.utils.formatdate(time.time() + 10, usegmt=True)) <= 10


def test_config_is_validated_and_hides_the_key():
    with pytest.raises(ValueError, match="base_url"):
        ClientConfig("ftp://x")
    with pytest.raises(ValueError, match="deadline_s"):
        ClientConfig("http://x", deadline_s=0)
    assert "sekret" not in repr(ClientConfig("http://x", api_key="sekret"))


def test_credentials_in_the_base_url_never_reach_an_error_message():
    from aftraj.llm_client import redact_url

    assert redact_url("http://svc:hunter2@vllm:8000/v1") == "http://***@vllm:8000/v1"
    assert redact_url("http://vllm:8000/v1") == "http://vllm:8000/v1"

    def down(req):
        raise httpx.ConnectError(f"refused by {req.url} (svc:hunter2@)", request=req)
    c = ChatClient(ClientConfig("http://svc:hunter2@vllm.internal:8000/v1", retries=1, backoff_s=0.01),
                   transport=httpx.MockTransport(down))
    with pytest.raises(EndpointError) as e:
        c.complete(BODY)
    assert "hunter2" not in str(e.value) and "***@vllm.internal" in str(e.value) and e.value.kind == "connect"
    with pytest.raises(ValueError) as e:
        ClientConfig("ftp://u:hunter2@x")
    assert "hunter2" not in str(e.value)
    c.close()


def test_a_compressed_reply_is_refused_not_inflated():
    import gzip
    blob = gzip.compress(json.dumps(OK).encode() + b" " * (4 * 1024 * 1024))   # ~4 MiB inflated, tiny on the wire
    seen = []

    def handler(req):
        seen.append(req.headers.get("accept-encoding"))
        return httpx.Response(200, content=blob, headers={"Content-Encoding": "gzip"})
    c = ChatClient(ClientConfig("http://x/v1", max_response_bytes=1024 * 1024, retries=0),
                   transport=httpx.MockTransport(handler))
    with pytest.raises(EndpointError, match="Content-Encoding 'gzip'") as e:
        c.complete(BODY)
    assert e.value.kind == "malformed" and seen == ["identity"]
    ok = ChatClient(ClientConfig("http://x/v1", retries=0), transport=httpx.MockTransport(
        lambda r: httpx.Response(200, json=OK, headers={"Content-Encoding": "identity"})))
    assert ok.complete(BODY).text == "hello"
    c.close()
    ok.close()


def test_a_reply_nested_past_the_parser_is_malformed_not_a_crash():
    c = ChatClient(ClientConfig("http://x/v1", retries=0),
                   transport=httpx.MockTransport(lambda r: httpx.Response(200, content=b"[" * 100_000)))
    with pytest.raises(EndpointError) as e:
        c.complete(BODY)
    assert e.value.kind == "malformed"
    c.close()
