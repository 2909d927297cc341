"""The decoding engine behind the `hf` auditor (`eval.auditors.hf`): per-trajectory KV caches
reused along a walk, batched rounds, drafts verified in one forward, the decision token.

The auditor turns a prefix into token ids (its prompt, the stable part's length, the decision
tokens, the drafts: a `Request`); the engine knows nothing of trajectories beyond a session key
and answers a `Completion` (the greedy tokens, their top-k, the decision log-odds, the prompt
tokens it reused).

KV reuse: prefix t+1's prompt is prefix t's prompt up to the end of step t, plus step t+1, plus
the short per-prefix suffix (`aftraj.prompt.Rendered.stable` / `suffix`). A `Session` keeps a
cache holding exactly the tokens of the stable part; for each prefix the engine (1) crops the
cache to the longest common prefix of the cached ids and the new stable ids (normally all of
them), (2) extends it with the new step's tokens in chunks (`prefill_chunk`), (3) runs the suffix
and greedy decoding on the same cache, then (4) crops the cache back to the stable part. All N
prefixes of a walk then cost about one pass over the trajectory plus the suffixes and generated
tokens, instead of N growing passes, with the tokens of re-encoding each prefix from scratch
(`decode(req, reuse=False)`; the tests assert it in float32 on CPU; in bfloat16 on a GPU chunked
and one-shot prefill use different kernels, so a near-tie may break the other way:
benchmarks/walk_cost.py --model PATH compares on your hardware).

Batched rounds (`decode_batch`): each request's cache is brought to its prefix and runs its suffix
alone; then the round decodes together: the caches stacked with left padding, pads masked,
explicit position ids per row, greedy, each row stopping at EOS (when a quarter of the stack has
finished, the finished rows leave it); each cache is then cropped back to its stable part.
`max_batch_tokens` caps the stacked cache (rows x (longest prompt + max_new_tokens)) by splitting
a round. Several requests of one session may share a round (the walker's lookahead): they keep
copies of their suffixes only. The tests assert batched == one at a time token for token.

Drafts (`draft_tokens`; 0 turns them off): a trained auditor mostly writes one of two canonical
completions, the prefix's SAFE one or its ALARM at the last step. While a completion has followed
one of them, each forward feeds the last token with the draft's next tokens and keeps the run the
model's own greedy choices confirm (greedy speculative decoding with a draft that costs nothing):
the tokens are the greedy ones, and a ~50-token SAFE completion takes a few forwards. After a miss
the next draft is at most twice what was kept (`next_cap`). In a batched round each row takes its
own draft, padded and masked; the positions a row rejected stay masked.

The decision token (`pick`): where a completion has followed the canonical completions' common
start up to the token at which they part, the engine records log p(ALARM token) - log p(SAFE
token); with `decision_threshold` that choice is made there (ALARM iff the log-odds >= it), and
with `decision_finish="canonical"` the rest of the completion is the canonical completion of the
side chosen. Every forward runs under `eval.hf_compat.masked_gqa` on CPU and the caches are
`eval.hf_compat.new_cache` (transformers patches, version-guarded there).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from aftraj.scoring import autocast
from eval.hf_compat import crop_to, keep_rows, masked_gqa, new_cache

MIN_DRAFT = 2   # the shortest draft `next_cap` falls back to after a miss


@dataclass
class Session:
    ids: list[int] = field(default_factory=list)   # token ids held by `cache`
    cache: object | None = None


@dataclass
class Request:
    """One prefix to decode: its session's key (the trajectory), its prompt ids, how many of them
    form the stable part, the decision tokens `(common start, SAFE token, ALARM token, (SAFE
    draft, ALARM draft) or None)` and the drafts to verify."""
    key: str
    ids: list[int]
    n_stable: int
    dec: tuple
    drafts: tuple = ()
    t0: float = field(default_factory=time.perf_counter)


@dataclass
class Completion:
    """The engine's answer to a `Request`: the generated ids, per position the top-k (values,
    ids), the decision log-odds (None if not reached), prompt tokens reused from the cache."""
    gen: list[int]
    tops: list
    log_odds: float | None
    cached: int
    t0: float


@dataclass
class _Row:
    """A request of a batched round, prepared: its session (whose cache holds the prompt, or,
    with `suffix_kv`, its first n_stable tokens), the suffix's last logits."""
    req: Request
    session: Session
    cached: int
    logits: object
    suffix_kv: list | None = None   # per layer (keys, values) of the suffix, when a later row shares the cache


