"""`hf`: an in-process transformers model from a local folder (or `builtin:NAME`), with KV-cache
reuse along a walk, batched rounds and drafts.

    aftraj eval --auditor hf --model runs/stage1/final --data heldout.jsonl --out runs/eval-hf

This module is the auditor: it turns prefix t of a trajectory into token ids (the contract's
prompt, `aftraj.prompt.render_prompt`, under the one prompt budget; the stable part's length; the
decision tokens; the drafts) and a completion back into an `AuditResult` (the parsed verdict,
P(UNSAFE), token counts). The decoding itself, with a KV cache per live trajectory reused from
prefix to prefix, batched rounds and drafts verified in one forward, is the engine
`eval.decoding.Decoder`; the transformers patches it runs with are `eval.hf_compat`
(version-guarded). Greedy decoding on the reused cache gives the tokens of re-encoding each prefix
from scratch (`reuse_cache=False`), batched rounds those of one prefix at a time, drafts those of
plain greedy decoding; the tests assert each token for token in float32 on CPU.

Options: `batch_size` (CLI `--max-in-flight N`, default 16; 1 keeps one call at a time) is how many
walks the walker interleaves, each round decoded together; `max_batch_tokens` caps a round's
stacked cache; `lookahead` lets a round hold several prefixes of one trajectory (`eval.walker`).
`draft_tokens` (CLI `--draft-tokens`, default 64; 0 turns drafts off): a trained auditor mostly
writes one of two canonical completions, the prefix's SAFE one or its ALARM at the last step
(`drafts`), which the engine verifies as drafts (`benchmarks/walk_cost.py --compare-drafts`
prints the ratio).

Without `budget`, the prompt budget is `aftraj.tokens.prompt_budget` (the one rule: stage 1 and
stage 2 use it) of the model's context (`context_length`: config max_position_embeddings, else a
real tokenizer model_max_length) less max_new_tokens, so a long prefix gets the bounded view
(coverage stamped) instead of silently passing the context; a prompt that still cannot fit is an
error naming the trajectory and prefix.

The folder may hold a full model (`config.json`) or a PEFT adapter (`adapter_config.json`, e.g.
a stage-1 LoRA checkpoint), loaded on top of its base model (`aftraj.models.load_model`, the one
loader). Nothing downloads. Confidence is P(UNSAFE) from the top-k log-probabilities at the
verdict token (`aftraj.confidence`).

The decision token: the canonical SAFE and ALARM completions of a prefix (`aftraj.verdict.
canonical_completion`, the one wording training uses) first differ at one token (for SmolLM2
"Steps" vs "Step" in the reasoning), which comes before the answer and decides it. When a
completion has followed their common start up to there, the engine records the log-odds
log p(ALARM token) - log p(SAFE token) (`AuditResult.decision_log_odds`, per prefix in the walk's
trace). `decision_threshold` (CLI `--decision-threshold`) then makes the choice there: the ALARM
token iff the log-odds >= the threshold, else the SAFE token; greedy before and after. 0 is
greedy between the two; a threshold is tuned on a validation walk with `aftraj eval
tune-threshold` (FAR <= 20 %), never on the test split. `decision_finish="canonical"` (CLI
`--decision-finish canonical`) writes the rest of the completion as the canonical completion of
the side chosen at the decision token (SAFE, or ALARM at step t blaming step t's agent): for a row
trained on the decision token only (`aftraj train prefixes`), whose own text after that token is
untrained (docs/design.md §8 gives what it wrote); "model", the default, keeps the model's text.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from aftraj.confidence import p_unsafe_at, verdict_position
from aftraj.models import load_model_and_tokenizer
from aftraj.prompt import render_prompt
from aftraj.tokens import (TEMPLATE_MARGIN, chat_prompt_text, completion_ids, count_tokens, first_divergence,
                           prompt_budget, text_ids)
from aftraj.verdict import canonical_completion, canonical_verdict, format_completion, parse_verdict
from eval.auditors import AuditResult, Auditor, register_auditor
from eval.decoding import Completion, Decoder, Request, lcp

_SANE_MAX_LENGTH = 10_000_000  # tokenizers without a limit report ~1e30 as model_max_length


def context_length(model, tok) -> int | None:
    """The model's context in tokens: config.max_position_embeddings, else the tokenizer's
    model_max_length when it is a real limit; None when neither says."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(n, int) and n > 0:
        return n
    n = getattr(tok, "model_max_length", None)
    if isinstance(n, int) and 0 < n < _SANE_MAX_LENGTH:
        return n
    return None


