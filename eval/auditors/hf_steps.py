"""`hf-steps`: a step-scored checkpoint (`aftraj train steps`) in process, one incremental forward
per arriving step, and the full verdict only when the score crosses.

    aftraj eval --auditor hf-steps --model RUN/final --data CORPUS/test.jsonl --out RUN/eval-test

The run is read as its step-tagged sequence (`aftraj.prompt.StepReading`: the normal prompt's
system prompt, header and step blocks, with a tag after each step). Per live trajectory the
auditor keeps the reading and its KV cache; prefix t feeds the blocks of the steps not fed yet
(normally only step t's, ~tens to hundreds of tokens) onto the cache and reads the next-token
logits at step t's tag: log-odds = log p(ALARM token) - log p(SAFE token). The cost of an event is
that step's tokens attending to the cache, whatever the run's length; a run past the reading's
`max_tokens` starts a new segment (the reading's own prefix-stable rule, so the scores are those
training and calibration read).

Tier 1, every step: ALARM iff log-odds (+ the calibration's offset, none by default) >= the
threshold; the ALARM names step t and its agent (the decision is about prefix 0..t, so the step
that tipped it is t). Tier 2, only on a crossing (`reason: generate`, the default): the same
checkpoint answers the normal prompt for prefix t through the generative path (`eval.auditors.hf.
HFAuditor`, the ALARM side forced at its decision token), and its reason (or its raw text) becomes
the ALARM's reason (at most `reason_max_new_tokens`, 256, and at most `--max-new-tokens` new
tokens); `reason: none` (or `--max-new-tokens 0`) skips it.

The threshold comes from MODEL/steps_calibration.json (chosen on val at FAR <= 20 %,
eval/step_calibration.py), or `threshold=` (CLI `--decision-threshold`); the reading's bounds,
decision tokens and the precision the calibration was scored in (the default `mixed_precision`)
from MODEL/steps_reading.json. Without a calibration the threshold is 0 (the two
tokens' argmax), said in `label`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from aftraj.prompt import STEP_READING_VERSION, StepReading, step_decision_ids
from aftraj.scoring import autocast, past
from aftraj.verdict import Verdict
from eval.auditors import AuditResult, Auditor, register_auditor
from eval.auditors.hf import context_length, loaded_model
from eval.hf_compat import masked_gqa, new_cache

READING_FILE = "steps_reading.json"
FEED_BUCKET = 16          # an event's new tokens are fed in multiples of this (see _feed)
CALIBRATION_FILE = "steps_calibration.json"   # eval/step_calibration.py writes it


def read_calibration(folder: str | Path | None) -> tuple[dict, dict | None]:
    """(the reading's settings, the calibration or None) stored with a step-scored checkpoint."""
    reading, cal = {}, None
    if folder is not None:
        p = Path(folder).expanduser()
        if (p / READING_FILE).is_file():
            reading = json.loads((p / READING_FILE).read_text(encoding="utf-8"))
            if reading.get("version") != STEP_READING_VERSION:
                raise ValueError(f"{p / READING_FILE}: reading version {reading.get('version')!r}, this code "
                                 f"reads version {STEP_READING_VERSION}: retrain or use the matching code")
        if (p / CALIBRATION_FILE).is_file():
            cal = json.loads((p / CALIBRATION_FILE).read_text(encoding="utf-8"))
            if not isinstance(cal.get("threshold"), (int, float)) or not math.isfinite(cal["threshold"]):
                raise ValueError(f"{p / CALIBRATION_FILE}: field 'threshold' must be a finite number, "
                                 f"got {cal.get('threshold')!r}")
    return reading, cal


def offset_of(cal: dict | None, traj, t: int) -> float:
    """The calibration's offset for step t: its run's domain and the step's agent
    (`eval.step_calibration.offset_key`), when the calibration kept offsets."""
    offs = (cal or {}).get("offsets") or {}
    return float(offs.get(f"{traj.domain}/{traj.steps[t].agent}", 0.0))


class DecisionHead:
    """log p(ALARM) - log p(SAFE) from the decoder's last hidden state: the two tokens' rows of the
    output embedding (the softmax's normaliser cancels), so an event never runs the head over the
    whole vocabulary (SmolLM2: 49,152 rows, under bf16 autocast most of an event's time)."""

    def __init__(self, decoder, weight, bias):
        self.decoder, self.weight, self.bias = decoder, weight, bias

    def log_odds(self, h) -> float:
        import torch.nn.functional as F

        z = F.linear(h, self.weight, self.bias).float()[0]
        return float(z[1] - z[0])


def decision_head(model, decisions: tuple[int, int]) -> DecisionHead | None:
    """The two-row head of a causal LM whose logits are a plain linear map of the decoder's output
    (Llama, Qwen2, SmolLM2, …); None where the logits are more (soft-capping, scaling): the full
    head then."""
    cfg = getattr(model, "config", None)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if (out is None or decoder is None or getattr(cfg, "final_logit_softcapping", None)
            or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0) or type(out).__name__ != "Linear"):
        return None
    rows = list(decisions)
    return DecisionHead(decoder, out.weight[rows], None if out.bias is None else out.bias[rows])


