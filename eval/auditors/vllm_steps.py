"""`vllm-steps`: the scores of `hf-steps` from an OpenAI-compatible server (vLLM) serving the
step-scored checkpoint, one 1-token completion per arriving step.

    vllm serve RUN/final --served-model-name auditor --enable-prefix-caching
    aftraj eval --auditor vllm-steps --endpoint http://127.0.0.1:8000/v1 --model RUN/final \
        --data CORPUS/test.jsonl --out RUN/eval-test-vllm

Per event the client sends the step-tagged reading up to step t's tag as token ids
(`aftraj.prompt.StepReading`, tokenised here with the checkpoint's tokenizer, `--model` names its
folder) to `POST /completions` with `max_tokens: 1`, `logprobs: top_logprobs` and vLLM's
`return_tokens_as_token_ids`; the log-odds are log p(ALARM token) - log p(SAFE token) from the
first position's top log-probs. The prompt of step t+1 extends that of step t token for token, so a
prefix-caching server computes only the new step's tokens (`cached_tokens` from
`usage.prompt_tokens_details` when the server reports it): the cost of an event does not grow with
the run. A trained checkpoint puts nearly all the mass on the two tokens after a tag; when one of
them is not among the top log-probs, its log-prob is bounded by the smallest one returned (the
result's `raw` says so) — raise `top_logprobs` (vLLM's `--max-logprobs`) if that happens.

The alternative is vLLM's pooling runner (`--runner pooling`, `PoolerConfig(pooling_type="STEP",
step_tag_id=<the tag's last token>, returned_token_ids=[SAFE, ALARM])`): one request per sequence
returns the two-token distribution at every tag, exact, but STEP pooling turns prefix caching off
in vLLM (`is_prefix_caching_supported`), so each event re-reads the whole run: the per-event cost
grows with the run. The 1-token completion keeps the cache; it is the path served here.

Tier 2, on a crossing only (`reason: openai`, the default when the server also serves chat): the
normal prompt for prefix t through the `openai` auditor (the generative path); its reason becomes
the ALARM's. The threshold, offsets and the reading's bounds come from the checkpoint folder
(steps_calibration.json, steps_reading.json), as for `hf-steps`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from aftraj.llm_client import ChatClient, ClientConfig, EndpointError
from aftraj.prompt import StepReading, step_decision_ids
from aftraj.verdict import Verdict
from eval.auditors import AuditResult, Auditor, register_auditor
from eval.auditors.hf_steps import offset_of, read_calibration


@register_auditor("vllm-steps")
class VLLMStepsAuditor(Auditor):
    """Arguments: `--endpoint URL` (the /v1 base), `--model FOLDER` (the checkpoint: tokenizer,
    calibration), `--api-model NAME` (default: the server's first model)."""

    confidence_kind = "probability"

    def __init__(self, arg: str | None = None, *, endpoint: str | None = None, model: str | None = None,
                 api_model: str | None = None, api_key_env: str = "OPENAI_API_KEY", timeout: float = 30.0,
                 retries: int = 2, top_logprobs: int = 20, threshold: float | None = None,
                 decision_threshold: float | None = None, reason: str = "openai", max_new_tokens: int = 512,
                 transport=None, **kw) -> None:
        super().__init__(arg, **kw)
        from transformers import AutoTokenizer

        if not endpoint:
            raise ValueError("vllm-steps auditor needs --endpoint URL (an OpenAI-compatible /v1 base)")
        folder = model or arg
        if not folder or not Path(folder).expanduser().is_dir():
            raise ValueError("vllm-steps auditor needs --model FOLDER: the served checkpoint's folder (its "
                             "tokenizer and calibration)")
        if reason not in ("openai", "none"):
            raise ValueError(f"reason must be 'openai' or 'none', got {reason!r}")
        folder = str(Path(folder).expanduser())
        self.tok = AutoTokenizer.from_pretrained(folder)
        reading, self.calibration = read_calibration(folder)
        thr = threshold if threshold is not None else decision_threshold
        self.threshold = float(thr if thr is not None else (self.calibration or {}).get("threshold", 0.0))
        self.uncalibrated = thr is None and self.calibration is None
        self.bounds = {"max_tokens": reading.get("max_tokens"), "max_step_tokens": reading.get("max_step_tokens"),
                       "keep_tokens": reading.get("keep_tokens", 0)}
        self.decisions = step_decision_ids(self.tok)
        self.top_logprobs, self.endpoint = top_logprobs, endpoint.rstrip("/")
        self.client = ChatClient(ClientConfig.from_env(self.endpoint, api_key_env, deadline_s=timeout,
                                                       retries=retries), transport=transport)
        try:
            self.api_model = api_model or self.client.models()[0]
        except (EndpointError, IndexError) as e:
            self.client.close()
            raise ValueError(f"{self.endpoint}/models: no model to ask ({e}); pass --api-model") from None
        self.reason, self.folder, self.max_new_tokens = reason, folder, max_new_tokens
        self.api_key_env, self.timeout, self.transport = api_key_env, timeout, transport
        self.readings: dict[str, StepReading] = {}
        self._reasoner = None

    @property
    def label(self) -> str:
        base = f"vllm-steps ({self.api_model})"
        return base + " (uncalibrated: threshold 0)" if self.uncalibrated else base

    def prompt_ids(self, traj, t: int) -> list[int]:
        """The reading's ids up to step t's tag (the steps not added yet are added)."""
        r = self.readings.get(traj.id)
        if r is None or len(r.blocks) > t + 1:
            r = self.readings[traj.id] = StepReading(self.tok, traj, **self.bounds)
        while len(r.blocks) <= t:
            r.add(traj.steps[len(r.blocks)])
        si, pos = r.where(t)
        return r.segments[si].ids[: pos + 1]

    def log_odds(self, reply: dict) -> tuple[float, str | None]:
        """(log p(ALARM) - log p(SAFE), a note when one side was bounded) from a completion reply."""
        lp = reply["choices"][0]["logprobs"]["top_logprobs"][0]
        got: dict[int, float] = {}
        for key, v in lp.items():
            if key.startswith("token_id:"):
                got[int(key.split(":", 1)[1])] = v
            else:                                          # a server without return_tokens_as_token_ids
                for tid in self.decisions:
                    if self.tok.decode([tid]) == key:
                        got[tid] = v
        floor = min(lp.values())
        s, a = self.decisions
        note = None
        if s not in got or a not in got:
            note = f"bounded: {'SAFE' if s not in got else 'ALARM'} token not in the top {len(lp)} log-probs"
        return got.get(a, floor) - got.get(s, floor), note

    def audit(self, traj, t) -> AuditResult:
        t0 = time.perf_counter()
        ids = self.prompt_ids(traj, t)
        body = {"model": self.api_model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "logprobs": self.top_logprobs, "return_tokens_as_token_ids": True}
        try:
            reply = self.client.request("POST", "/completions", body)
            lo, note = self.log_odds(reply)
        except EndpointError as e:
            return AuditResult(None, t=t, latency_s=time.perf_counter() - t0, error=str(e), error_kind=e.kind)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            return AuditResult(None, t=t, latency_s=time.perf_counter() - t0,
                               error=f"{self.endpoint}/completions: no top log-probs in the reply ({e!r})",
                               error_kind="malformed")
        u = reply.get("usage") or {}
        cached = ((u.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
        v = lo + offset_of(self.calibration, traj, t)
        p = 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, v))))
        completion, raw = 0, note
        if v >= self.threshold:
            reason, text, completion = self._reason(traj, t, v)
            raw = text if note is None else f"{note}\n{text or ''}"
            verdict = Verdict("UNSAFE", step=t, agent=traj.steps[t].agent, reason=reason, confidence=p)
        else:
            verdict = Verdict("SAFE", confidence=p)
        return AuditResult(verdict, t=t, confidence=p, latency_s=time.perf_counter() - t0,
                           prompt_tokens=int(u.get("prompt_tokens") or len(ids)), cached_tokens=int(cached),
                           completion_tokens=completion, raw=raw, decision_log_odds=lo)

    def _reason(self, traj, t: int, v: float) -> tuple[str, str | None, int]:
        fallback = f"step-scored log-odds {v:.3f} >= threshold {self.threshold:.3f} at step {t}"
        if self.reason == "none":
            return fallback, None, 0
        if self._reasoner is None:
            from eval.auditors import get_auditor

            self._reasoner = get_auditor("openai", endpoint=self.endpoint, api_model=self.api_model,
                                         api_key_env=self.api_key_env, model=self.folder, concurrency=1,
                                         timeout=self.timeout, max_new_tokens=self.max_new_tokens,
                                         transport=self.transport, layout=self.layout)
        r = self._reasoner.audit(traj, t)
        got = r.verdict.reason if isinstance(r.verdict, Verdict) and r.verdict.reason else None
        text = (r.raw or "").strip()
        return (got or (text[:500] if text else fallback)), r.raw, r.completion_tokens

    def end(self, traj) -> None:
        self.readings.pop(traj.id, None)

    def close(self) -> None:
        self.readings.clear()
        if self._reasoner is not None:
            self._reasoner.close()
        self.client.close()