def loaded_model(name: str, arg, model, tokenizer, *, dtype: str, device: str | None):
    """(model, tokenizer) of an in-process auditor: the pair given (tests, benchmarks, a reasoner
    sharing a loaded model), else loaded from `model=PATH` or `NAME:PATH`
    (`aftraj.models.load_model_and_tokenizer`: a folder, an adapter or `builtin:NAME`)."""
    path = model if isinstance(model, (str, Path)) else arg
    if tokenizer is not None and model is not None and not isinstance(model, (str, Path)):
        return model, tokenizer
    if path is None:
        raise ValueError(f"{name} auditor needs a model folder: --model PATH (or {name}:PATH)")
    try:
        return load_model_and_tokenizer(path, dtype=dtype, device=device)
    except (FileNotFoundError, ValueError) as e:
        if type(e) not in (FileNotFoundError, ValueError):
            raise
        raise type(e)(f"{name} auditor: {e}") from e


def _check_options(max_new_tokens, batch_size, max_batch_tokens, decision_threshold, draft_tokens,
                   mixed_precision, decision_finish) -> None:
    for key, v in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size),
                   ("max_batch_tokens", max_batch_tokens)):
        if v < 1:
            raise ValueError(f"{key} must be >= 1, got {v}")
    if decision_threshold is not None and not math.isfinite(decision_threshold):
        raise ValueError(f"decision_threshold must be a finite number, got {decision_threshold}")
    if draft_tokens < 0:
        raise ValueError(f"draft_tokens must be >= 0, got {draft_tokens}")
    if mixed_precision not in ("no", "bf16", "auto"):
        raise ValueError(f"mixed_precision must be 'no', 'bf16' or 'auto', got {mixed_precision!r}")
    if decision_finish not in ("model", "canonical"):
        raise ValueError(f"decision_finish must be 'model' or 'canonical', got {decision_finish!r}")


def _engine_attr(name: str) -> property:
    """An attribute the decoding engine holds, read and set through the auditor."""
    return property(lambda self: getattr(self.engine, name), lambda self, v: setattr(self.engine, name, v),
                    doc=f"the engine's `{name}` (eval.decoding.Decoder)")


