"""The one OpenAI-compatible client: every caller of a chat endpoint goes through it.

Callers: the corpus policies and judge (`aftraj.corpus.policies`, `aftraj.corpus.diagnose`),
the `openai` auditor (`eval.auditors.openai`), the stage-1 sampler
(`training.stage1.preferences.OpenAISampler`) and the gateway (`serve.service`).

    from aftraj.llm_client import ChatClient, ClientConfig
    client = ChatClient(ClientConfig("http://127.0.0.1:8000/v1", deadline_s=30))
    c = client.complete({"model": "auditor", "messages": msgs, "max_tokens": 512})   # sync
    c = await client.acomplete({...})                                                 # async
    c.text, c.finish_reason, c.usage.cached_tokens, c.logprobs, c.reasoning

What a call promises:
- **A total deadline** (`deadline_s`) over the whole call: connecting, sending, the headers, the
  body, every retry and every back-off sleep. It is enforced by cancelling the call
  (`asyncio.timeout`), not by per-read timeouts: a server that sends `Content-Length: 10^9`
  and one byte a second is abandoned at the deadline (`EndpointError(kind="deadline")`).
- **A response-size cap** (`max_response_bytes`): a declared `Content-Length` over the cap is
  refused before the body is read, and a body is streamed and abandoned as soon as it passes
  the cap (`kind="oversize"`): memory stays bounded whatever the server sends. The client asks
  for `Accept-Encoding: identity` and refuses any other `Content-Encoding` (`kind="malformed"`):
  a compressed body is never inflated. Error messages name the URL without its credentials.
- **Retries** on connection errors, 408/409/429 and every 5xx, with full-jitter exponential
  back-off (`backoff_s * 2**attempt`, capped at `max_backoff_s`, times a uniform [0.5, 1)) and
  the server's `Retry-After` (seconds or an HTTP date) as a floor; a wait that would pass the
  deadline is not started (the last error is raised at once). Other 4xx, malformed replies,
  oversize replies and the deadline are not retried.
- **Endpoint failures are errors, never answers**: `finish_reason` "content_filter" or "error",
  or a choice with no content (null or missing, and no tool calls) raise `EndpointError`
  (`kind` "content_filter", "finish_error", "no_content"); callers count them as errors, never
  as a verdict or a turn. `require_content=False` lets a caller accept a tool-call-only reply.
- **Usage** with cached prompt tokens (`prompt_tokens_details.cached_tokens`; vLLM needs
  `--enable-prompt-tokens-details`), the first choice's token **logprobs** (`top_logprobs`),
  and **reasoning_content** (a vLLM reasoning parser moves `<think>` text there; `Completion.text`
  puts it back in front so the strict verdict parser sees the trained format).

Why httpx and not the `openai` package: httpx is already a core dependency (the `openai`
package would add one more, plus pydantic models for every reply), its streaming API lets us
cap the body while it arrives (the `openai` package reads the whole body before handing it
over), and its async client runs under `asyncio.timeout`, which gives the total deadline the
`openai` package lacks (its `timeout` is httpx's per-phase timeout; its retries read
`Retry-After` but not our deadline). The same code serves sync callers: `complete()` runs
`acomplete()` on a private event-loop thread, so there is one implementation of every rule.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

RETRY_STATUS = frozenset({408, 409, 429})   # and every 5xx (proxies answer 520-529 too)
ERROR_KINDS = ("connect", "timeout", "deadline", "oversize", "http", "malformed", "no_content",
               "content_filter", "finish_error")
FAILED_FINISH = {"content_filter": "content_filter", "error": "finish_error"}


class EndpointError(RuntimeError):
    """The endpoint gave no usable answer. `kind` is one of ERROR_KINDS; `status` the last HTTP
    status (None when there was none); `attempts` how many requests were sent."""

    def __init__(self, message: str, *, kind: str, status: int | None = None, attempts: int = 0):
        assert kind in ERROR_KINDS, kind
        super().__init__(message)
        self.kind, self.status, self.attempts = kind, status, attempts


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to call. `api_key` is never printed (repr hides it)."""

    base_url: str
    api_key: str | None = field(default=None, repr=False)
    deadline_s: float = 120.0          # total per call, retries and back-off included
    attempt_timeout_s: float | None = None  # one request; a stalled attempt is retried (inside the deadline)
    retries: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_response_bytes: int = 32 * 1024 * 1024
    max_connections: int = 64

    def __post_init__(self) -> None:
        if not (isinstance(self.base_url, str) and self.base_url.startswith(("http://", "https://"))):
            raise ValueError(f"base_url must be an http(s) URL, got "
                             f"{redact_url(self.base_url) if isinstance(self.base_url, str) else self.base_url!r}")
        for name in ("deadline_s", "max_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.attempt_timeout_s is not None and not self.attempt_timeout_s > 0:
            raise ValueError(f"attempt_timeout_s must be > 0 or None, got {self.attempt_timeout_s!r}")
        if self.backoff_s < 0 or self.retries < 0:
            raise ValueError("backoff_s and retries must be >= 0")
        if self.max_response_bytes < 1024 or self.max_connections < 1:
            raise ValueError("max_response_bytes must be >= 1024 and max_connections >= 1")

    @classmethod
    def from_env(cls, base_url: str, api_key_env: str | None, **kw) -> ClientConfig:
        """The key from an environment variable (unset or empty: no key)."""
        key = os.environ.get(api_key_env) if api_key_env else None
        return cls(base_url, api_key=key or None, **kw)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0        # prompt tokens served from the prefix cache

    @classmethod
    def from_reply(cls, u: Any) -> Usage:
        if not isinstance(u, dict):
            return cls()
        details = u.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(_int(u.get("prompt_tokens")), _int(u.get("completion_tokens")), _int(cached))


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


@dataclass(frozen=True)
class Choice:
    content: str | None
    reasoning: str | None
    finish_reason: str | None
    message: dict                  # the raw message (tool_calls, role, …)
    logprobs: list[dict] | None    # [{"token", "logprob", "top_logprobs": [...]}, …]

    @property
    def text(self) -> str:
        """The content with the reasoning put back in front as `<think>…</think>`."""
        text = self.content or ""
        if self.reasoning and "<think>" not in text:
            return f"<think>{self.reasoning}</think>{text}"
        return text


@dataclass(frozen=True)
class Completion:
    choices: list[Choice]
    usage: Usage
    model: str | None
    latency_s: float
    attempts: int
    raw: dict = field(repr=False, default_factory=dict)

    @property
    def first(self) -> Choice:
        return self.choices[0]

    @property
    def text(self) -> str:
        return self.first.text

    @property
    def finish_reason(self) -> str | None:
        return self.first.finish_reason

    @property
    def logprobs(self) -> list[dict] | None:
        return self.first.logprobs

    @property
    def reasoning(self) -> str | None:
        return self.first.reasoning


def parse_completion(data: Any, *, require_content: bool = True, where: str = "",
                     latency_s: float = 0.0, attempts: int = 1) -> Completion:
    """A chat-completion reply -> Completion, or EndpointError (malformed / failed choice)."""
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or not data["choices"]:
        raise EndpointError(f"{where}: malformed chat completion (no choices): {str(data)[:300]}",
                            kind="malformed", attempts=attempts)
    choices = []
    for i, c in enumerate(data["choices"]):
        msg = c.get("message") if isinstance(c, dict) else None
        if not isinstance(msg, dict):
            raise EndpointError(f"{where}: malformed chat completion: choice {i} has no message object",
                                kind="malformed", attempts=attempts)
        finish = c.get("finish_reason")
        if finish in FAILED_FINISH:
            raise EndpointError(f"{where}: choice {i} ended with finish_reason {finish!r}",
                                kind=FAILED_FINISH[finish], attempts=attempts)
        content = msg.get("content")
        if content is not None and not isinstance(content, str):
            raise EndpointError(f"{where}: choice {i}: content is {type(content).__name__}, not a string",
                                kind="malformed", attempts=attempts)
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        reasoning = reasoning if isinstance(reasoning, str) else None
        if require_content and content is None and not msg.get("tool_calls"):
            raise EndpointError(f"{where}: choice {i} has no content (content is null, "
                                f"finish_reason {finish!r})", kind="no_content", attempts=attempts)
        lp = c.get("logprobs")
        lp = lp.get("content") if isinstance(lp, dict) else None
        lp = [x for x in lp if isinstance(x, dict)] if isinstance(lp, list) else None
        choices.append(Choice(content, reasoning, finish if isinstance(finish, str) else None, msg, lp))
    model = data.get("model") if isinstance(data.get("model"), str) else None
    return Completion(choices, Usage.from_reply(data.get("usage")), model, latency_s, attempts, data)


def _userinfo(url: str) -> str:
    from urllib.parse import urlsplit

    netloc = urlsplit(url).netloc
    return netloc.rsplit("@", 1)[0] + "@" if "@" in netloc else ""


def redact_url(url: str) -> str:
    """`url` without its userinfo (`http://user:secret@host/v1` -> `http://***@host/v1`): the
    form every error message names."""
    info = _userinfo(url)
    return url.replace(info, "***@", 1) if info else url


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """`Retry-After` as seconds: a number, or an HTTP date (RFC 9110); None when absent/invalid."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class _Retry(Exception):
    def __init__(self, err: EndpointError, floor_s: float | None = None):
        self.err, self.floor_s = err, floor_s


class ChatClient:
    """Sync and async calls to one OpenAI-compatible base URL (see the module docstring).

    `transport`: an httpx async transport (tests pass `httpx.MockTransport`)."""

    def __init__(self, cfg: ClientConfig, *, transport=None, rng: random.Random | None = None):
        self.cfg = cfg
        self.base_url = cfg.base_url.rstrip("/")
        self.shown_url = redact_url(self.base_url)    # what error messages name: no credentials
        self._userinfo = _userinfo(self.base_url)
        self._transport = transport
        self._rng = rng or random.Random()
        self._clients: dict[int, Any] = {}     # id(event loop) -> httpx.AsyncClient on that loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.n_calls = 0       # requests sent (retries included)
        self.n_retries = 0

    # ------------------------------------------------------------------ plumbing
    def _scrub(self, e: Any) -> str:
        """An exception's text without the base URL's credentials (httpx may quote the URL)."""
        text = str(e)
        return text.replace(self._userinfo, "***@") if self._userinfo else text

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json", "Accept": "application/json",
             "Accept-Encoding": "identity"}
        if self.cfg.api_key:
            h["Authorization"] = f"Bearer {self.cfg.api_key}"
        return h

    def _client(self):
        import httpx

        loop = asyncio.get_running_loop()
        c = self._clients.get(id(loop))
        if c is None:
            n = self.cfg.max_connections
            c = httpx.AsyncClient(base_url=self.base_url, headers=self._headers(),
                                  transport=self._transport, timeout=None,
                                  limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))
            self._clients[id(loop)] = c
        return c

    def _run(self, coro):
        """Run a coroutine on the private loop thread and wait for it (sync API)."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                                name="aftraj-llm-client")
                self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------ one request
    async def _once(self, method: str, path: str, body: dict | None, attempt: int) -> Any:
        import httpx

        where = f"{self.shown_url}{path}"
        self.n_calls += 1
        try:
            async with self._client().stream(method, path, json=body) as resp:
                status = resp.status_code
                declared = resp.headers.get("content-length")
                cap = self.cfg.max_response_bytes
                if declared and declared.isdigit() and int(declared) > cap:
                    raise EndpointError(f"{where}: response of {int(declared):,} bytes (Content-Length) "
                                        f"is over the cap of {cap:,}", kind="oversize",
                                        status=status, attempts=attempt + 1)
                enc = resp.headers.get("content-encoding", "identity").strip().lower()
                if enc not in ("", "identity"):
                    # we asked for identity; a compressed body could expand past any cap
                    raise EndpointError(f"{where}: response has Content-Encoding {enc!r} (the client asks "
                                        f"for identity: a compressed body escapes the size cap)",
                                        kind="malformed", status=status, attempts=attempt + 1)
                buf = bytearray()
                async for chunk in resp.aiter_bytes():   # identity (checked above): the wire's bytes
                    buf += chunk
                    if len(buf) > cap:
                        raise EndpointError(f"{where}: response passed the cap of {cap:,} bytes",
                                            kind="oversize", status=status, attempts=attempt + 1)
                raw = bytes(buf)
                if status >= 300:
                    err = EndpointError(f"{where}: HTTP {status}: {raw[:300].decode('utf-8', 'replace')}",
                                        kind="http", status=status, attempts=attempt + 1)
                    if status in RETRY_STATUS or 500 <= status < 600:
                        raise _Retry(err, retry_after_s(resp.headers.get("retry-after")))
                    raise err
        except httpx.TimeoutException as e:
            raise _Retry(EndpointError(f"{where}: {type(e).__name__}: {self._scrub(e)}", kind="timeout",
                                       attempts=attempt + 1)) from None
        except httpx.TransportError as e:
            raise _Retry(EndpointError(f"{where}: connection error: {type(e).__name__}: {self._scrub(e)}",
                                       kind="connect", attempts=attempt + 1)) from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):    # RecursionError: nested deeper than the parser goes
            raise EndpointError(f"{where}: response is not JSON: {raw[:200]!r}", kind="malformed",
                                status=status, attempts=attempt + 1) from None

    async def _attempt(self, method: str, path: str, body: dict | None, attempt: int, end: float) -> Any:
        per = self.cfg.attempt_timeout_s
        if per is None or time.monotonic() + per >= end:
            return await self._once(method, path, body, attempt)   # the deadline bounds it
        try:
            async with asyncio.timeout(per):
                return await self._once(method, path, body, attempt)
        except TimeoutError:
            raise _Retry(EndpointError(f"{self.shown_url}{path}: attempt {attempt + 1} took over "
                                       f"{per:g} s", kind="timeout", attempts=attempt + 1)) from None

    async def _call(self, method: str, path: str, body: dict | None) -> tuple[Any, int]:
        cfg = self.cfg
        start = time.monotonic()
        end = start + cfg.deadline_s
        last: EndpointError | None = None
        attempt = 0
        try:
            async with asyncio.timeout(cfg.deadline_s):
                while True:
                    try:
                        return await self._attempt(method, path, body, attempt, end), attempt + 1
                    except _Retry as r:
                        last = r.err
                        if attempt >= cfg.retries:
                            raise EndpointError(f"no answer after {attempt + 1} attempts (last: {last})",
                                                kind=last.kind, status=last.status,
                                                attempts=attempt + 1) from None
                        wait = min(cfg.max_backoff_s, cfg.backoff_s * 2 ** attempt) * (0.5 + self._rng.random() / 2)
                        if r.floor_s is not None:
                            wait = max(wait, r.floor_s)
                        if time.monotonic() + wait >= end:
                            raise EndpointError(
                                f"no answer after {attempt + 1} attempts: the next wait of {wait:.2f} s "
                                f"would pass the {cfg.deadline_s:g} s deadline (last: {last})",
                                kind=last.kind, status=last.status, attempts=attempt + 1) from None
                        self.n_retries += 1
                        attempt += 1
                        await asyncio.sleep(wait)
        except TimeoutError:
            raise EndpointError(f"{self.shown_url}{path}: no complete answer within the "
                                f"{cfg.deadline_s:g} s deadline ({attempt + 1} attempts"
                                + (f"; last error: {last}" if last else "") + ")",
                                kind="deadline", attempts=attempt + 1) from None

    # ------------------------------------------------------------------ public API
    async def arequest(self, method: str, path: str, body: dict | None = None) -> Any:
        """Any JSON endpoint under the base URL (`GET /models`, `POST /tokenize`, …)."""
        return (await self._call(method, path, body))[0]

    def request(self, method: str, path: str, body: dict | None = None) -> Any:
        return self._run(self.arequest(method, path, body))

    async def acomplete(self, body: dict, *, require_content: bool = True) -> Completion:
        """POST /chat/completions with `body` (model, messages, …) -> Completion."""
        t0 = time.perf_counter()
        data, attempts = await self._call("POST", "/chat/completions", body)
        return parse_completion(data, require_content=require_content,
                                where=f"{self.shown_url}/chat/completions",
                                latency_s=time.perf_counter() - t0, attempts=attempts)

    def complete(self, body: dict, *, require_content: bool = True) -> Completion:
        return self._run(self.acomplete(body, require_content=require_content))

    async def amodels(self) -> list[str]:
        data = await self.arequest("GET", "/models")
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                  for m in items):
            raise EndpointError(f"{self.shown_url}/models: not an OpenAI model list: {str(data)[:200]}",
                                kind="malformed")
        return [m["id"] for m in items]

    def models(self) -> list[str]:
        return self._run(self.amodels())

    async def aclose(self) -> None:
        c = self._clients.pop(id(asyncio.get_running_loop()), None)
        if c is not None:
            await c.aclose()

    def close(self) -> None:
        """Close the sync side (the private loop and its connections)."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return

        async def _shutdown():
            c = self._clients.pop(id(loop), None)
            if c is not None:
                await c.aclose()

        asyncio.run_coroutine_threadsafe(_shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        loop.close()

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["ChatClient", "Choice", "ClientConfig", "Completion", "EndpointError", "ERROR_KINDS",
           "Usage", "parse_completion", "retry_after_s"]