def lcp(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Decoder:
    """Greedy decoding of a causal LM with per-session KV caches, batched rounds and drafts."""

    def __init__(self, model, eos: set[int], *, max_new_tokens: int = 1024, top_k: int = 20,
                 prefill_chunk: int = 2048, max_batch_tokens: int = 65536, draft_tokens: int = 64,
                 decision_threshold: float | None = None, decision_finish: str = "model",
                 mixed_precision: str = "no") -> None:
        self.model, self.eos = model, eos
        self.max_new_tokens, self.top_k, self.prefill_chunk = max_new_tokens, top_k, prefill_chunk
        self.max_batch_tokens, self.draft_tokens = max_batch_tokens, draft_tokens
        self.decision_threshold, self.decision_finish = decision_threshold, decision_finish
        self.mixed_precision = mixed_precision
        self.device = next(model.parameters()).device
        self.sessions: dict[str, Session] = {}

    @contextlib.contextmanager
    def running(self):
        """The context every forward runs in: no autograd, the autocast asked for, masked GQA on CPU."""
        import torch

        with (torch.inference_mode(), autocast(self.mixed_precision, self.device),
              masked_gqa(self.device.type == "cpu")):
            yield

    def end(self, key: str) -> None:
        self.sessions.pop(key, None)

    def close(self) -> None:
        self.sessions.clear()

    # --------------------------------------------------------------- one request
    def decode(self, req: Request, *, reuse: bool = True) -> Completion:
        """Decode one request, on its session's cache (`reuse`) or on a fresh cache."""
        with self.running():
            if reuse:
                s, cached = self.prepare(req)
                gen, tops, lo = self.greedy(s.cache, req.ids[req.n_stable:], req.dec, req.drafts)
                crop_to(s.cache, req.n_stable)
            else:
                gen, tops, lo = self.greedy(new_cache(self.model.config), req.ids, req.dec, req.drafts)
                cached = 0
        return Completion(gen, tops, lo, cached, req.t0)

    def forward(self, ids: list[int], cache):
        import torch

        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def extend(self, cache, ids: list[int]):
        """Feed `ids` onto `cache` in chunks of `prefill_chunk`; the last position's logits."""
        logits = None
        for i in range(0, len(ids), self.prefill_chunk):
            logits = self.forward(ids[i:i + self.prefill_chunk], cache)
        return logits

    def prepare(self, req: Request) -> tuple[Session, int]:
        """Bring the request's session cache to its stable part; returns (session, tokens reused)."""
        ids, n_stable = req.ids, req.n_stable
        s = self.sessions.setdefault(req.key, Session())
        if s.cache is None:
            s.cache = new_cache(self.model.config)
        common = lcp(s.ids, ids[:n_stable])
        if common < len(s.ids):
            s.cache.crop(-(len(s.ids) - common))
        self.extend(s.cache, ids[common:n_stable])
        s.ids = ids[:n_stable]
        return s, common

    def greedy(self, cache, suffix_ids: list[int], dec, drafts=()) -> tuple[list[int], list, float | None]:
        """Greedy decoding on `cache` (the decision token by `pick`; `drafts` verified as in
        `propose`); returns the ids, per position the top-k (values, ids), and the decision
        log-odds (None if not reached)."""
        import torch

        rows = self.extend(cache, suffix_ids)[None]    # rows[j]: the next token after gen + prop[:j]
        gen, tops, lo, prop, cap = [], [], [None], [], self.draft_tokens
        while True:
            j, done = self.take(rows, gen, tops, prop, dec, lo)
            if done:
                return gen, tops, lo[0]
            if len(prop) > j:                # the draft's tokens after the first miss: out of the cache
                cache.crop(-(len(prop) - j))
            cap = self.next_cap(cap, prop, j)
            prop = self.propose(gen, drafts, cap)
            x = torch.tensor([[gen[-1], *prop]], dtype=torch.long, device=self.device)
            rows = self.model(input_ids=x, cache=cache, use_cache=True,
                              logits_to_keep=x.shape[1]).logits[0].float()

    # --------------------------------------------------------------- the decision token and drafts
    def pick(self, logits, gen: list[int], dec, lo: list) -> tuple[int, object]:
        """The next token after `gen`: greedy, except at the decision position of a completion
        that has followed the canonical start (`dec`), where the log-odds are recorded in lo[0]
        and, with `decision_threshold`, decide between the SAFE and the ALARM token. With
        `decision_finish: canonical`, a completion past the decision token follows the canonical
        completion of the side chosen there to its EOS, whatever the model would write."""
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

    def take(self, rows, gen: list[int], tops: list, prop: list[int], dec, lo: list) -> tuple[int, bool]:
        """Consume a forward's predictions: rows[j] follows gen + prop[:j]. Appends the greedy
        token (and its top-k) of each row while it confirms the draft; returns (j, done): the
        last row used (prop[j:] were rejected) and whether the completion ended (EOS or
        max_new_tokens)."""
        for j in range(rows.shape[0]):
            nxt, top = self.pick(rows[j], gen, dec, lo)
            tops.append(top)
            gen.append(nxt)
            if nxt in self.eos or len(gen) >= self.max_new_tokens:
                return j, True
            if j >= len(prop) or nxt != prop[j]:
                return j, False
        return rows.shape[0] - 1, False

    def next_cap(self, cap: int, prop: list[int], j: int) -> int:
        """The next draft's length cap after a forward that verified `prop` and kept j of its
        tokens: doubled (up to `draft_tokens`) when all were kept, else twice what was kept (at
        least 2). A rejected draft costs a forward as wide as the draft, so a completion that has
        left both canonical completions (a runaway, an untrained row) stops paying for 64-token
        guesses, and one that follows a draft again is back to full length after a few forwards."""
        if not prop:
            return cap
        if j >= len(prop):
            return min(self.draft_tokens, 2 * cap)
        return min(self.draft_tokens, max(MIN_DRAFT, 2 * j))

    def propose(self, gen: list[int], drafts, cap: int | None = None) -> list[int]:
        """The tokens a draft expects after `gen` (up to `cap`, default `draft_tokens`, and no
        further than `max_new_tokens` allows): the continuation of the first draft that `gen`
        has followed so far, else of the last place in a draft that holds gen's last 3 tokens,
        else none. Decoding feeds them with the last token in one forward and keeps the longest
        run the model's own choices confirm (the tokens are the greedy ones)."""
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

    # --------------------------------------------------------------- batched rounds
    def decode_batch(self, reqs: list[Request]) -> list[Completion]:
        """One round: each request's cache is brought to its prefix and runs its suffix alone,
        then the round decodes together, split so that no stacked batch holds more than
        `max_batch_tokens` cache tokens. A request that is not its session's last in the round
        keeps a copy of its suffix's keys and values only and is stacked from the cache's first
        n_stable positions (which the later rows extend, never rewrite) plus that copy. If a later
        request's prompt does not extend an earlier row's stable part (a bounded view that
        recompiled), the rows gathered so far are decoded first."""
        last = {req.key: i for i, req in enumerate(reqs)}
        results: list[Completion] = []
        with self.running():
            group: list[_Row] = []
            for i, req in enumerate(reqs):
                s = self.sessions.get(req.key)
                kept = lcp(s.ids, req.ids[:req.n_stable]) if s is not None else 0   # what prepare will keep
                if any(r.session is s and r.req.n_stable > kept for r in group):
                    results += self._decode_group(group)
                    group = []
                row = self._prepared_row(req, keep_suffix=last[req.key] != i)
                longest = max([len(r.req.ids) for r in group] + [len(req.ids)]) + self.max_new_tokens
                if group and longest * (len(group) + 1) > self.max_batch_tokens:
                    results += self._decode_group(group)
                    group = []
                group.append(row)
            results += self._decode_group(group)
        return results

    def _prepared_row(self, req: Request, keep_suffix: bool) -> _Row:
        """The request's session brought to its prefix and its suffix run alone; with
        `keep_suffix` (a later request of the session follows in the round) the suffix's keys and
        values are copied out and the cache cropped back to the stable part."""
        s, cached = self.prepare(req)
        logits = self.extend(s.cache, req.ids[req.n_stable:])     # the suffix, alone
        suffix_kv = None
        if keep_suffix:
            n = req.n_stable
            suffix_kv = [(layer.keys[:, :, n:].clone(), layer.values[:, :, n:].clone()) for layer in s.cache.layers]
            crop_to(s.cache, n)
        return _Row(req, s, cached, logits, suffix_kv)

    def _stack(self, group: list[_Row]):
        """The rows' caches stacked with left padding into one cache, and its attention mask."""
        import torch

        lengths = [len(r.req.ids) for r in group]         # each row's whole prompt
        width = max(lengths)
        stacked = new_cache(self.model.config)
        for li in range(len(group[0].session.cache.layers)):
            ks, vs = [], []
            for row, n in zip(group, lengths, strict=True):
                layer = row.session.cache.layers[li]
                if row.suffix_kv is None:             # the session's cache holds this prompt
                    k, v = layer.keys, layer.values
                else:                                 # its stable part, then its own suffix
                    sk, sv = row.suffix_kv[li]
                    k = torch.cat([layer.keys[:, :, :row.req.n_stable], sk], 2)
                    v = torch.cat([layer.values[:, :, :row.req.n_stable], sv], 2)
                pad = width - n
                ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            stacked.update(torch.cat(ks), torch.cat(vs), li)
        mask = torch.zeros(len(group), width, dtype=torch.long, device=self.device)
        for i, n in enumerate(lengths):
            mask[i, width - n:] = 1
        return stacked, mask, lengths

    def _decode_group(self, group: list[_Row]) -> list[Completion]:
        """Decode a round's rows together on their stacked caches, each row at its own positions.
        With drafts (`propose`), a forward feeds each row its last token and its draft's next
        tokens (rows padded to the longest, padding masked); each row keeps the run its own
        greedy choices confirm, and the positions it rejected are masked from then on."""
        if not group:
            return []
        gens, topss, done, los = [], [], [], [[None] for _ in group]
        for row, lo in zip(group, los, strict=True):
            nxt, top = self.pick(row.logits, [], row.req.dec, lo)
            gens.append([nxt])
            topss.append([top])
            done.append(nxt in self.eos or self.max_new_tokens <= 1)
        stacked, mask, fed = self._stack(group)       # fed: each row's valid positions in the stack
        caps = [self.draft_tokens] * len(group)
        live = list(range(len(group)))                # the rows still decoding, in stacked order
        while not all(done[i] for i in live):
            live, mask = self._drop_finished(stacked, mask, live, done)
            mask = self._round_forward(group, stacked, mask, live, gens, topss, done, los, fed, caps)
        del stacked
        results = []
        for row, gen, tops, lo in zip(group, gens, topss, los, strict=True):
            if row.suffix_kv is None:                 # the suffix out: the cache holds the stable part
                crop_to(row.session.cache, row.req.n_stable)
            results.append(Completion(gen, tops, lo[0], row.cached, row.req.t0))
        return results

    def _drop_finished(self, stacked, mask, live: list[int], done: list[bool]):
        """When a quarter of the stack has finished, its finished rows leave it."""
        import torch

        live_now = [i for i in live if not done[i]]
        if 4 * len(live_now) > 3 * len(live):
            return live, mask
        keep = torch.tensor([k for k, i in enumerate(live) if not done[i]], device=self.device)
        keep_rows(stacked, keep)
        return live_now, mask.index_select(0, keep)

    def _round_forward(self, group, stacked, mask, live, gens, topss, done, los, fed, caps):
        """One forward of the stack: each live row's last token and its draft; each row then
        takes what its greedy choices confirm (gens, topss, done, los, fed, caps updated in
        place). Returns the mask grown by the forward's columns, a row's rejected ones masked."""
        import torch

        props = [self.propose(gens[i], group[i].req.drafts, caps[i]) if not done[i] else [] for i in live]
        width_new = 1 + max(len(p) for p in props)
        pad_id = next(iter(self.eos))
        x = torch.full((len(live), width_new), pad_id, dtype=torch.long, device=self.device)
        new_mask = torch.zeros(len(live), width_new, dtype=torch.long, device=self.device)
        pos = torch.zeros(len(live), width_new, dtype=torch.long, device=self.device)
        for k, (i, p) in enumerate(zip(live, props, strict=True)):
            x[k, :1 + len(p)] = torch.tensor([gens[i][-1], *p])
            if not done[i]:
                new_mask[k, :1 + len(p)] = 1
            pos[k] = torch.arange(fed[i], fed[i] + width_new)
        col = mask.shape[1]
        mask = torch.cat([mask, new_mask], 1)
        out = self.model(input_ids=x, cache=stacked, attention_mask=mask, position_ids=pos,
                         use_cache=True, logits_to_keep=width_new)
        logits = out.logits.float()
        for k, (i, p) in enumerate(zip(live, props, strict=True)):
            if done[i]:
                continue
            j, done[i] = self.take(logits[k, :1 + len(p)], gens[i], topss[i], p, group[i].req.dec, los[i])
            mask[k, col + 1 + j:] = 0                # the draft's tokens after the first miss
            fed[i] += 1 + j
            caps[i] = self.next_cap(caps[i], p, j)
        return mask