@register_auditor("hf")
class HFAuditor(Auditor):
    """Arguments: `hf` with `model=PATH` (CLI `--model`), or `hf:PATH`."""

    max_in_flight = 1  # set per instance from `batch_size`

    max_new_tokens = _engine_attr("max_new_tokens")
    draft_tokens = _engine_attr("draft_tokens")
    decision_threshold = _engine_attr("decision_threshold")
    decision_finish = _engine_attr("decision_finish")
    mixed_precision = _engine_attr("mixed_precision")
    eos = _engine_attr("eos")
    device = _engine_attr("device")
    sessions = _engine_attr("sessions")

    def __init__(self, arg: str | None = None, *, model=None, tokenizer=None,
                 max_new_tokens: int = 1024, budget: int | None = None,
                 reference_answer: bool = False, reuse_cache: bool = True, top_k: int = 20,
                 prefill_chunk: int = 2048, dtype: str = "auto", device: str | None = None,
                 batch_size: int = 16, max_batch_tokens: int = 65536,
                 decision_threshold: float | None = None, draft_tokens: int = 64,
                 decision_finish: str = "model", mixed_precision: str = "no", **kw) -> None:
        super().__init__(arg, **kw)
        self.model, self.tok = loaded_model("hf", arg, model, tokenizer, dtype=dtype, device=device)
        _check_options(max_new_tokens, batch_size, max_batch_tokens, decision_threshold, draft_tokens,
                       mixed_precision, decision_finish)
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tok.eos_token_id is not None:
            eos.append(self.tok.eos_token_id)
        self.engine = Decoder(self.model, set(eos), max_new_tokens=max_new_tokens, top_k=top_k,
                              prefill_chunk=prefill_chunk, max_batch_tokens=max_batch_tokens,
                              draft_tokens=draft_tokens, decision_threshold=decision_threshold,
                              decision_finish=decision_finish, mixed_precision=mixed_precision)
        # The walker interleaves at most this many walks; each round is decoded together.
        self.max_in_flight = batch_size if reuse_cache else 1
        self.lookahead = reuse_cache   # a round may hold several prefixes of one trajectory
        self.reference_answer, self.reuse_cache, self.budget = reference_answer, reuse_cache, budget
        self.context = context_length(self.model, self.tok)
        if budget is None and self.context is not None:
            self.budget = self._default_budget()
        self.last_generated: list[int] = []   # token ids of the last completion (tests compare)

    # --------------------------------------------------------------- tokens
    def _default_budget(self) -> int:
        """The prompt budget when none is given: the one rule (`aftraj.tokens.prompt_budget`) for a
        templated prompt of the model's context less the completion."""
        room = self.context - self.max_new_tokens
        if room <= TEMPLATE_MARGIN:
            raise ValueError(f"hf auditor: the model's context ({self.context} tokens) leaves no room "
                             f"for a prompt after max_new_tokens={self.max_new_tokens} and the chat "
                             f"template's margin of {TEMPLATE_MARGIN} tokens; lower --max-new-tokens")
        return prompt_budget(room, self.tok)

    def count_tokens(self, text: str) -> int:
        return count_tokens(self.tok, text)

    def prompt_ids(self, traj, t) -> tuple[list[int], int]:
        """Token ids of prefix t's chat prompt, and how many of them form the stable part."""
        r = render_prompt(traj, t, self.budget, count_tokens=self.count_tokens,
                          reference_answer=self.reference_answer, layout=self.layout)
        text = chat_prompt_text(self.tok, r.messages)
        cut = text.rfind(r.stable + r.suffix)
        if cut < 0:
            raise ValueError("the chat template changed the user message; cannot locate the stable part")
        cut += len(r.stable)
        ids = text_ids(self.tok, text)   # = aftraj.tokens.chat_prompt_ids(self.tok, r.messages)
        if self.context is not None and len(ids) + self.max_new_tokens > self.context:
            raise ValueError(f"hf auditor: prefix t={t} of trajectory {traj.id!r} needs {len(ids)} prompt "
                             f"+ {self.max_new_tokens} new tokens, beyond the model's context of "
                             f"{self.context} (budget={self.budget}); pass a smaller --budget or "
                             f"--max-new-tokens")
        stable = text_ids(self.tok, text[:cut])
        return ids, lcp(ids, stable)

    def drafts(self, traj, t) -> tuple[list[int], list[int]]:
        """The canonical SAFE completion of prefix t and its canonical ALARM (at step t, blaming
        step t's agent), as token ids closed by EOS: the decision token's two sides, and the
        drafts that decoding verifies (`eval.decoding.Decoder.propose`)."""
        return (completion_ids(self.tok, canonical_completion(t))[0],
                completion_ids(self.tok, format_completion(canonical_verdict(t, t, traj.steps[t].agent)))[0])

    def decision_tokens(self, traj, t) -> tuple[list[int], int, int]:
        """(the canonical completions' common start, SAFE's token, ALARM's token) at prefix t's
        decision position, by this tokenizer (ALARM as the canonical alarm at step t)."""
        safe, alarm = self.drafts(traj, t)
        d = first_divergence(safe, alarm)
        if d is None:
            raise ValueError("hf auditor: the canonical SAFE and ALARM completions do not diverge under "
                             "this tokenizer")
        return safe[:d], safe[d], alarm[d]

    def request(self, traj, t) -> Request:
        """Prefix t as the engine's request: prompt ids, stable length, decision tokens (with the
        canonical completions to finish on, under `decision_finish: canonical`) and drafts."""
        t0 = time.perf_counter()
        ids, n_stable = self.prompt_ids(traj, t)
        start, safe, alarm = self.decision_tokens(traj, t)
        dec = (start, safe, alarm, self.drafts(traj, t) if self.decision_finish == "canonical" else None)
        return Request(traj.id, ids, n_stable, dec, self.drafts(traj, t) if self.draft_tokens else (), t0)

    # --------------------------------------------------------------- answers
    def _result(self, t: int, req: Request, c: Completion) -> AuditResult:
        self.last_generated = list(c.gen)
        body = [g for g in c.gen if g not in self.eos]
        text = self.tok.decode(body, skip_special_tokens=False)
        return AuditResult(parse_verdict(text, t), t=t, confidence=self._confidence(c.gen, c.tops),
                           latency_s=time.perf_counter() - c.t0, prompt_tokens=len(req.ids),
                           completion_tokens=len(c.gen), cached_tokens=c.cached, raw=text,
                           decision_log_odds=c.log_odds)

    def audit(self, traj, t) -> AuditResult:
        req = self.request(traj, t)
        return self._result(t, req, self.engine.decode(req, reuse=self.reuse_cache))

    def audit_batch(self, requests):
        """One round of prefixes decoded together (`eval.decoding.Decoder.decode_batch`); several
        prefixes of one trajectory may share it (the walker's lookahead)."""
        if not self.reuse_cache or len(requests) <= 1:
            return [self.audit(traj, t) for traj, t in requests]
        reqs = [self.request(traj, t) for traj, t in requests]
        done = self.engine.decode_batch(reqs)
        return [self._result(t, req, c) for (_, t), req, c in zip(requests, reqs, done, strict=True)]

    def _confidence(self, gen: list[int], tops: list) -> float | None:
        if "answer" not in self.tok.decode(gen):
            return None
        i = verdict_position([self.tok.decode([g]) for g in gen])
        if i is None:
            return None
        vals, idx = tops[i]
        return p_unsafe_at([(self.tok.decode([int(j)]), float(v)) for v, j in zip(vals, idx, strict=True)])

    def end(self, traj) -> None:
        self.engine.end(traj.id)

    def close(self) -> None:
        self.engine.close()
