"""The auditor behind the gateway's verdicts, one object whatever it is: an OpenAI-compatible
endpoint (`auditor.backend: openai`, through the one client `aftraj.llm_client`) or an auditor
run in the gateway's process (`auditor.backend` any registered name, e.g. `hf-steps`: an
`eval.auditors.Auditor` the caller builds and passes, since serve does not import eval).

    auditing = AuditorClient(cfg.auditor, auditor=None, transport=None)
    decision, status, score = await auditing.answer(r, t, base, decision, score, t0, render=..., off=...)

The endpoint is sent the prefix rendered with the shared prompt builder (the service's
`render`, on its threads); its reply is parsed there too. An in-process auditor is asked for
prefix t of the run on one thread of its own (a model is not shared between threads), the run's
id its storage key so tenants never share its state; `hf-steps` feeds only the new step onto
the run's KV cache. The runs it keeps state for are bounded (`auditor.max_sessions`, the least
recently audited ended first) and ended when the gateway evicts them (`end`). Either way one
deadline (`auditor.deadline_s`) counts from the request's arrival; past it, or on any error,
the verdict says `auditor: unavailable` and the fold's rules decide: never a silent CONTINUE.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from aftraj.schema import Trajectory
from aftraj.tokens import approx_tokens
from aftraj.verdict import ParseFailure, parse_verdict
from serve.config import AUDITOR_BACKENDS, AuditorConfig
from serve.runs import Run, trajectory

log = logging.getLogger("aftraj.gateway")

MIN_AUDIT_S = 0.05         # less deadline than this left after the run's lock: do not call the auditor


class AuditorUnavailable(Exception):
    """An in-process auditor gave no answer (`AuditResult.error`); `kind` as the client's errors."""

    def __init__(self, kind: str, message: str | None):
        super().__init__(message or kind)
        self.kind = kind


def read_reply(text: str, logprobs, t: int):
    """Parse the endpoint's reply (blocking: a hostile 1M-character reply costs its parse on
    the threads, not on the event loop)."""
    from aftraj.confidence import p_unsafe_from_logprobs

    try:
        v = parse_verdict(text, t)
    except Exception as e:          # the parser never raises; if it did: no verdict
        return None, f"unparseable reply: {type(e).__name__}", None
    conf = None
    if v is not None and not isinstance(v, ParseFailure):
        try:
            conf = p_unsafe_from_logprobs(logprobs)
        except Exception:            # odd log-probs: no confidence, the verdict stands
            conf = None
    return v, None, conf


def read_result(res):
    """An in-process auditor's AuditResult as (verdict, error, confidence, (prompt, cached
    tokens)): an endpoint error is raised as the openai path's are (auditor: unavailable)."""
    if res.verdict is None:
        raise AuditorUnavailable(res.error_kind or "error", res.error)
    return res.verdict, None, res.confidence, (res.prompt_tokens, res.cached_tokens)


def _token_counter(a: AuditorConfig):
    """What counts the prompt budget: the served model's tokenizer (its local folder), else the
    approximate count."""
    if a.budget is not None and a.tokenizer not in (None, "approx"):
        from aftraj.config import ConfigError
        from aftraj.tokens import tokenizer_counter

        folder = os.path.expanduser(a.tokenizer)
        if not os.path.isdir(folder):     # else transformers reads it as a Hub repo id: "Repo id must be …"
            raise ConfigError(f"{a.tokenizer!r} is not a folder: give the served model's local folder "
                              f"(its tokenizer counts the prompt budget), or `approx` for a rough count; "
                              f"nothing is downloaded", key="auditor.tokenizer")
        return tokenizer_counter(folder)
    if a.backend == "openai":
        log.warning("auditor.tokenizer is not set: the %d-token budget is counted approximately (3 characters "
                    "a token); give the served model's folder to render over-budget prompts as training did",
                    a.budget)
    return approx_tokens