def bf16_linears(model, mixed_precision: str, device) -> int:
    """Store the decoder layers' linear weights in bf16 when `mixed_precision` resolves to bf16
    (autocast then casts nothing: the same bf16 numbers every forward, without the cast); the
    norms, the embeddings and the head stay float32. Returns how many were converted."""
    import torch

    from aftraj.scoring import decoder_layers, resolve_mixed_precision

    if resolve_mixed_precision(mixed_precision) != "bf16" or getattr(device, "type", device) != "cpu":
        return 0
    n = 0
    for layer in decoder_layers(model)[1]:
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32:
                m.to(torch.bfloat16)
                n += 1
    return n


@dataclass
class _Session:
    reading: StepReading
    cache: object | None = None
    scores: list[float] = field(default_factory=list)   # log-odds of each step fed
    fed: int = 0                                          # tokens of the current segment in the cache


@register_auditor("hf-steps")
class HFStepsAuditor(Auditor):
    """Arguments: `hf-steps` with `model=PATH` (CLI `--model`), or `hf-steps:PATH`."""

    confidence_kind = "probability"       # sigmoid(log-odds): P(ALARM token | one of the two)
    # one trajectory at a time: each live one holds its KV cache (~46 KB a SmolLM2 token), and
    # interleaving gains nothing here (every event is its own forward); the walker's default of 32
    # held 32 caches at once (a 48-run walk peaked at 5.0 GiB)
    max_in_flight = 1

    def __init__(self, arg: str | None = None, *, model=None, tokenizer=None, dtype: str = "float32",
                 device: str | None = None, threshold: float | None = None,
                 decision_threshold: float | None = None, reason: str = "generate",
                 reason_max_new_tokens: int = 256, max_new_tokens: int | None = None,
                 mixed_precision: str | None = None,
                 max_tokens: int | None = None, max_step_tokens: int | None = None,
                 keep_tokens: int | None = None, **kw) -> None:
        super().__init__(arg, **kw)
        path = model if isinstance(model, (str, Path)) else arg
        self.model, self.tok = loaded_model("hf-steps", arg, model, tokenizer, dtype=dtype, device=device)
        folder = getattr(getattr(model, "config", None), "_name_or_path", None) if self.model is model else path
        if reason not in ("generate", "none"):
            raise ValueError(f"reason must be 'generate' or 'none', got {reason!r}")
        if max_new_tokens == 0:           # `aftraj eval --max-new-tokens 0`: tier 1 only
            reason = "none"
        reading, self.calibration = read_calibration(folder if folder and Path(folder).expanduser().is_dir() else None)
        thr = threshold if threshold is not None else decision_threshold
        if thr is None:
            thr = self.calibration["threshold"] if self.calibration else 0.0
        if not math.isfinite(thr):
            raise ValueError(f"threshold must be a finite number, got {thr}")
        self.threshold, self.reason = float(thr), reason
        self.uncalibrated = threshold is None and decision_threshold is None and self.calibration is None
        self.bounds = {"max_tokens": max_tokens or reading.get("max_tokens"),
                       "max_step_tokens": max_step_tokens or reading.get("max_step_tokens"),
                       "keep_tokens": keep_tokens if keep_tokens is not None else reading.get("keep_tokens", 0)}
        if self.bounds["max_tokens"] is None:
            self.bounds["max_tokens"] = context_length(self.model, self.tok)
        self.decisions = step_decision_ids(self.tok)
        if reading.get("decision_ids") and tuple(reading["decision_ids"]) != self.decisions:
            raise ValueError(f"{folder}: steps_reading.json's decision ids {reading['decision_ids']} are not this "
                             f"tokenizer's {list(self.decisions)}")
        # the precision the calibration's scores were computed in, unless told otherwise
        self.mixed_precision = mixed_precision or reading.get("mixed_precision", "no")
        if self.mixed_precision not in ("no", "bf16", "auto"):
            raise ValueError(f"mixed_precision must be 'no', 'bf16' or 'auto', got {self.mixed_precision!r}")
        # the reason's budget: at most `reason_max_new_tokens`, and at most the walk's
        # `max_new_tokens` (`aftraj eval --max-new-tokens`) when it is given
        self.reason_max_new_tokens = min(reason_max_new_tokens, max_new_tokens or reason_max_new_tokens)
        self.device = next(self.model.parameters()).device
        self.head = decision_head(self.model, self.decisions)
        if path is not None and model is None or isinstance(model, (str, Path)):
            # a model this auditor loaded (no one else runs it): under bf16 autocast its decoder's
            # linear weights are cast to bf16 at every forward; stored in bf16 once they are the
            # same numbers (autocast's cast is the same rounding), without the per-event cast
            bf16_linears(self.model, self.mixed_precision, self.device)
        self.sessions: dict[str, _Session] = {}
        self._reasoner = None

    @property
    def label(self) -> str:
        base = super().label
        return base + " (uncalibrated: threshold 0)" if self.uncalibrated else base

    # --------------------------------------------------------------- scores
    def _feed(self, s: _Session, ids: list[int], restarted: bool) -> tuple[float, int]:
        """Feed `ids` (a new segment's whole ids when `restarted`) onto the session's cache; returns
        (step's log-odds, tokens of the segment that were already in the cache)."""
        import torch

        if restarted:
            n_open = len(s.reading.opening)
            if s.cache is not None and s.fed >= n_open:        # a new segment: the opening's KV is kept
                if s.fed > n_open:
                    s.cache.crop(n_open - s.fed)
                s.fed, ids = n_open, ids[n_open:]
            else:
                s.cache, s.fed = new_cache(self.model.config), 0
        # the step's tokens padded to a multiple of FEED_BUCKET (the pads after the tag change
        # nothing before it, and leave the cache at once): oneDNN keeps what it builds for every
        # bf16 matrix shape, so a gateway fed every step length would grow without end
        n, pad = len(ids), -len(ids) % FEED_BUCKET
        x = torch.tensor([ids + ids[-1:] * pad], dtype=torch.long, device=self.device)
        pos = torch.arange(s.fed, s.fed + n + pad, device=self.device)[None]
        reused = s.fed
        if self.head is not None:       # the two decision rows of the head, not the vocabulary's
            out = self.head.decoder(input_ids=x, position_ids=pos, **past(self.model, s.cache), use_cache=True)
            score = self.head.log_odds(out.last_hidden_state[0, n - 1:n])
        else:
            out = self.model(input_ids=x, position_ids=pos, **past(self.model, s.cache), use_cache=True,
                             logits_to_keep=torch.tensor([n - 1], device=self.device))
            lp = torch.log_softmax(out.logits[0, -1].float(), -1)
            score = float(lp[self.decisions[1]] - lp[self.decisions[0]])
        if pad:
            s.cache.crop(-pad)
        s.fed += n
        return score, reused

    def scores(self, traj, t: int) -> tuple[list[float], int, int]:
        """The log-odds of steps 0..t (feeding the steps not fed yet), the tokens of t's segment
        up to its tag, and how many of those were already in the cache."""
        import torch

        s = self.sessions.get(traj.id)
        if s is None or len(s.scores) > t + 1:
            s = self.sessions[traj.id] = _Session(StepReading(self.tok, traj, **self.bounds))
        cached = s.fed
        with (torch.inference_mode(), autocast(self.mixed_precision, self.device),
              masked_gqa(self.device.type == "cpu")):
            while len(s.scores) <= t:
                ids, restarted = s.reading.add(traj.steps[len(s.scores)])
                score, reused = self._feed(s, ids, restarted)
                s.scores.append(score)
                if restarted:               # what the new segment took from the cache: the opening, or nothing
                    cached = reused
        return s.scores[: t + 1], s.fed, cached

    def audit(self, traj, t) -> AuditResult:
        t0 = time.perf_counter()
        lo, n_prompt, cached = self.scores(traj, t)
        v = lo[t] + offset_of(self.calibration, traj, t)
        p = 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, v))))
        completion, raw = 0, None
        if v >= self.threshold:
            reason, raw, completion = self._reason(traj, t, v)
            verdict = Verdict("UNSAFE", step=t, agent=traj.steps[t].agent, reason=reason, confidence=p)
        else:
            verdict = Verdict("SAFE", confidence=p)
        return AuditResult(verdict, t=t, confidence=p, latency_s=time.perf_counter() - t0,
                           prompt_tokens=n_prompt, cached_tokens=cached, completion_tokens=completion,
                           raw=raw, decision_log_odds=lo[t])

    # --------------------------------------------------------------- tier 2
    def _reason(self, traj, t: int, v: float) -> tuple[str, str | None, int]:
        """The reason of an ALARM at step t: the generative path's full verdict on the normal
        prompt for prefix t (the ALARM side forced at its decision token), its reason when it gave
        one, else its text; with `reason: none`, the score."""
        fallback = f"step-scored log-odds {v:.3f} >= threshold {self.threshold:.3f} at step {t}"
        if self.reason == "none":
            return fallback, None, 0
        if self._reasoner is None:
            from eval.auditors.hf import HFAuditor

            self._reasoner = HFAuditor(model=self.model, tokenizer=self.tok, batch_size=1,
                                       max_new_tokens=self.reason_max_new_tokens, decision_threshold=-1e9,
                                       layout=self.layout, mixed_precision=self.mixed_precision)
        r = self._reasoner.audit(traj, t)
        self._reasoner.end(traj)
        got = r.verdict.reason if isinstance(r.verdict, Verdict) and r.verdict.reason else None
        text = (r.raw or "").strip()
        return (got or (text[:500] if text else fallback)), r.raw, r.completion_tokens

    def end(self, traj) -> None:
        self.sessions.pop(traj.id, None)

    def close(self) -> None:
        self.sessions.clear()
