"""The gateway's logic behind the router: runs, events in, ledger, fold, prompt, auditor, verdict.

    from serve.service import GatewayService
    svc = GatewayService(load_serve_config("configs/serve/gateway-local.yaml"))
    created = svc.create_run("team-a", RunCreate(task="…", agents=["planner", "coder"]))
    verdict = await svc.ingest("team-a", created.run_id, [event, …])

A batch of events is validated with the one event parser (`aftraj.events.parse_event`); the
whole batch is refused on the first malformed event (nothing stored, the 4xx names index,
event_id and field). It is then stored by `SqlLedger.append_many` in one committed transaction
(idempotent by event_id through the database's key, ordered by seq) BEFORE anything is
answered. The run's fold state then catches up from the ledger (so several gateway processes
sharing one database see every event, whichever process took it), the newest prefix is
rendered with the shared prompt builder (`aftraj.prompt.render_prompt`, the budget counted with
the served model's tokenizer: `aftraj.tokens`) and sent to the auditor through the one client
(`aftraj.llm_client`). The answer is the verdict for that prefix, the fold's findings with
their evidence, and an intervention action. If the auditor is off, slow past `deadline_s` or
down, the verdict says `auditor: unavailable` (decision from the fold's deterministic rules):
never a silent CONTINUE. A batch that adds nothing new (a resend) gets the stored verdict back.

Steps and events: seq 0 of every run is its `run_started` event (a synthetic `message` by
`gateway` carrying task, agents and category in `meta.run_started`); the run's own events take
seq >= 1 (or no seq: assigned in arrival order). Step t is the t-th non-synthetic event.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import secrets
import time
from collections import defaultdict

import orjson

from aftraj.events import EventError, event_to_step, is_synthetic, make_event, parse_event
from aftraj.fold import RunState, fold
from aftraj.ledger import LedgerError, SqlLedger
from aftraj.prompt import ParseFailure, approx_tokens, parse_verdict, render_prompt
from aftraj.schema import Label, Trajectory
from aftraj.views import observer_view
from serve.config import GatewayConfig, hash_key
from serve.protocol import RunCreate, RunCreated

log = logging.getLogger("aftraj.gateway")


class GatewayError(Exception):
    """An HTTP error the router turns into a `Problem` body."""

    def __init__(self, status: int, detail: str, *, event_index: int | None = None,
                 event_id: str | None = None, field: str | None = None, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.detail = status, detail
        self.event_index, self.event_id, self.field = event_index, event_id, field
        self.headers = headers or {}

    def body(self) -> dict:
        return {"detail": self.detail, "event_index": self.event_index, "event_id": self.event_id,
                "field": self.field}


# --------------------------------------------------------------------------- keys and limits

class KeyRing:
    """API keys stored as sha256 hashes; `owner(header)` is the key's name or None."""

    def __init__(self, keys):
        self.keys = [(k.name, bytes.fromhex(k.sha256)) for k in keys]

    def owner(self, authorization: str | None) -> str | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = bytes.fromhex(hash_key(authorization[7:].strip()))
        found = None
        for name, h in self.keys:            # compare with every key: no early exit to time
            if hmac.compare_digest(h, digest):
                found = name
        return found


