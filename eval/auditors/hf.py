"""`hf`: an in-process transformers model from a local folder, with KV-cache reuse along a walk.

    aftraj eval --auditor hf --model runs/stage1/final --data heldout.jsonl --out runs/eval-hf

Walking one trajectory, prefix t+1's prompt is prefix t's prompt up to the end of step t, plus
step t+1, plus the short per-prefix suffix (`aftraj.prompt.Rendered.stable` / `suffix`). So the
auditor keeps, per live trajectory, a `DynamicCache` holding exactly the tokens of the stable
part; for each prefix it (1) tokenises the full chat prompt, (2) crops the cache to the longest
common prefix of the cached ids and the new stable ids (normally all of them), (3) extends it
with the new step's tokens in chunks, (4) runs the suffix and greedy decoding on the same cache,
then (5) crops the cache back to the stable part for the next prefix. Auditing all N prefixes
then costs about one pass over the trajectory plus the suffixes and generated tokens, instead of
N growing passes. Greedy decoding on the reused cache gives the same tokens as re-encoding each
prefix from scratch (`reuse_cache=False`, or `model.generate` in benchmarks/walk_cost.py);
the tests assert it token for token in float32 on CPU. In bfloat16 on a GPU, chunked and
one-shot prefill use different kernels, so logits can differ in the last bits and a near-tie
may break the other way: compare on your hardware with benchmarks/walk_cost.py --model PATH.

`audit_batch` (the walker's round: prefixes of up to `batch_size` different trajectories, CLI
`--max-in-flight N`, default 16; 1 keeps one call at a time) brings each trajectory's cache to its
prefix and runs its suffix alone, then decodes the round together: the caches stacked with left
padding, pads masked, explicit position ids per row, greedy, each row stopping at EOS (when a
quarter of the stack has finished, the finished rows leave it); then each cache is cropped back
to its stable part. `max_batch_tokens` caps the stacked cache (rows x (longest prompt +
max_new_tokens)) by splitting a round. A round may also hold several prefixes of one trajectory
(`lookahead`: the walker fills spare rows with live walks' next prefixes, `eval.walker`); they
share the trajectory's cache and keep copies of their suffixes only. The tests assert batched ==
batch 1 token for token in float32 on CPU. On CPU every forward runs under `masked_gqa` (no copy
of the grouped KV heads under a mask).

Without `budget`, the prompt budget is `aftraj.tokens.prompt_budget` (the one rule: stage 1 and
stage 2 use it) of the model's context (`context_length`: config max_position_embeddings, else a
real tokenizer model_max_length) less max_new_tokens, so a long prefix gets the bounded view (coverage stamped) instead of silently
passing the context; a prompt that still cannot fit is an error naming the trajectory and prefix.

Drafts (`draft_tokens`, CLI `--draft-tokens`, default 64; 0 turns them off): a trained auditor
mostly writes one of two canonical completions, the prefix's SAFE one or its ALARM at the last
step (`drafts`). While a completion has followed one of them, each forward feeds the last token
with the draft's next tokens and keeps the run the model's own greedy choices confirm (greedy
speculative decoding with a draft that costs nothing): the tokens are the greedy ones, and the
~50-token SAFE completion takes a few forwards instead of ~50. After a miss the next draft is at
most twice what was kept (`_next_cap`), so a completion that follows neither (an untrained row's
runaway) feeds 2-3 tokens a forward, not 65. In a batched round each row takes its own draft,
padded and masked; the positions a row rejected stay masked. The tests assert
drafted == plain greedy token for token in float32 on CPU (log-odds and confidence to float
rounding: a many-token forward sums in another order); `benchmarks/walk_cost.py --compare-drafts`
prints the ratio.

The folder may hold a full model (`config.json`) or a PEFT adapter (`adapter_config.json`, e.g.
a stage-1 LoRA checkpoint), loaded on top of its base model. Nothing downloads. Confidence is
P(UNSAFE) from the top-k log-probabilities at the verdict token (`aftraj.confidence`).

The decision token: the canonical SAFE and ALARM completions of a prefix (`aftraj.verdict.
canonical_completion`, the one wording training uses) first differ at one token (for SmolLM2
"Steps" vs "Step" in the reasoning), which comes before the answer and decides it. When a
completion has followed their common start up to there, the auditor records the log-odds
log p(ALARM token) - log p(SAFE token) (`AuditResult.decision_log_odds`, per prefix in the walk's
trace). `decision_threshold` (CLI `--decision-threshold`) then makes the choice there: the ALARM
token iff the log-odds >= the threshold, else the SAFE token; greedy before and after. 0 is
greedy between the two; a threshold is tuned on a validation walk with `aftraj eval
tune-threshold` (FAR <= 20 %), never on the test split. `decision_finish="canonical"` (CLI
`--decision-finish canonical`) writes the rest of the completion as the canonical completion of
the side chosen at the decision token (SAFE, or ALARM at step t blaming step t's agent): for a row
trained on the decision token only (`aftraj train prefixes`), whose text after that token is
untrained (on 48 test runs, all 13 threshold-forced ALARM tokens ended in a SAFE answer or broken
JSON under "model", the default).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from aftraj.confidence import p_unsafe_at, verdict_position
from aftraj.prompt import render_prompt
from aftraj.scoring import autocast
from aftraj.tokens import (TEMPLATE_MARGIN, chat_prompt_text, completion_ids, count_tokens, first_divergence,
                           prompt_budget, text_ids)
from aftraj.verdict import canonical_completion, canonical_verdict, format_completion, parse_verdict
from eval.auditors import AuditResult, Auditor, register_auditor


@dataclass
class _Session:
    ids: list[int] = field(default_factory=list)   # token ids held by `cache`
    cache: object | None = None


@dataclass
class _Row:
    """One prefix of a batched round, prepared: its trajectory's session (whose cache holds the
    prompt, or, with `suffix_kv`, its first n_stable tokens), the prompt ids, the suffix's last
    logits, the decision tokens and the drafts."""
    traj: object
    t: int
    session: _Session
    ids: list[int]
    n_stable: int
    cached: int
    logits: object
    t0: float
    dec: tuple
    drafts: tuple
    suffix_kv: list | None = None   # per layer (keys, values) of the suffix, when a later row shares the cache


@functools.cache
def _slack_layer_class():
    from transformers.cache_utils import DynamicLayer

    class SlackLayer(DynamicLayer):
        """A DynamicLayer that appends into spare room of a larger buffer (keys and values are views
        of its first n positions) instead of concatenating: DynamicLayer copies the whole cache at
        every decoded token, ~30 % of a CPU walk's time with 4 rows of ~2k tokens (profiled
        2026-11-30). Room grows by an eighth (at least 256 positions); crop keeps the buffer."""

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, new = self.get_seq_length(), key_states.shape[-2]
            buf = getattr(self, "_buf", None)
            linked = (buf is not None and n > 0 and self.keys.data_ptr() == buf[0].data_ptr()
                      and buf[0].shape[:2] == key_states.shape[:2] and n + new <= buf[0].shape[2])
            if not linked:
                cap = n + new + max(256, (n + new) // 8)
                shape = (*key_states.shape[:2], cap)
                kb = key_states.new_empty((*shape, key_states.shape[-1]))
                vb = value_states.new_empty((*shape, value_states.shape[-1]))
                if n:
                    kb[:, :, :n] = self.keys
                    vb[:, :, :n] = self.values
                buf = self._buf = (kb, vb)
            buf[0][:, :, n:n + new] = key_states
            buf[1][:, :, n:n + new] = value_states
            self.keys, self.values = buf[0][:, :, :n + new], buf[1][:, :, :n + new]
            return self.keys, self.values

    return SlackLayer


def new_cache(config):
    """A DynamicCache for `config` whose full-attention layers append in place (SlackLayer);
    other layer kinds (sliding windows) keep transformers' own classes."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    cache.layers = [_slack_layer_class()() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


