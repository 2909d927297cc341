"""`openai`: any OpenAI-compatible chat endpoint (vLLM's server, an API) as an auditor.

    aftraj eval --auditor openai --endpoint http://127.0.0.1:8000/v1 --data ww.jsonl --out runs/ww
    aftraj eval --auditor openai:binary-search --endpoint https://api.example.com/v1 \
        --api-model judge-large --reference-answer --data who_and_when --out runs/ww-bs

Methods (`openai:METHOD`), Who&When's prompting methods over the one prompt builder:
- `step-by-step` (default): the strict online walk, prefix by prefix, first ALARM ends it.
- `all-at-once`: one call with the whole trajectory (post-hoc, labelled so in reports).
- `binary-search`: binary search for the earliest prefix the judge alarms on (about log2 N calls).
`--reference-answer` adds the ground-truth answer to the prompt (Who&When "with ground truth").

Transport: httpx, a thread pool of `concurrency` calls in flight (the walker hands a batch of
prefixes from many trajectories at once), a per-call `timeout`, `retries` with exponential
backoff (honouring Retry-After) on timeouts, connection errors, 408/409/429 and 5xx; other
errors raise `AuditorError` (never a silent CONTINUE). Usage is recorded per call, including
`prompt_tokens_details.cached_tokens` (vLLM: start the server with prefix caching and
`--enable-prompt-tokens-details`). Confidence P(UNSAFE) comes from the verdict token's
`top_logprobs` when the endpoint returns them (`eval.confidence`).
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence

from aftraj.prompt import parse_verdict, render_prompt
from eval.auditors import AuditResult, Auditor, register_auditor
from eval.confidence import p_unsafe

METHODS = {"step-by-step": "online", "all-at-once": "posthoc", "binary-search": "bisect"}
RETRY_STATUS = frozenset({408, 409, 429})  # and every 5xx (gateways and proxies answer 520-529 too)


class AuditorError(RuntimeError):
    """The endpoint could not give an answer (after retries)."""


@register_auditor("openai")
class OpenAIAuditor(Auditor):
    def __init__(self, arg: str | None = None, *, endpoint: str | None = None,
                 api_model: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 concurrency: int = 8, timeout: float = 120.0, retries: int = 4,
                 backoff: float = 0.5, max_backoff: float = 30.0, max_new_tokens: int = 1024,
                 budget: int | None = None, reference_answer: bool = False,
                 logprobs: bool = True, top_logprobs: int = 20, temperature: float = 0.0,
                 extra_body: dict | None = None, **kw) -> None:
        super().__init__(arg, **kw)
        import httpx

        method = arg or "step-by-step"
        if method not in METHODS:
            raise ValueError(f"openai auditor: method must be one of {', '.join(METHODS)}; got {method!r}")
        if not endpoint:
            raise ValueError("openai auditor needs --endpoint URL (an OpenAI-compatible /v1 base)")
        if concurrency < 1 or retries < 0 or timeout <= 0:
            raise ValueError("openai auditor: concurrency >= 1, retries >= 0 and timeout > 0 required")
        self.method, self.strategy = method, METHODS[method]
        self.endpoint = endpoint.rstrip("/")
        self.concurrency, self.timeout, self.retries = concurrency, timeout, retries
        self.backoff, self.max_backoff = backoff, max_backoff
        self.max_new_tokens, self.budget, self.reference_answer = max_new_tokens, budget, reference_answer
        self.logprobs, self.top_logprobs, self.temperature = logprobs, top_logprobs, temperature
        self.extra_body = dict(extra_body or {})
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(api_key_env) if api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.client = httpx.Client(base_url=self.endpoint, headers=headers,
                                   timeout=httpx.Timeout(timeout),
                                   limits=httpx.Limits(max_connections=concurrency,
                                                       max_keepalive_connections=concurrency))
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="openai-auditor")
        self.api_model = api_model or self._first_model()
        self._lock = threading.Lock()
        self.n_retries = 0

    @property
    def label(self) -> str:
        base = f"openai:{self.method} ({self.api_model})"
        return f"{base} (post-hoc)" if self.posthoc else base

    # --------------------------------------------------------------- HTTP
    def _request(self, method: str, path: str, json: dict | None = None) -> dict:
        import httpx

        last = None
        for attempt in range(self.retries + 1):
            wait = min(self.max_backoff, self.backoff * 2 ** attempt) * (0.5 + random.random() / 2)
            try:
                resp = self.client.request(method, path, json=json)
            except (httpx.TimeoutException, httpx.TransportError) as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code < 300:
                    try:
                        return resp.json()
                    except ValueError:
                        raise AuditorError(f"{self.endpoint}{path}: response is not JSON: "
                                           f"{resp.text[:200]!r}") from None
                last = f"HTTP {resp.status_code}: {resp.text[:300]}"
                if resp.status_code not in RETRY_STATUS and not 500 <= resp.status_code < 600:
                    raise AuditorError(f"{self.endpoint}{path}: {last}")
                ra = resp.headers.get("retry-after")
                if ra:
                    try:
                        wait = min(self.max_backoff, max(wait, float(ra)))
                    except ValueError:
                        pass
            if attempt < self.retries:
                with self._lock:
                    self.n_retries += 1
                time.sleep(wait)
        raise AuditorError(f"{self.endpoint}{path}: no answer after {self.retries + 1} attempts "
                           f"(last: {last})")

    def _first_model(self) -> str:
        data = self._request("GET", "/models").get("data") or []
        if not data:
            raise AuditorError(f"{self.endpoint}/models lists no model; pass --api-model")
        return data[0]["id"]

    # --------------------------------------------------------------- auditing
    def payload(self, traj, t) -> dict:
        r = render_prompt(traj, t, self.budget, reference_answer=self.reference_answer, layout=self.layout)
        body = {"model": self.api_model, "messages": r.messages, "temperature": self.temperature,
                "max_tokens": self.max_new_tokens, **self.extra_body}
        if self.logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        return body

    def audit(self, traj, t) -> AuditResult:
        t0 = time.perf_counter()
        data = self._request("POST", "/chat/completions", self.payload(traj, t))
        latency = time.perf_counter() - t0
        try:
            choice = data["choices"][0]
            msg = choice["message"]
            text = msg.get("content") or ""
            # A server with a reasoning parser (vLLM --reasoning-parser) moves the <think> block
            # out of `content`; put it back so the strict parser sees the trained format.
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            if reasoning and "<think>" not in text:
                text = f"<think>{reasoning}</think>{text}"
        except (KeyError, IndexError, TypeError, AttributeError):
            raise AuditorError(f"{self.endpoint}: malformed chat completion: {str(data)[:300]}") from None
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        conf = None
        lp = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
        if lp:
            pieces = [c.get("token", "") for c in lp]
            tops = [{x.get("token", ""): x.get("logprob") for x in (c.get("top_logprobs") or [])}
                    or {c.get("token", ""): c.get("logprob")} for c in lp]
            conf = p_unsafe(pieces, tops)
        return AuditResult(parse_verdict(text, t), t=t, confidence=conf, latency_s=latency,
                           prompt_tokens=int(usage.get("prompt_tokens") or 0),
                           completion_tokens=int(usage.get("completion_tokens") or 0),
                           cached_tokens=int(details.get("cached_tokens") or 0), raw=text)

    def audit_batch(self, requests: Sequence[tuple]) -> list[AuditResult]:
        return list(self.pool.map(lambda req: self.audit(*req), requests))

    def submit(self, traj, t):
        """One call in the background; the walker refills a slot as soon as it answers."""
        return self.pool.submit(self.audit, traj, t)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()
