"""`openai`: any OpenAI-compatible chat endpoint (vLLM's server, an API) as an auditor.

    aftraj eval --auditor openai --endpoint http://127.0.0.1:8000/v1 --data ww.jsonl --out runs/ww
    aftraj eval --auditor openai:binary-search --endpoint https://api.example.com/v1 \
        --api-model judge-large --reference-answer --data who_and_when --out runs/ww-bs

Methods (`openai:METHOD`), Who&When's prompting methods over the one prompt builder:
- `step-by-step` (default): the strict online walk, prefix by prefix, first ALARM ends it.
- `all-at-once`: one call with the whole trajectory (post-hoc, labelled so in reports).
- `binary-search`: binary search for the earliest prefix the judge alarms on (about log2 N calls).
`--reference-answer` adds the ground-truth answer to the prompt (Who&When "with ground truth").

Transport: the one client, `aftraj.llm_client.ChatClient`: `--timeout` is a TOTAL deadline per
call (connect, body, retries and back-off included; a server dripping a huge body is abandoned
at it), a response-size cap, retries with jitter honouring Retry-After on connection errors,
408/409/429 and 5xx. `concurrency` calls are in flight (a thread pool; the walker hands a batch
of prefixes from many trajectories at once). An endpoint failure (no answer by the deadline,
content null, finish_reason content_filter/error, oversize) is an `AuditResult` with `error`
set: counted as an error, never as a verdict (the report shows the error rate; `aftraj eval`
exits non-zero when every call failed). An unreachable endpoint at start (GET /models) raises
`AuditorError`. Usage is recorded per call, including `prompt_tokens_details.cached_tokens`
(vLLM: prefix caching and `--enable-prompt-tokens-details`). Confidence P(UNSAFE) comes from
the verdict token's `top_logprobs` when the endpoint returns them (`aftraj.confidence`).

Budget: with `--budget`, tokens are counted with the served model's tokenizer when `--model`
names its folder (the rule of stage 1 and the `hf` auditor: `len(tok(text,
add_special_tokens=False).input_ids)`), else with the character estimate `approx_tokens`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from aftraj.confidence import p_unsafe_from_logprobs
from aftraj.errors import UsageError
from aftraj.llm_client import ChatClient, ClientConfig, EndpointError
from aftraj.prompt import render_prompt
from aftraj.tokens import approx_tokens, tokenizer_counter
from aftraj.verdict import parse_verdict
from eval.auditors import AuditResult, Auditor, register_auditor

METHODS = {"step-by-step": "online", "all-at-once": "posthoc", "binary-search": "bisect"}


class AuditorError(UsageError, RuntimeError):
    """The endpoint could not give an answer (after retries): the endpoint the user named is down
    or wrong, so a user error (one line, exit 2; mid-walk `aftraj eval` exits 3, eval/run.py)."""


@register_auditor("openai")
class OpenAIAuditor(Auditor):
    def __init__(self, arg: str | None = None, *, endpoint: str | None = None,
                 api_model: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 concurrency: int = 8, timeout: float = 120.0, retries: int = 4,
                 backoff: float = 0.5, max_backoff: float = 30.0, max_new_tokens: int = 1024,
                 budget: int | None = None, reference_answer: bool = False,
                 logprobs: bool = True, top_logprobs: int = 20, temperature: float = 0.0,
                 extra_body: dict | None = None, model: str | None = None,
                 attempt_timeout: float | None = None, max_response_bytes: int = 32 << 20,
                 transport=None, **kw) -> None:
        super().__init__(arg, **kw)
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
        self.max_new_tokens, self.budget, self.reference_answer = max_new_tokens, budget, reference_answer
        self.logprobs, self.top_logprobs, self.temperature = logprobs, top_logprobs, temperature
        self.extra_body = dict(extra_body or {})
        self.count_tokens = approx_tokens
        if budget is not None and model:
            self.count_tokens = tokenizer_counter(model)
        self._lock = threading.Lock()   # before anything can fail: close() must always work
        self.pool = None
        self.client = ChatClient(ClientConfig.from_env(
            self.endpoint, api_key_env, deadline_s=timeout, attempt_timeout_s=attempt_timeout,
            retries=retries, backoff_s=backoff, max_backoff_s=max_backoff,
            max_response_bytes=max_response_bytes, max_connections=concurrency), transport=transport)
        try:
            self.api_model = api_model or self._first_model()
        except AuditorError:
            self.client.close()
            raise
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="openai-auditor")

    @property
    def n_retries(self) -> int:
        return self.client.n_retries

    @property
    def label(self) -> str:
        base = f"openai:{self.method} ({self.api_model})"
        return f"{base} (post-hoc)" if self.posthoc else base

    def _first_model(self) -> str:
        try:
            models = self.client.models()
        except EndpointError as e:
            raise AuditorError(f"{self.endpoint}/models: {e}") from None
        if not models:
            raise AuditorError(f"{self.endpoint}/models lists no model; pass --api-model")
        return models[0]

    # --------------------------------------------------------------- auditing
    def payload(self, traj, t) -> dict:
        r = render_prompt(traj, t, self.budget, count_tokens=self.count_tokens,
                          reference_answer=self.reference_answer, layout=self.layout)
        # every sampling field an OpenAI-compatible endpoint takes, stated (greedy by default);
        # vLLM's own (top_k, min_p, repetition_penalty) are neutral on a server we start
        # (`--generation-config vllm`, serve/vllm.py), else they come from the model's
        # generation_config.json: docs/gpu.md, "Decoding"
        body = {"model": self.api_model, "messages": r.messages, "temperature": self.temperature,
                "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "max_tokens": self.max_new_tokens, **self.extra_body}
        if self.logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        return body

    def audit(self, traj, t) -> AuditResult:
        t0 = time.perf_counter()
        try:
            c = self.client.complete(self.payload(traj, t))
        except EndpointError as e:
            return AuditResult(None, t=t, latency_s=time.perf_counter() - t0, error=str(e),
                               error_kind=e.kind)
        u = c.usage
        return AuditResult(parse_verdict(c.text, t), t=t, confidence=p_unsafe_from_logprobs(c.logprobs),
                           latency_s=time.perf_counter() - t0, prompt_tokens=u.prompt_tokens,
                           completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
                           raw=c.text)

    def audit_batch(self, requests: Sequence[tuple]) -> list[AuditResult]:
        return list(self.pool.map(lambda req: self.audit(*req), requests))

    def submit(self, traj, t):
        """One call in the background; the walker refills a slot as soon as it answers."""
        return self.pool.submit(self.audit, traj, t)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.client.close()