_MIN_DRAFT = 2   # the shortest draft `_next_cap` falls back to after a miss


@contextlib.contextmanager
def masked_gqa(enabled: bool = True):
    """Let PyTorch's SDPA take grouped KV heads under an attention mask for the block.

    transformers' SDPA attention (5.x, `integrations.sdpa_attention`) repeats a grouped-query
    model's KV heads, a copy of the whole stacked cache per layer and forward, whenever an
    attention mask comes with more than one query token, unless `TRANSFORMERS_SDPA_FORCE_GQA=1`
    (read at every call by `use_gqa_in_sdpa`); PyTorch's CPU kernel takes the mask with
    `enable_gqa`. The walk is that case throughout: a step or a suffix fed onto a cache, a draft
    verified, a batched round. On 2 CPU cores, SmolLM2 (9 query, 3 KV heads), 10 stacked rows at a
    3,600-token cache, a 3-token forward took 2.5 s with the copy and 0.39 s without; one row, 16
    tokens, 140 vs 110 ms (2026-12-03). The auditor sets it only on CPU (a CUDA mask with
    `enable_gqa` would leave the fused kernels for the math one); the value before is restored."""
    if not enabled:
        yield
        return
    key = "TRANSFORMERS_SDPA_FORCE_GQA"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _keep_rows(cache, keep) -> None:
    """Keep only the batch rows `keep` of a stacked cache (finished rows out, so that a long
    completion does not carry the finished ones through every forward), one layer at a time:
    the copy adds one layer's worth of memory, not a second cache."""
    for li, layer in enumerate(cache.layers):
        k, v = layer.keys.index_select(0, keep), layer.values.index_select(0, keep)
        layer.reset()
        cache.update(k, v, li)


