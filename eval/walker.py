"""The strict online walk (DESIGN §6), batched across trajectories.

For t = 0..N-1 the auditor gets prefix t only; the first ALARM ends the walk with d = t and the
verdict's k̂, â; no ALARM gives d = None (∞). Many trajectories are in flight at once: each round
the walker collects the next prefix of every live walk and hands them to `auditor.audit_batch`
(a KV-cache backend, `hf`, keeps one cache per live trajectory); an auditor with `submit`
(`openai`) instead gets one call per live walk in flight at all times, each answer queueing
that walk's next prefix at once.

Query plans, chosen per trajectory:
- "online": t = 0, 1, … until the first ALARM (with `all_prefixes` the walk goes on to N-1 to
  score every prefix for the threshold sweep and the AUC; d is still the first ALARM). With an
  auditor whose answer depends on its prefix alone (`Auditor.lookahead`, `hf`) and fewer live
  walks than the round holds, the spare rows audit the walks' next prefixes ahead of time
  (`lookahead`); an answer is used only when its walk asks for that prefix, so the records are
  the same (`WalkConfig(lookahead=False)`, CLI `--no-lookahead`, turns it off).
- "posthoc": one call on the whole trajectory (t = N-1); d = N-1. Labelled post-hoc.
- "bisect": binary search for the earliest prefix that alarms (Who&When's binary search
  over our one prompt): about log2(N) calls; d = that prefix.
`protocol="reference"` reproduces the released evaluation: safe trajectories get one full
trajectory call (which understates a live deployment's false alarms), unsafe ones are walked.
`parser="reference"` re-reads every completion with the release's acceptance rules
(`aftraj.reference_parse`) instead of the strict parser the auditors use; those rules accept a
step after the prefix, so the k <= t check applies only to the strict parser.

    aftraj eval --auditor dummy:gold --data ww.jsonl --out runs/eval-gold
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass

import dataclasses

from aftraj.reference_parse import PARSERS, parse_with
from aftraj.schema import Trajectory
from aftraj.verdict import ParseFailure
from eval.auditors import AuditResult, Auditor

PROTOCOLS = ("strict", "reference")

Plan = Generator[int, AuditResult, "tuple[int, AuditResult] | None"]


@dataclass(frozen=True)
class WalkConfig:
    protocol: str = "strict"
    max_in_flight: int = 32       # trajectories walked at once
    all_prefixes: bool = False    # keep scoring after the first ALARM (threshold sweep, AUC)
    parser: str = "strict"        # "reference": the release's acceptance rules (aftraj.reference_parse)
    lookahead: bool = True        # spare rows of a round audit live online walks' next prefixes

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.parser not in PARSERS:
            raise ValueError(f"parser must be one of {PARSERS}, got {self.parser!r}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")


# --------------------------------------------------------------------------- plans

def _online(n: int, all_prefixes: bool) -> Plan:
    first = None
    for t in range(n):
        r = yield t
        if r.alarm and first is None:
            first = (t, r)
            if not all_prefixes:
                break
    return first


def _posthoc(n: int) -> Plan:
    r = yield n - 1
    return (n - 1, r) if r.alarm else None


def _bisect(n: int) -> Plan:
    lo, hi, best = 0, n - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        r = yield mid
        if r.alarm:
            best, hi = (mid, r), mid - 1
        else:
            lo = mid + 1
    return best


def plan_for(auditor: Auditor, traj: Trajectory, cfg: WalkConfig) -> tuple[str, Plan]:
    n = len(traj.steps)
    mode = auditor.strategy
    if cfg.protocol == "reference" and not traj.label.unsafe:
        mode = "posthoc"
    if mode == "posthoc":
        return mode, _posthoc(n)
    if mode == "bisect":
        return mode, _bisect(n)
    return mode, _online(n, cfg.all_prefixes)


# --------------------------------------------------------------------------- records

class _Walk:
    def __init__(self, traj: Trajectory, mode: str, plan: Plan, all_prefixes: bool):
        self.traj, self.mode, self.plan = traj, mode, plan
        self.results: list[AuditResult] = []
        self.outcome: tuple[int, AuditResult] | None = None
        self.all_prefixes = all_prefixes
        self.next_t: int | None = next(plan)

    def send(self, r: AuditResult) -> None:
        self.results.append(r)
        try:
            self.next_t = self.plan.send(r)
        except StopIteration as stop:
            self.outcome, self.next_t = stop.value, None

    def record(self) -> dict:
        traj, lb = self.traj, self.traj.label
        alarmed = self.outcome is not None
        d, res = (self.outcome if alarmed else (None, None))
        v = res.verdict if res is not None else None
        trace = []
        for r in self.results:
            rv = r.verdict
            trace.append({"t": r.t, "alarm": r.alarm, "k": getattr(rv, "step", None),
                          "agent": getattr(rv, "agent", None), "confidence": r.confidence,
                          "decision_log_odds": r.decision_log_odds,
                          "parse_failure": rv.code if isinstance(rv, ParseFailure) else None,
                          "error": r.error_kind if r.error is not None else None,
                          "raw": r.raw,   # the whole completion, <think> included
                          "step_agent": traj.steps[r.t].agent})
        scored = sorted({r.t for r in self.results})
        last = self.results[-1] if self.results else None
        return {
            "id": traj.id, "subset": traj.meta.get("subset", traj.source), "domain": traj.domain,
            "source": traj.source, "n_steps": len(traj.steps), "gold": lb.verdict,
            "k_star": lb.decisive_step, "a_star": lb.decisive_agent, "mode": self.mode,
            "alarmed": alarmed, "d": d, "k_hat": getattr(v, "step", None),
            "a_hat": getattr(v, "agent", None), "reason": getattr(v, "reason", None),
            "confidence": (res.confidence if res is not None else
                           (last.confidence if last is not None else None)),
            "calls": len(self.results),
            "parse_failures": sum(r.parse_failed for r in self.results),
            "errors": sum(r.error is not None for r in self.results),
            "error_kinds": sorted({r.error_kind for r in self.results if r.error is not None}),
            "first_error": next((r.error[:300] for r in self.results if r.error is not None), None),
            "prompt_tokens": sum(r.prompt_tokens for r in self.results),
            "completion_tokens": sum(r.completion_tokens for r in self.results),
            "cached_tokens": sum(r.cached_tokens for r in self.results),
            "latencies_s": [round(r.latency_s, 6) for r in self.results],
            "trace_complete": scored == list(range(len(traj.steps))),
            "trace": trace,
        }


def max_calls(auditor: Auditor, traj: Trajectory, cfg: WalkConfig) -> int:
    """The most auditor calls the walk of `traj` can take (the progress bar's share of it)."""
    mode, n = plan_for(auditor, traj, cfg)[0], len(traj.steps)
    return 1 if mode == "posthoc" else n.bit_length() if mode == "bisect" else n


def walk(auditor: Auditor, trajs: Iterable[Trajectory], cfg: WalkConfig = WalkConfig(), *,
         progress: bool | None = None,
         on_record: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Walk every trajectory; returns one prediction record per trajectory, in input order.
    `on_record(i, record)` is called as each walk ends (in the order they end), so a caller can
    write predictions as they come (`aftraj eval --resume` reads them back).
    The progress reporter (`aftraj.console.progress`) counts auditor calls: its total is the
    most calls the walks can take and shrinks as walks end early (an ALARM), so it moves with
    every call, not every trajectory."""
    return _Walker(auditor, list(trajs), cfg, progress, on_record).run()


class _Walker:
    """One `walk`: the live walks (at most `cap`), their records and the progress bar."""

    def __init__(self, auditor: Auditor, trajs: list[Trajectory], cfg: WalkConfig, progress: bool | None,
                 on_record: Callable[[int, dict], None] | None) -> None:
        from aftraj.console import progress as make_progress

        self.auditor, self.trajs, self.cfg, self.on_record = auditor, trajs, cfg, on_record
        self.budget = {i: max_calls(auditor, t, cfg) for i, t in enumerate(trajs)}
        self.bar = make_progress(sum(self.budget.values()), f"eval {auditor.label}", "call",
                                 enabled=progress is not False)
        self.n_done = 0
        self.pending = iter(enumerate(trajs))
        self.live: dict[int, _Walk] = {}
        self.records: dict[int, dict] = {}
        self.cap = min(cfg.max_in_flight, auditor.max_in_flight or cfg.max_in_flight)
        self.reparse = parse_with(cfg.parser) if cfg.parser != "strict" else None

    def run(self) -> list[dict]:
        try:
            self.refill()
            if self.auditor.submit is not None:
                _walk_async(self.auditor, self.live, self.refill, self.finish, self.check, self.called)
            while self.live:
                self.round()
                self.refill()
        finally:
            self.bar.close()
        return [self.records[i] for i in range(len(self.trajs))]

    def refill(self) -> None:
        while len(self.live) < self.cap:
            nxt = next(self.pending, None)
            if nxt is None:
                return
            i, traj = nxt
            mode, plan = plan_for(self.auditor, traj, self.cfg)
            w = _Walk(traj, mode, plan, self.cfg.all_prefixes)
            if w.next_t is None:  # an empty plan cannot happen (N >= 1), but stay total
                self.records[i] = w.record()
                continue
            self.live[i] = w

    def round(self) -> None:
        """One `audit_batch` of every live walk's next prefix (and, with lookahead, spare rows of
        their later prefixes: an answer counts only when its walk asks for that prefix)."""
        live = self.live
        order = sorted(live)
        asked = [(i, live[i].next_t) for i in order]
        if self.cfg.lookahead and self.auditor.lookahead:
            asked += lookahead(live, order, self.cap - len(order))
        requests: Sequence[tuple[Trajectory, int]] = [(live[i].traj, t) for i, t in asked]
        results = self.auditor.audit_batch(requests)
        if len(results) != len(requests):
            raise RuntimeError(f"{self.auditor.label}: audit_batch returned {len(results)} results "
                               f"for {len(requests)} requests")
        for (i, t), r in zip(asked, results, strict=True):
            w = live.get(i)
            if w is None or w.next_t != t:   # a lookahead answer its walk did not ask for
                continue
            self.called(w, self.check(w, r))
            if w.next_t is None:
                self.finish(i)

    def finish(self, i: int) -> None:
        w = self.live.pop(i)
        self.records[i] = w.record()
        self.auditor.end(w.traj)
        if self.on_record is not None:
            self.on_record(i, self.records[i])
        unused = self.budget[i] - len(w.results)   # calls this walk no longer needs
        if unused > 0 and self.bar.total is not None:
            self.bar.total -= unused
        self.n_done += 1
        self.bar.set_postfix_str(f"{self.n_done}/{len(self.trajs)} trajectories", refresh=False)
        self.bar.refresh()

    def called(self, w: _Walk, r: AuditResult) -> None:
        w.send(r)
        self.bar.update(1)

    def check(self, w: _Walk, r: AuditResult) -> AuditResult:
        """The answer for the prefix the walk asked, re-read by `parser`; an ALARM must blame a
        step 0..t (the release's parser may blame a later one)."""
        label = self.auditor.label
        if r.t != w.next_t:
            raise RuntimeError(f"{label}: answered prefix {r.t} of {w.traj.id!r} when asked for {w.next_t}")
        if self.reparse is not None and r.raw is not None and r.verdict is not None:
            r = dataclasses.replace(r, verdict=self.reparse(r.raw, r.t))
        k = getattr(r.verdict, "step", None) if r.alarm else 0
        if self.reparse is not None and isinstance(k, int) and k > r.t:
            return r   # the release's rules accept a step after the prefix
        if not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= r.t):
            raise RuntimeError(f"{label}: the ALARM on {w.traj.id!r} blames step {k!r} "
                               f"at prefix {r.t} (a step 0..{r.t} is required)")
        return r


def lookahead(live: dict, order: list[int], spare: int) -> list[tuple[int, int]]:
    """Up to `spare` (walk, prefix) requests beyond the ones the live walks ask for: the online
    walks' next prefixes t+1, t+2, … taken one per walk in turn (so every walk gains a prefix
    before any gains two). An online plan asks for t+1 after t unless the walk ends there (its
    first ALARM), so those answers are used in order and the rest dropped: the records are the
    ones the walk without lookahead writes. The spare rows of a round (a sample's tail, or a
    sample smaller than the batch) share one read of the weights a token; each still reads its
    own cache, so the gain shrinks as prompts grow (`benchmarks/walk_speed.py` measures it)."""
    extra: list[tuple[int, int]] = []
    depth = 1
    while len(extra) < spare:
        grew = False
        for i in order:
            w = live[i]
            t = w.next_t + depth
            if w.mode == "online" and t < len(w.traj.steps) and len(extra) < spare:
                extra.append((i, t))
                grew = True
        if not grew:
            break
        depth += 1
    return extra


def _walk_async(auditor: Auditor, live: dict, refill, finish, check, called) -> None:
    """Every live walk has one call in flight; each answer immediately queues that walk's next
    prefix (or a new trajectory), so a slow call never holds up the others."""
    from concurrent.futures import FIRST_COMPLETED, wait

    futures = {}

    def launch() -> None:
        for i, w in live.items():
            if i not in futures.values():
                futures[auditor.submit(w.traj, w.next_t)] = i

    try:
        launch()
        while futures:
            done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
            for fut in done:
                i = futures.pop(fut)
                w = live[i]
                called(w, check(w, fut.result()))
                if w.next_t is None:
                    finish(i)
            refill()
            launch()
    finally:
        for fut in futures:  # an error ends the walk: drop the calls not yet started
            fut.cancel()