class RateLimiter:
    """A token bucket per key: `rate` requests a second, bursts up to `burst`."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens: dict[str, float] = {}
        self.stamp: dict[str, float] = {}

    def take(self, key: str) -> float | None:
        """None if allowed, else the seconds to wait."""
        now = time.monotonic()
        tok = min(self.burst, self.tokens.get(key, self.burst) + (now - self.stamp.get(key, now)) * self.rate)
        self.stamp[key] = now
        if tok >= 1:
            self.tokens[key] = tok - 1
            return None
        self.tokens[key] = tok
        return (1 - tok) / self.rate


# --------------------------------------------------------------------------- metrics

LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


class Metrics:
    """Counters and a latency histogram in Prometheus' text format (no client library)."""

    def __init__(self):
        self.counters: dict[tuple[str, tuple], float] = defaultdict(float)
        self.hist = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.hist_sum = 0.0
        self.hist_n = 0

    def inc(self, name: str, n: float = 1, **labels) -> None:
        self.counters[(name, tuple(sorted(labels.items())))] += n

    def observe_ms(self, ms: float) -> None:
        i = next((i for i, b in enumerate(LATENCY_BUCKETS_MS) if ms <= b), len(LATENCY_BUCKETS_MS))
        self.hist[i] += 1
        self.hist_sum += ms
        self.hist_n += 1

    def render(self) -> str:
        lines = []
        names = sorted({n for n, _ in self.counters})
        for name in names:
            lines.append(f"# TYPE {name} counter")
            for (n, labels), v in sorted(self.counters.items()):
                if n == name:
                    lab = ",".join(f'{k}="{v2}"' for k, v2 in labels)
                    lines.append(f"{name}{{{lab}}} {v:g}" if lab else f"{name} {v:g}")
        lines.append("# TYPE aftraj_gateway_verdict_latency_ms histogram")
        acc = 0
        for b, c in zip(LATENCY_BUCKETS_MS, self.hist):
            acc += c
            lines.append(f'aftraj_gateway_verdict_latency_ms_bucket{{le="{b}"}} {acc}')
        lines.append(f'aftraj_gateway_verdict_latency_ms_bucket{{le="+Inf"}} {self.hist_n}')
        lines.append(f"aftraj_gateway_verdict_latency_ms_sum {self.hist_sum:.3f}")
        lines.append(f"aftraj_gateway_verdict_latency_ms_count {self.hist_n}")
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the service

MIN_AUDIT_S = 0.05         # less deadline than this left after the run's lock: do not call the auditor
STREAM_QUEUE = 10_000      # verdicts a stream may lag behind before it is dropped

class _Run:
    __slots__ = ("run_id", "owner", "task", "agents", "category", "state", "steps", "step_at", "lock",
                 "subscribers")

    def __init__(self, run_id, owner, task, agents, category, policy):
        self.run_id, self.owner, self.task = run_id, owner, task
        self.agents, self.category = agents, category
        self.state = RunState(run_id, category=category, policy=policy)
        self.steps: list = []
        self.step_at: list[int | None] = []    # fold position -> step index (None: synthetic)
        self.lock = asyncio.Lock()
        self.subscribers: set[asyncio.Queue] = set()