def _crop_to(cache, n: int) -> None:
    """Keep the first n positions of `cache` (transformers' `crop` takes how many to remove)."""
    cache.crop(-(cache.get_seq_length() - n))


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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


def load_model(path: str | Path, *, dtype: str = "auto", device: str | None = None):
    """(model, tokenizer) from a local folder: a full model or a PEFT adapter on its base."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"hf auditor: model folder {str(path)!r} does not exist")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    if (p / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch_dtype)
    elif (p / "adapter_config.json").exists():
        from peft import AutoPeftModelForCausalLM

        # local_files_only: an adapter whose base is a hub id must not trigger a download.
        model = AutoPeftModelForCausalLM.from_pretrained(p, dtype=torch_dtype,
                                                         local_files_only=True).merge_and_unload()
    else:
        raise FileNotFoundError(f"hf auditor: {p} holds neither config.json (a model) nor "
                                f"adapter_config.json (a PEFT adapter)")
    try:
        tok = AutoTokenizer.from_pretrained(p)
    except (OSError, ValueError):  # an adapter folder saved without its tokenizer
        base = getattr(getattr(model, "config", None), "_name_or_path", None)
        if not base:
            raise
        tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    if tok.chat_template is None:
        raise ValueError(f"hf auditor: the tokenizer in {p} has no chat template")
    model.to(device).eval()
    return model, tok


@register_auditor("hf")
class HFAuditor(Auditor):
    """Arguments: `hf` with `model=PATH` (CLI `--model`), or `hf:PATH`."""

    max_in_flight = 1  # set per instance from `batch_size`

    def __init__(self, arg: str | None = None, *, model=None, tokenizer=None,
                 max_new_tokens: int = 1024, budget: int | None = None,
                 reference_answer: bool = False, reuse_cache: bool = True, top_k: int = 20,
                 prefill_chunk: int = 2048, dtype: str = "auto", device: str | None = None,
                 batch_size: int = 16, max_batch_tokens: int = 65536,
                 decision_threshold: float | None = None, draft_tokens: int = 64,
                 decision_finish: str = "model", mixed_precision: str = "no", **kw) -> None:
        super().__init__(arg, **kw)
        path = model if isinstance(model, (str, Path)) else arg
        if tokenizer is not None and not isinstance(model, (str, Path)) and model is not None:
            self.model, self.tok = model, tokenizer           # already loaded (tests, benchmarks)
        elif path is not None:
            self.model, self.tok = load_model(path, dtype=dtype, device=device)
        else:
            raise ValueError("hf auditor needs a model folder: --model PATH (or hf:PATH)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if decision_threshold is not None and not math.isfinite(decision_threshold):
            raise ValueError(f"decision_threshold must be a finite number, got {decision_threshold}")
        if draft_tokens < 0:
            raise ValueError(f"draft_tokens must be >= 0, got {draft_tokens}")
        if mixed_precision not in ("no", "bf16", "auto"):
            raise ValueError(f"mixed_precision must be 'no', 'bf16' or 'auto', got {mixed_precision!r}")
        self.mixed_precision = mixed_precision
        if decision_finish not in ("model", "canonical"):
            raise ValueError(f"decision_finish must be 'model' or 'canonical', got {decision_finish!r}")
        self.decision_threshold, self.draft_tokens = decision_threshold, draft_tokens
        self.decision_finish = decision_finish
        self.max_new_tokens, self.budget = max_new_tokens, budget
        # The walker interleaves at most this many walks; each round is decoded together.
        self.max_in_flight = batch_size if reuse_cache else 1
        self.lookahead = reuse_cache   # a round may hold several prefixes of one trajectory
        self.max_batch_tokens = max_batch_tokens
        self.reference_answer, self.reuse_cache = reference_answer, reuse_cache
        self.top_k, self.prefill_chunk = top_k, prefill_chunk
        self.device = next(self.model.parameters()).device
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tok.eos_token_id is not None:
            eos.append(self.tok.eos_token_id)
        self.eos = set(eos)
        self.context = context_length(self.model, self.tok)
        if budget is None and self.context is not None:
            self.budget = self._default_budget()
        self.sessions: dict[str, _Session] = {}
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
        return ids, _lcp(ids, stable)

    # --------------------------------------------------------------- model calls
    def _forward(self, ids: list[int], cache):
        import torch

        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def _extend(self, cache, ids: list[int]):
        logits = None
        for i in range(0, len(ids), self.prefill_chunk):
            logits = self._forward(ids[i:i + self.prefill_chunk], cache)
        return logits

    def _greedy(self, cache, suffix_ids: list[int], dec, drafts=()) -> tuple[list[int], list, float | None]:
        """Greedy decoding on `cache` (the decision token by `_pick`; `drafts` verified as in
        `_propose`); returns the ids, per position the top-k (values, ids), and the decision
        log-odds (None if not reached)."""
        import torch

        rows = self._extend(cache, suffix_ids)[None]    # rows[j]: the next token after gen + prop[:j]
        gen, tops, lo, prop, cap = [], [], [None], [], self.draft_tokens
        while True:
            j, done = self._take(rows, gen, tops, prop, dec, lo)
            if done:
                return gen, tops, lo[0]
            if len(prop) > j:                # the draft's tokens after the first miss: out of the cache
                cache.crop(-(len(prop) - j))
            cap = self._next_cap(cap, prop, j)
            prop = self._propose(gen, drafts, cap)
            x = torch.tensor([[gen[-1], *prop]], dtype=torch.long, device=self.device)
            rows = self.model(input_ids=x, cache=cache, use_cache=True,
                              logits_to_keep=x.shape[1]).logits[0].float()

    def _prepare(self, traj, t, prompt=None):
        """Bring traj's session cache to prefix t's stable part; returns
        (session, prompt ids, n_stable, tokens reused from the cache). `prompt`: `prompt_ids`'
        answer when the caller already has it."""

        ids, n_stable = prompt if prompt is not None else self.prompt_ids(traj, t)
        s = self.sessions.setdefault(traj.id, _Session())
        if s.cache is None:
            s.cache = new_cache(self.model.config)
        common = _lcp(s.ids, ids[:n_stable])
        if common < len(s.ids):
            s.cache.crop(-(len(s.ids) - common))
        self._extend(s.cache, ids[common:n_stable])
        s.ids = ids[:n_stable]
        return s, ids, n_stable, common

    def drafts(self, traj, t) -> tuple[list[int], list[int]]:
        """The canonical SAFE completion of prefix t and its canonical ALARM (at step t, blaming
        step t's agent), as token ids closed by EOS: the decision token's two sides, and the
        drafts that decoding verifies (see `_propose`)."""
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

    def _dec(self, traj, t):
        """(common start, SAFE's token, ALARM's token, (SAFE draft, ALARM draft) or None): what
        `_pick` needs; the drafts only with `decision_finish: canonical`."""
        start, safe, alarm = self.decision_tokens(traj, t)
        return start, safe, alarm, (self.drafts(traj, t) if self.decision_finish == "canonical" else None)

    def _pick(self, logits, gen: list[int], dec, lo: list) -> tuple[int, object]:
        """The next token after `gen`: greedy, except at the decision position of a completion
        that has followed the canonical start (`dec`), where the log-odds are recorded in lo[0]
        and, with `decision_threshold`, decide between the SAFE and the ALARM token. With
        `decision_finish: canonical`, a completion past the decision token follows the canonical
        completion of the side chosen there to its EOS (the verdict the decision token means:
        SAFE, or ALARM at step t blaming step t's agent), whatever the model would write."""
        import torch

        logp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logp, min(self.top_k, logits.shape[-1]))
        nxt = int(torch.argmax(logits))
        start, safe, alarm, finish = dec
        n = len(start)
        if len(gen) == n and gen == start:
            lo[0] = float(logp[alarm] - logp[safe])
            if self.decision_threshold is not None:
                nxt = alarm if lo[0] >= self.decision_threshold else safe
        elif finish is not None and len(gen) > n and gen[:n] == start:
            side = finish[1] if gen[n] == alarm else finish[0] if gen[n] == safe else None
            if side is not None and len(gen) < len(side) and gen == side[:len(gen)]:
                nxt = side[len(gen)]
        return nxt, top

    def _take(self, rows, gen: list[int], tops: list, prop: list[int], dec, lo: list) -> tuple[int, bool]:
        """Consume a forward's predictions: rows[j] follows gen + prop[:j]. Appends the greedy
        token (and its top-k) of each row while it confirms the draft; returns (j, done): the
        last row used (prop[j:] were rejected) and whether the completion ended (EOS or
        max_new_tokens)."""
        for j in range(rows.shape[0]):
            nxt, top = self._pick(rows[j], gen, dec, lo)
            tops.append(top)
            gen.append(nxt)
            if nxt in self.eos or len(gen) >= self.max_new_tokens:
                return j, True
            if j >= len(prop) or nxt != prop[j]:
                return j, False
        return rows.shape[0] - 1, False

    def _next_cap(self, cap: int, prop: list[int], j: int) -> int:
        """The next draft's length cap after a forward that verified `prop` and kept j of its
        tokens: doubled (up to `draft_tokens`) when all were kept, else twice what was kept (at
        least 2). A rejected draft costs a forward as wide as the draft (on 2 CPU cores at a
        3,600-token cache, 65 tokens ~4x one), so a completion that has left both canonical
        completions (a runaway, an untrained row) stops paying for 64-token guesses, and one that
        follows a draft again is back to full length after a few forwards."""
        if not prop:
            return cap
        if j >= len(prop):
            return min(self.draft_tokens, 2 * cap)
        return min(self.draft_tokens, max(_MIN_DRAFT, 2 * j))

    def _propose(self, gen: list[int], drafts, cap: int | None = None) -> list[int]:
        """The tokens a draft expects after `gen` (up to `cap`, default `draft_tokens`, and no
        further than `max_new_tokens` allows): the continuation of the first draft that `gen`
        has followed so far, else of the last place in a draft that holds gen's last 3 tokens,
        else none. Decoding feeds them with the last token in one forward and keeps the longest
        run the model's own choices confirm (greedy speculative decoding: the tokens are the
        greedy ones; the canonical SAFE completion of a trained auditor, ~50 tokens, then costs
        one forward instead of ~50). `_next_cap` shortens the drafts after a miss."""
        room = min(self.draft_tokens if cap is None else cap, self.max_new_tokens - len(gen) - 1)
        if room <= 0:
            return []
        m = len(gen)
        for d in drafts:
            if len(d) > m and d[:m] == gen:
                return d[m:m + room]
        # left both (e.g. "Step 0 to 2 shows no decisive error"): where the last 3 tokens occur
        # in a draft, what follows them there (prompt-lookup style; still verified token by token)
        if m >= 3:
            tail = gen[-3:]
            for d in drafts:
                for i in range(len(d) - 3, -1, -1):
                    if d[i:i + 3] == tail:
                        return d[i + 3:i + 3 + room]
        return []

    def _result(self, t, ids, gen, tops, cached, t0, lo=None) -> AuditResult:
        self.last_generated = [g for g in gen]
        body = [g for g in gen if g not in self.eos]
        text = self.tok.decode(body, skip_special_tokens=False)
        return AuditResult(parse_verdict(text, t), t=t, confidence=self._confidence(gen, tops),
                           latency_s=time.perf_counter() - t0, prompt_tokens=len(ids),
                           completion_tokens=len(gen), cached_tokens=cached, raw=text,
                           decision_log_odds=lo)

    def audit(self, traj, t) -> AuditResult:
        import torch

        t0 = time.perf_counter()
        with (torch.inference_mode(), autocast(self.mixed_precision, self.device),
              masked_gqa(self.device.type == "cpu")):
            dec = self._dec(traj, t)
            drafts = self.drafts(traj, t) if self.draft_tokens else ()
            if self.reuse_cache:
                s, ids, n_stable, cached = self._prepare(traj, t)
                gen, tops, lo = self._greedy(s.cache, ids[n_stable:], dec, drafts)
                _crop_to(s.cache, n_stable)
            else:
                ids, n_stable = self.prompt_ids(traj, t)
                gen, tops, lo = self._greedy(new_cache(self.model.config), ids, dec, drafts)
                cached = 0
        return self._result(t, ids, gen, tops, cached, t0, lo)

    # --------------------------------------------------------------- batched rounds
    def audit_batch(self, requests):
        """One round of prefixes: each trajectory's cache is brought to its prefix and runs its
        suffix alone, then the round decodes together (caches stacked with left padding, pads
        masked, each row at its own positions), split so that no stacked batch holds more than
        `max_batch_tokens` cache tokens.

        A round may hold several prefixes of one trajectory (the walker's lookahead,
        `lookahead`): they are prepared in order on the trajectory's one cache; a row that is not
        its trajectory's last in the round keeps a copy of its suffix's keys and values only and
        is stacked from the cache's first n_stable positions (which the later rows extend, never
        rewrite) plus that copy. If a later prefix's prompt does not extend an earlier row's
        stable part (a bounded view that recompiled), the rows gathered so far are decoded first."""
        import torch

        if not self.reuse_cache or len(requests) <= 1:
            return [self.audit(traj, t) for traj, t in requests]
        last = {traj.id: i for i, (traj, _) in enumerate(requests)}
        results = []
        with (torch.inference_mode(), autocast(self.mixed_precision, self.device),
              masked_gqa(self.device.type == "cpu")):
            group: list[_Row] = []
            for i, (traj, t) in enumerate(requests):
                t0 = time.perf_counter()
                ids, n_stable = self.prompt_ids(traj, t)
                s = self.sessions.get(traj.id)
                kept = _lcp(s.ids, ids[:n_stable]) if s is not None else 0   # what _prepare will keep
                if any(r.session is s and r.n_stable > kept for r in group):
                    results += self._decode_group(group)
                    group = []
                s, ids, n_stable, cached = self._prepare(traj, t, (ids, n_stable))
                logits = self._extend(s.cache, ids[n_stable:])     # the suffix, alone
                suffix_kv = None
                if last[traj.id] != i:          # a later prefix of this trajectory follows in the round
                    suffix_kv = [(layer.keys[:, :, n_stable:].clone(), layer.values[:, :, n_stable:].clone())
                                 for layer in s.cache.layers]
                    _crop_to(s.cache, n_stable)
                row = _Row(traj, t, s, ids, n_stable, cached, logits, t0, self._dec(traj, t),
                           self.drafts(traj, t) if self.draft_tokens else (), suffix_kv)
                longest = max([len(r.ids) for r in group] + [len(ids)]) + self.max_new_tokens
                if group and longest * (len(group) + 1) > self.max_batch_tokens:
                    results += self._decode_group(group)
                    group = []
                group.append(row)
            results += self._decode_group(group)
        return results

    def _decode_group(self, group: list[_Row]) -> list[AuditResult]:
        """Decode a round's rows together: their caches stacked with left padding (pads masked),
        each row at its own positions. With drafts (`_propose`), a forward feeds each row its
        last token and its draft's next tokens (rows padded to the longest, padding masked);
        each row keeps the run its own greedy choices confirm, and the positions it rejected
        are masked from then on."""
        import torch

        if not group:
            return []
        gens, topss, done, los = [], [], [], [[None] for _ in group]
        for row, lo in zip(group, los):
            nxt, top = self._pick(row.logits, [], row.dec, lo)
            gens.append([nxt])
            topss.append([top])
            done.append(nxt in self.eos or self.max_new_tokens <= 1)
        lengths = [len(r.ids) for r in group]         # each row's whole prompt
        width = max(lengths)
        n_layers = len(group[0].session.cache.layers)
        stacked = new_cache(self.model.config)
        for li in range(n_layers):
            ks, vs = [], []
            for row, n in zip(group, lengths):
                layer = row.session.cache.layers[li]
                if row.suffix_kv is None:             # the trajectory's cache holds this prompt
                    k, v = layer.keys, layer.values
                else:                                 # its stable part, then its own suffix
                    sk, sv = row.suffix_kv[li]
                    k = torch.cat([layer.keys[:, :, :row.n_stable], sk], 2)
                    v = torch.cat([layer.values[:, :, :row.n_stable], sv], 2)
                pad = width - n
                ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            stacked.update(torch.cat(ks), torch.cat(vs), li)
        mask = torch.zeros(len(group), width, dtype=torch.long, device=self.device)
        for i, n in enumerate(lengths):
            mask[i, width - n:] = 1
        fed = list(lengths)                           # each row's valid positions in the stacked cache
        caps = [self.draft_tokens] * len(group)
        live = list(range(len(group)))                # the rows still decoding, in stacked order
        pad_id = next(iter(self.eos))
        while True:
            live_now = [i for i in live if not done[i]]
            if not live_now:
                break
            if 4 * len(live_now) <= 3 * len(live):   # a quarter of the stack has finished: drop it
                keep = torch.tensor([k for k, i in enumerate(live) if not done[i]], device=self.device)
                _keep_rows(stacked, keep)
                mask = mask.index_select(0, keep)
                live = live_now
            props = [self._propose(gens[i], group[i].drafts, caps[i]) if not done[i] else [] for i in live]
            width_new = 1 + max(len(p) for p in props)
            x = torch.full((len(live), width_new), pad_id, dtype=torch.long, device=self.device)
            new_mask = torch.zeros(len(live), width_new, dtype=torch.long, device=self.device)
            pos = torch.zeros(len(live), width_new, dtype=torch.long, device=self.device)
            for k, (i, p) in enumerate(zip(live, props)):
                x[k, :1 + len(p)] = torch.tensor([gens[i][-1], *p])
                if not done[i]:
                    new_mask[k, :1 + len(p)] = 1
                pos[k] = torch.arange(fed[i], fed[i] + width_new)
            col = mask.shape[1]
            mask = torch.cat([mask, new_mask], 1)
            out = self.model(input_ids=x, cache=stacked, attention_mask=mask, position_ids=pos,
                             use_cache=True, logits_to_keep=width_new)
            logits = out.logits.float()
            for k, (i, p) in enumerate(zip(live, props)):
                if done[i]:
                    continue
                j, done[i] = self._take(logits[k, :1 + len(p)], gens[i], topss[i], p, group[i].dec, los[i])
                mask[k, col + 1 + j:] = 0                # the draft's tokens after the first miss
                fed[i] += 1 + j
                caps[i] = self._next_cap(caps[i], p, j)
        del stacked
        results = []
        for row, gen, tops, lo in zip(group, gens, topss, los):
            if row.suffix_kv is None:                 # the suffix out: the cache holds the stable part
                _crop_to(row.session.cache, row.n_stable)
            results.append(self._result(row.t, row.ids, gen, tops, row.cached, row.t0, lo[0]))
        return results

    def _confidence(self, gen: list[int], tops: list) -> float | None:
        if "answer" not in self.tok.decode(gen):
            return None
        i = verdict_position([self.tok.decode([g]) for g in gen])
        if i is None:
            return None
        vals, idx = tops[i]
        return p_unsafe_at([(self.tok.decode([int(j)]), float(v)) for v, j in zip(vals, idx)])

    def end(self, traj) -> None:
        self.sessions.pop(traj.id, None)

    def close(self) -> None:
        self.sessions.clear()