class AuditorClient:
    """The endpoint's client or the in-process auditor (its thread and its bounded sessions)."""

    def __init__(self, a: AuditorConfig, *, auditor=None, transport=None):
        self.cfg = a
        self.client = None
        self.auditor = None            # an in-process auditor (`auditor.backend`: its registered name)
        if a.backend not in AUDITOR_BACKENDS:
            if auditor is None:
                from aftraj.config import ConfigError

                raise ConfigError(f"{a.backend!r} is an in-process auditor: build it and pass it "
                                  f"(GatewayService(cfg, auditor=…); `aftraj serve gateway` does, with "
                                  f"eval.auditors.get_auditor(backend, **options))", key="auditor.backend")
            self.auditor = auditor
            # one thread: a model is not shared between threads, and the runs it keeps state for
            # (`audited`, least recently audited first) are touched there only
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="aftraj-auditor")
            self.audited: OrderedDict[str, Trajectory] = OrderedDict()
        if a.backend == "openai":
            from aftraj.llm_client import ChatClient, ClientConfig

            self.client = ChatClient(ClientConfig.from_env(
                a.base_url, a.api_key_env, deadline_s=a.deadline_s, retries=1, backoff_s=0.05,
                max_backoff_s=0.5, max_response_bytes=a.max_response_bytes), transport=transport)
        self.count_tokens = _token_counter(a)

    @property
    def asks(self) -> bool:
        """An auditor model answers each prefix (else the fold alone, inside the events' commit)."""
        return self.client is not None or self.auditor is not None

    # ------------------------------------------------------------------ the in-process auditor's thread
    def _audit_here(self, key: str, traj: Trajectory, t: int):
        """On the auditor's thread: prefix t of the run stored under `key`; past `max_sessions`
        runs, the least recently audited one is ended (its state, e.g. a KV cache, freed)."""
        self.audited[key] = traj
        self.audited.move_to_end(key)
        while len(self.audited) > self.cfg.max_sessions:
            _, old = self.audited.popitem(last=False)
            self.auditor.end(old)
        return self.auditor.audit(traj, t)

    def _end_here(self, key: str) -> None:
        """On the auditor's thread: the run left the gateway's cache; end the auditor's state."""
        old = self.audited.pop(key, None)
        if old is not None:
            self.auditor.end(old)

    def end(self, r: Run) -> None:
        """The gateway evicted run `r`: end the in-process auditor's state for it (on its thread)."""
        if self.auditor is not None:
            self.pool.submit(self._end_here, r.key)

    # ------------------------------------------------------------------ one verdict
    async def _ask_in_process(self, r: Run, t: int, base: dict):
        # past the deadline the answer is dropped, the thread finishes it (and the next prefix
        # waits for it): one run's walk, one model, in order. The run as the auditor reads it:
        # its id is the storage key, so runs of two tenants with one run_id never share state.
        m0 = time.perf_counter()
        res = await asyncio.get_running_loop().run_in_executor(
            self.pool, self._audit_here, r.key, trajectory(r, as_id=r.key), t)
        base["model_latency_ms"] = round(1000 * (time.perf_counter() - m0), 3)
        return read_result(res)

    async def _ask_endpoint(self, r: Run, t: int, base: dict, render, off):
        a = self.cfg
        rendered = await off(render, r, t)
        body = {"model": a.model, "messages": rendered.messages, "temperature": a.temperature,
                "max_tokens": a.max_tokens}
        if a.top_logprobs:
            body.update(logprobs=True, top_logprobs=a.top_logprobs)
        m0 = time.perf_counter()
        c = await self.client.acomplete(body)
        base["model_latency_ms"] = round(1000 * (time.perf_counter() - m0), 3)
        v, err, conf = await off(read_reply, c.text, c.logprobs, t)
        return v, err, conf, (c.usage.prompt_tokens, c.usage.cached_tokens)

    async def answer(self, r: Run, t: int, base: dict, decision: str, score: float, t0: float, *,
                     render, off) -> tuple[str, str, float]:
        """Ask the auditor about prefix t within the deadline left since `t0`, filling `base`
        (confidence, k, agent, reason, auditor_error, model latency, tokens); returns (decision,
        auditor status, score). `render(r, t)` renders the prompt and `off(fn, *args)` runs
        blocking work on the service's threads."""
        status = "unavailable"
        a = self.cfg
        left = t0 + a.deadline_s - time.perf_counter()   # one deadline from arrival, lock wait included
        try:
            if left < MIN_AUDIT_S:
                raise TimeoutError
            async with asyncio.timeout(left):
                if self.auditor is not None:
                    v, err, conf, usage = await self._ask_in_process(r, t, base)
                else:
                    v, err, conf, usage = await self._ask_endpoint(r, t, base, render, off)
        except TimeoutError:
            base["auditor_error"] = (f"no verdict within the {a.deadline_s:g} s deadline (counted from the "
                                     f"request's arrival, the wait for the run's lock included)")
        except Exception as e:       # EndpointError, a render failure: the fold still answers
            # tenants get the kind only; the operator's log has the (credential-free) message
            kind = getattr(e, "kind", None)
            base["auditor_error"] = f"{type(e).__name__}" + (f" ({kind})" if kind else "")
            log.warning("run %s: auditor error: %s: %s", r.key, type(e).__name__, e)
        else:
            base.update(prompt_tokens=usage[0], cached_tokens=usage[1])
            if v is None:
                status, base["auditor_error"] = "parse_failure", err
            elif isinstance(v, ParseFailure):
                status = "parse_failure"
                base["auditor_error"] = f"{v.code}: {v.message}"[:500]
            else:
                status = "ok"
                base["confidence"] = conf
                if v.alarm:
                    decision = "ALARM"
                    base.update(k=v.step, agent=v.agent, reason=v.reason)
                score = conf if conf is not None else (1.0 if v.alarm else 0.0)
        return decision, status, score

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.auditor is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.auditor.close()


__all__ = ["AuditorClient", "AuditorUnavailable", "MIN_AUDIT_S", "read_reply", "read_result"]