class GatewayService:
    def __init__(self, cfg: GatewayConfig, *, transport=None):
        import sqlalchemy as sa

        from aftraj.detectors import default_policy, load_policy

        self.cfg = cfg
        self.policy = load_policy(cfg.policy) if cfg.policy else default_policy()
        if cfg.ledger_url.startswith("sqlite:///"):
            path = cfg.ledger_url[len("sqlite:///"):]
            if path and path != ":memory:":
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.ledger = SqlLedger(cfg.ledger_url, id_scope="run")   # tenants' ids never meet
        self._sa = sa
        md = self.ledger.metadata
        self.runs_table = sa.Table(
            "aftraj_runs", md,
            sa.Column("run_id", sa.String(200), primary_key=True),
            sa.Column("owner", sa.String(64), nullable=False),
            sa.Column("record", sa.LargeBinary, nullable=False))
        self.verdicts_table = sa.Table(
            "aftraj_verdicts", md,
            sa.Column("run_id", sa.String(200), primary_key=True),
            sa.Column("seq", sa.BigInteger, primary_key=True),
            sa.Column("record", sa.LargeBinary, nullable=False))
        md.create_all(self.ledger.engine)
        self.keys = KeyRing(cfg.api_keys)
        self.limiter = RateLimiter(cfg.limits.rate_per_s, cfg.limits.burst)
        self.metrics = Metrics()
        self.runs: dict[str, _Run] = {}
        a = cfg.auditor
        self.client = None
        self.count_tokens = approx_tokens
        if a.backend == "openai":
            from aftraj.llm_client import ChatClient, ClientConfig

            self.client = ChatClient(ClientConfig.from_env(
                a.base_url, a.api_key_env, deadline_s=a.deadline_s, retries=1, backoff_s=0.05,
                max_backoff_s=0.5, max_response_bytes=a.max_response_bytes), transport=transport)
        if a.budget is not None:
            from aftraj.tokens import tokenizer_counter

            self.count_tokens = tokenizer_counter(a.tokenizer)

    # ------------------------------------------------------------------ auth
    def authenticate(self, authorization: str | None) -> str:
        owner = self.keys.owner(authorization)
        if owner is None:
            self.metrics.inc("aftraj_gateway_auth_failures_total")
            raise GatewayError(401, "missing or unknown API key (Authorization: Bearer <key>)",
                               headers={"WWW-Authenticate": "Bearer"})
        wait = self.limiter.take(owner)
        if wait is not None:
            self.metrics.inc("aftraj_gateway_rate_limited_total")
            raise GatewayError(429, f"rate limit of {self.cfg.limits.rate_per_s:g} requests/s for this key",
                               headers={"Retry-After": f"{max(1, math.ceil(wait))}"})
        return owner

    # ------------------------------------------------------------------ runs
    def create_run(self, owner: str, req: RunCreate) -> RunCreated:
        run_id = req.run_id or f"run-{secrets.token_hex(8)}"
        rec = {"task": req.task, "agents": req.agents, "category": req.category}
        started = make_event(event_id=f"{run_id}/run_started", run_id=run_id, kind="message",
                             agent="gateway", payload={"content": req.task}, seq=0,
                             meta={"aftraj_synthetic": True, "run_started": rec,
                                   **({"category": req.category} if req.category else {})})
        t = self.runs_table
        try:
            with self.ledger.engine.begin() as conn:       # the run and its run_started, or neither
                conn.execute(t.insert().values(run_id=run_id, owner=owner, record=orjson.dumps(rec)))
                self.ledger._store(conn, [started])
        except self._sa.exc.IntegrityError:
            # the same answer whoever holds the id: another key's run is not disclosed
            raise GatewayError(409, "run id not available (choose another run_id)", field="run_id") from None
        self.metrics.inc("aftraj_gateway_runs_total")
        return RunCreated(run_id=run_id, event_id=started.event_id, seq=0)

    def run(self, owner: str, run_id: str) -> _Run:
        """The run if `owner` created it; 404 otherwise (another key's run is not disclosed)."""
        r = self.runs.get(run_id)
        if r is None:
            t = self.runs_table
            with self.ledger.reader.connect() as conn:
                row = conn.execute(self._sa.select(t.c.owner, t.c.record).where(t.c.run_id == run_id)).first()
            if row is None:
                raise GatewayError(404, f"no run {run_id!r}")
            rec = orjson.loads(row[1])
            r = _Run(run_id, row[0], rec["task"], rec["agents"], rec["category"], self.policy)
            self._catch_up(r)
            self.runs[run_id] = r
        if r.owner != owner:
            raise GatewayError(404, f"no run {run_id!r}")
        return r

    def _catch_up(self, r: _Run) -> None:
        """Fold what the ledger holds beyond the run's state (events any process stored)."""
        for ev in self.ledger.iter_run(r.run_id, r.state.last_seq):
            fold(r.state, ev)
            if is_synthetic(ev):
                r.step_at.append(None)
            else:
                r.step_at.append(len(r.steps))
                r.steps.append(event_to_step(ev, len(r.steps), r.run_id))

    @staticmethod
    def _fold_new(r: _Run, events) -> None:
        for ev in events:
            fold(r.state, ev)
            r.step_at.append(len(r.steps))
            r.steps.append(event_to_step(ev, len(r.steps), r.run_id))

    def trajectory(self, r: _Run) -> Trajectory:
        return Trajectory(id=r.run_id, family_id=r.run_id,
                          domain=r.category if r.category in ("math", "coding", "agentic") else "external",
                          source="gateway", task=r.task, steps=tuple(r.steps),
                          label=Label("SAFE", "external"))

    # ------------------------------------------------------------------ events
    def _parse_batch(self, run_id: str, items: list) -> list:
        lim = self.cfg.limits.max_events_per_batch
        if len(items) > lim:
            raise GatewayError(413, f"batch of {len(items)} events is over the limit of {lim}", field="events")
        events = []
        for i, d in enumerate(items):
            eid = d.get("event_id") if isinstance(d, dict) else None
            eid = eid if isinstance(eid, str) else None
            if isinstance(d, dict) and "run_id" not in d:
                d = {**d, "run_id": run_id}
            try:
                ev = parse_event(d)
            except EventError as e:
                raise GatewayError(422, f"event {i} ({eid or 'no event_id'}): {e.field}: {e.message}",
                                   event_index=i, event_id=eid, field=e.field) from None
            if ev.run_id != run_id:
                raise GatewayError(422, f"event {i} ({eid}): run_id: {ev.run_id!r} is not this run ({run_id!r})",
                                   event_index=i, event_id=eid, field="run_id")
            if ev.seq == 0 or is_synthetic(ev):
                raise GatewayError(422, f"event {i} ({eid}): seq 0 and synthetic events are the gateway's "
                                        f"(run_started); a run's events take seq >= 1",
                                   event_index=i, event_id=eid, field="seq" if ev.seq == 0 else "meta")
            events.append(ev)
        return events

    async def ingest(self, owner: str, run_id: str, items: list, *, t0: float | None = None) -> dict:
        """`t0`: the request's arrival (`time.perf_counter()`); the auditor's deadline counts from it."""
        t0 = time.perf_counter() if t0 is None else t0
        r = self.run(owner, run_id)
        events = self._parse_batch(run_id, items)
        async with r.lock:
            try:
                added = self.ledger.append_many(events)      # committed before we answer
            except LedgerError as e:
                i = next((j for j, ev in enumerate(events) if e.message.find(repr(ev.event_id)) >= 0), None)
                raise GatewayError(409, f"{e.code}: {e.message}", event_index=i,
                                   event_id=events[i].event_id if i is not None else None,
                                   field=e.field) from None
            n_new = sum(added)
            self.metrics.inc("aftraj_gateway_events_total", n_new)
            self.metrics.inc("aftraj_gateway_duplicate_events_total", len(added) - n_new)
            if n_new == len(events) and self.ledger.last_seq_before.get(run_id) == r.state.last_seq:
                self._fold_new(r, events)      # nothing came in between: fold what we stored
            else:
                self._catch_up(r)              # another process (or a resend): read the ledger
            seq = r.state.last_seq
            if n_new == 0:
                stored = self._stored_verdict(run_id, seq)
                if stored is not None:
                    stored.update(accepted=0, duplicates=len(added))
                    return stored
            v = await self._verdict(r, seq, t0)
            v.update(accepted=n_new, duplicates=len(added) - n_new)
            self._store_verdict(run_id, seq, v)
        self._publish(r, v)
        return v

    def _publish(self, r: _Run, v: dict) -> None:
        """Hand the verdict to every stream; a stalled one (queue full) is dropped, never raised
        into ingest (its events are stored, its verdict too): its stream ends and a reconnect
        gets every stored verdict again."""
        for q in list(r.subscribers):
            try:
                q.put_nowait(v)
            except asyncio.QueueFull:
                r.subscribers.discard(q)
                self.metrics.inc("aftraj_gateway_streams_dropped_total")
                q.get_nowait()                 # room for the end-of-stream mark
                q.put_nowait(None)

    # ------------------------------------------------------------------ verdicts
    @staticmethod
    def _finding(r: _Run, f) -> dict:
        """A fold finding with its fold positions (which count run_started) as step indices."""
        d = f.to_dict()
        d["steps"] = [r.step_at[p] for p in f.steps if p < len(r.step_at) and r.step_at[p] is not None]
        seen = r.step_at[f.seen_at] if 0 <= f.seen_at < len(r.step_at) else None
        d["seen_at"] = seen if seen is not None else len(r.steps) - 1
        return d

    async def _verdict(self, r: _Run, seq: int, t0: float) -> dict:
        findings = [self._finding(r, f) for f in r.state.findings]
        fold_alarm = next((d for f, d in zip(r.state.findings, findings) if f.alarm), None)
        t = len(r.steps) - 1
        base = {"run_id": r.run_id, "seq": seq, "t": t, "findings": findings,
                "policy_revision": self.policy.revision, "confidence": None, "k": None,
                "agent": None, "reason": None, "auditor_error": None, "model_latency_ms": None,
                "prompt_tokens": 0, "cached_tokens": 0}
        decision, status, score = "CONTINUE", "off", 0.0
        if fold_alarm is not None:
            decision = "ALARM"
            base.update(k=min(fold_alarm["steps"], default=None), agent=None,
                        reason=f"{fold_alarm['kind']}: {fold_alarm['reason']}")
        if self.client is not None and t >= 0:
            status = "unavailable"
            a = self.cfg.auditor
            left = t0 + a.deadline_s - time.perf_counter()   # one deadline from arrival, lock wait included
            try:
                if left < MIN_AUDIT_S:
                    raise TimeoutError
                async with asyncio.timeout(left):
                    traj = self.trajectory(r)
                    rendered = await asyncio.to_thread(render_prompt, traj, t, a.budget,
                                                       count_tokens=self.count_tokens)
                    body = {"model": a.model, "messages": rendered.messages, "temperature": a.temperature,
                            "max_tokens": a.max_tokens}
                    if a.top_logprobs:
                        body.update(logprobs=True, top_logprobs=a.top_logprobs)
                    m0 = time.perf_counter()
                    c = await self.client.acomplete(body)
                    base["model_latency_ms"] = round(1000 * (time.perf_counter() - m0), 3)
            except TimeoutError:
                base["auditor_error"] = (f"no verdict within the {a.deadline_s:g} s deadline (counted from the "
                                         f"request's arrival, the wait for the run's lock included)")
            except Exception as e:       # EndpointError, a render failure: the fold still answers
                # tenants get the kind only; the operator's log has the (credential-free) message
                kind = getattr(e, "kind", None)
                base["auditor_error"] = f"{type(e).__name__}" + (f" ({kind})" if kind else "")
                log.warning("run %s: auditor error: %s: %s", r.run_id, type(e).__name__, e)
            else:
                from eval.confidence import p_unsafe_from_logprobs

                base.update(prompt_tokens=c.usage.prompt_tokens, cached_tokens=c.usage.cached_tokens)
                try:
                    v = parse_verdict(c.text, t)
                except Exception as e:          # the parser never raises; if it did: no verdict
                    v = None
                    status, base["auditor_error"] = "parse_failure", f"unparseable reply: {type(e).__name__}"
                if v is None:
                    pass
                elif isinstance(v, ParseFailure):
                    status = "parse_failure"
                    base["auditor_error"] = f"{v.code}: {v.message}"[:500]
                else:
                    status = "ok"
                    try:
                        conf = p_unsafe_from_logprobs(c.logprobs)
                    except Exception:            # odd log-probs: no confidence, the verdict stands
                        conf = None
                    base["confidence"] = conf
                    if v.alarm:
                        decision = "ALARM"
                        base.update(k=v.step, agent=v.agent, reason=v.reason)
                    score = conf if conf is not None else (1.0 if v.alarm else 0.0)
        base.update(decision=decision, auditor=status,
                    action=self.cfg.intervention.action(score, fold_alarm is not None,
                                                        status in ("unavailable", "parse_failure")))
        latency = 1000 * (time.perf_counter() - t0)
        base["latency_ms"] = round(latency, 3)
        self.metrics.inc("aftraj_gateway_verdicts_total", auditor=status, decision=decision)
        self.metrics.observe_ms(latency)
        return base

    def _store_verdict(self, run_id: str, seq: int, v: dict) -> None:
        t = self.verdicts_table
        try:
            with self.ledger.engine.begin() as conn:
                conn.execute(t.insert().values(run_id=run_id, seq=seq, record=orjson.dumps(v)))
        except self._sa.exc.IntegrityError:
            pass       # another process answered this prefix first; its verdict stands

    def _stored_verdict(self, run_id: str, seq: int) -> dict | None:
        t = self.verdicts_table
        with self.ledger.reader.connect() as conn:
            row = conn.execute(self._sa.select(t.c.record).where(t.c.run_id == run_id, t.c.seq == seq)).first()
        return None if row is None else orjson.loads(row[0])

    def verdicts(self, run_id: str) -> list[dict]:
        t = self.verdicts_table
        with self.ledger.reader.connect() as conn:
            return [orjson.loads(rec) for (rec,) in conn.execute(
                self._sa.select(t.c.record).where(t.c.run_id == run_id).order_by(t.c.seq))]

    def view(self, owner: str, run_id: str) -> dict:
        r = self.run(owner, run_id)
        self._catch_up(r)
        return {"run_id": run_id, "owner": r.owner, "task": r.task, "agents": r.agents,
                "category": r.category, "observer": observer_view(r.state),
                "verdicts": self.verdicts(run_id)}

    def subscribe(self, owner: str, run_id: str) -> tuple[asyncio.Queue, list[dict]]:
        """A queue of the run's new verdicts (None: the stream was dropped for stalling) and the
        stored ones."""
        r = self.run(owner, run_id)
        q: asyncio.Queue = asyncio.Queue(maxsize=STREAM_QUEUE)
        r.subscribers.add(q)
        return q, self.verdicts(run_id)

    def unsubscribe(self, owner: str, run_id: str, q) -> None:
        self.runs[run_id].subscribers.discard(q)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        self.ledger.engine.dispose()


__all__ = ["GatewayError", "GatewayService", "KeyRing", "Metrics", "RateLimiter"]
