"""The gateway's logic behind the router: runs, events in, ledger, fold, prompt, auditor, verdict.

    from serve.service import GatewayService
    svc = GatewayService(load_serve_config("configs/serve/gateway-local.yaml"))
    created = svc.create_run("team-a", RunCreate(task="…", agents=["planner", "coder"]))
    verdict = await svc.ingest("team-a", created.run_id, [event, …])

`GatewayService` orchestrates the gateway's rooms, each in its module: the tenant's limits
(serve.limits: keys, rate, requests in flight), the metrics (serve.metrics), the database
(serve.store: the ledger and the gateway's tables), the runs (serve.runs: parsing a batch,
folding it, the bounded run cache), the verdicts (serve.verdicts: the fold's part, the action),
the auditor (serve.auditing: the endpoint's client or the in-process auditor's thread) and the
streams (serve.streams: server-sent verdicts).

A batch of events is validated with the one event parser (`aftraj.events.parse_event`) and
`aftraj.events.check_foldable` (everything the ledger and the fold will need of it: no NUL or
lone surrogate in an id, meta nested at most 32 levels, finite numbers, JSON that can be written
back): the whole batch is refused on the first malformed event (nothing stored, the 4xx names
index, event_id and field). It is then stored by `SqlLedger.append_batch` in one committed
transaction (idempotent by event_id through the database's key, ordered by seq) BEFORE anything
is answered; what is committed always folds. The run's fold state then catches up from the
ledger (so several gateway processes sharing one database see every event, whichever process
took it), the newest prefix is rendered with the shared prompt builder
(`aftraj.prompt.render_prompt`, the budget `auditor.max_prompt_tokens` through
`aftraj.tokens.prompt_budget`, counted with the served model's tokenizer; an `openai` auditor
always has a budget) and sent to the auditor. The answer is the verdict for that prefix, the
fold's findings with their evidence, and an intervention action. If the auditor is off, slow past
`deadline_s` or down, the verdict says `auditor: unavailable` (decision from the fold's
deterministic rules): never a silent CONTINUE. A batch that adds nothing new (a resend) gets the
stored verdict back.

Nothing blocking runs on the event loop: body parsing and validation, every database call, the
fold, rendering and parsing the auditor's reply run on the service's thread pool
(`limits.worker_threads`); a ledger that stays locked past `limits.ledger_timeout_s` answers 503
(Retry-After) instead of stalling. Streams send their history in pages of stored records.

Tenancy: a run id is the tenant's own; it is stored under `<key name>/<run id>` (key names
never hold "/"), so two tenants may use the same run id and a create never discloses another
tenant's run. Runs created before this scoping (stored under the bare id) stay readable by
their owner.

Steps and events: seq 0 of every run is its `run_started` event (a synthetic `message` by
`gateway` carrying task, agents and category in `meta.run_started`); the run's own events take
seq >= 1 (or no seq: assigned in arrival order). Step t is the t-th non-synthetic event.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import orjson

from aftraj.events import EventError, check_foldable, make_event
from aftraj.ledger import LedgerError
from aftraj.prompt import render_prompt
from aftraj.schema import Trajectory
from aftraj.views import observer_view
from serve.auditing import AuditorClient
from serve.config import GatewayConfig
from serve.errors import GatewayError, is_busy
from serve.limits import Limits
from serve.metrics import Metrics
from serve.protocol import RunCreate, RunCreated
from serve.runs import Run, RunCache, catch_up, fold_new, parse_batch, trajectory
from serve.store import Store, storage_key
from serve.streams import Streams, flatten
from serve.verdicts import verdict_head, verdict_tail

log = logging.getLogger("aftraj.gateway")

VIEW_PAGE = 1000           # verdicts in one GET /v1/runs/{id} (at most; `verdicts_next` pages on)
VIEW_LIST = 200            # the observer view's growing lists (handoffs) keep their last VIEW_LIST items


class GatewayService:
    def __init__(self, cfg: GatewayConfig, *, transport=None, auditor=None):
        """`auditor`: the in-process auditor `cfg.auditor.backend` names (an `eval.auditors.Auditor`
        built by the caller: `build_auditor`), when the backend is neither none nor openai;
        `transport`: the endpoint client's httpx transport (tests)."""
        import sqlalchemy as sa

        from aftraj.detectors import default_policy, load_policy

        self.cfg = cfg
        lim = cfg.limits
        self.policy = load_policy(cfg.policy) if cfg.policy else default_policy()
        self.store = Store(cfg.ledger_url, lim.ledger_timeout_s)
        self.ledger, self._sa = self.store.ledger, sa
        self.runs_table, self.verdicts_table = self.store.runs_table, self.store.verdicts_table
        self.metrics = Metrics()
        self.limits = Limits(cfg, self.metrics)
        self.keys, self.inflight = self.limits.keys, self.limits.inflight
        self.pending_bodies = self.limits.pending_bodies
        self.authenticate, self.admit = self.limits.authenticate, self.limits.admit     # 401/429 (serve.limits)
        self.begin_request, self.end_request = self.limits.begin_request, self.limits.end_request
        self.auditing = AuditorClient(cfg.auditor, auditor=auditor, transport=transport)
        self.auditor, self.count_tokens = self.auditing.auditor, self.auditing.count_tokens
        self.cache = RunCache(lim, self.metrics, on_drop=self.auditing.end)
        self.runs = self.cache.runs          # storage key -> run, least recently used first
        self.streams_hub = Streams(lim, self.metrics)
        self.streams = self.streams_hub.counts                  # open streams per key
        self._loading: dict[str, asyncio.Future] = {}
        self.pool = ThreadPoolExecutor(lim.worker_threads, thread_name_prefix="aftraj-gateway")
        # the web view's reads: their own few threads, a few of a key at a time (serve.web)
        self.web_pool = ThreadPoolExecutor(lim.web_threads, thread_name_prefix="aftraj-web")
        self.web_slots: dict[str, asyncio.Semaphore] = {}
        self._sessions: dict[str, tuple[str, float, float]] = {}    # token sha256 -> (owner, expires, checked)
        self.web_counts: dict[tuple[str, str], tuple[int | None, int]] = {}   # (table, run) -> (max seq, rows)
        self.emitters = None                 # AFTRAJ_EMIT's emitters (serve.web.verdict_emitter sets them)

    # ------------------------------------------------------------------ what the rooms hold
    @property
    def asks(self) -> bool:
        """An auditor model answers each prefix (else the fold alone, inside the events' commit)."""
        return self.auditing.asks

    @property
    def cached_bytes(self) -> int:
        return self.cache.cached_bytes

    # ------------------------------------------------------------------ the threads and the ledger
    async def _off(self, fn, *args):
        """Run blocking work (database, parsing, fold, rendering) on the service's threads."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _busy(self, what: str) -> GatewayError:
        self.metrics.inc("aftraj_gateway_ledger_busy_total")
        return GatewayError(503, f"the ledger is busy ({what} waited over {self.cfg.limits.ledger_timeout_s:g} s); "
                                 f"nothing of this request was answered: resend it (a resend is idempotent)",
                            headers={"Retry-After": "1"})

    async def _ledger(self, fn, *args, what: str = "a write", timeout: float | None = None):
        """Ledger work on the threads, bounded by `timeout` (default `ledger_timeout_s`) + 1 s
        for the work itself; the database's own lock wait is `ledger_timeout_s`."""
        timeout = self.cfg.limits.ledger_timeout_s if timeout is None else timeout
        try:
            return await asyncio.wait_for(self._off(fn, *args), timeout + 1.0)
        except TimeoutError:
            raise self._busy(what) from None
        except self._sa.exc.OperationalError as e:
            if is_busy(e):
                raise self._busy(what) from None
            raise

    # ------------------------------------------------------------------ runs
    def create_run(self, owner: str, req: RunCreate) -> RunCreated:
        """Blocking (database): the router runs it on the service's threads (`acreate_run`)."""
        run_id = req.run_id or f"run-{secrets.token_hex(8)}"
        key = storage_key(owner, run_id)
        rec = {"task": req.task, "agents": req.agents, "category": req.category}
        try:
            started = make_event(event_id=f"{run_id}/run_started", run_id=key, kind="message",
                                 agent="gateway", payload={"content": req.task}, seq=0,
                                 meta={"aftraj_synthetic": True, "run_started": rec,
                                       **({"category": req.category} if req.category else {})})
            check_foldable(started)
        except EventError as e:       # RunCreate's validators should have caught it; never a 500
            raise GatewayError(422, f"run: {e.field}: {e.message}", field=e.field) from None
        try:
            self.store.insert_run(owner, key, rec, started)    # the run and its run_started, or neither
        except self._sa.exc.IntegrityError:
            raise GatewayError(409, "run id not available (you already have a run with this id)",
                               field="run_id") from None
        self.metrics.inc("aftraj_gateway_runs_total")
        return RunCreated(run_id=run_id, event_id=started.event_id, seq=0)

    async def acreate_run(self, owner: str, req: RunCreate) -> RunCreated:
        return await self._ledger(self.create_run, owner, req, what="creating the run")

    def _load(self, owner: str, run_id: str) -> Run:
        """The run from the database (blocking), folded up to what the ledger holds."""
        row = self.store.run_row(owner, run_id, storage_key(owner, run_id))
        if row is None or row[1] != owner:
            raise GatewayError(404, f"no run {run_id!r}")
        rec = orjson.loads(row[2])
        r = Run(row[0], run_id, owner, rec["task"], rec["agents"], rec["category"], self.policy)
        catch_up(r, self.store)
        return r

    def _ready(self, r: Run) -> Run:
        self.cache.use(r)
        if r.broken is not None:
            raise r.broken
        return r

    def run(self, owner: str, run_id: str) -> Run:
        """The run if `owner` created it; 404 otherwise (blocking: loads it on a cache miss)."""
        r = self.runs.get(storage_key(owner, run_id))
        return self._ready(r if r is not None else self.cache.cache(self._load(owner, run_id)))

    async def arun(self, owner: str, run_id: str) -> Run:
        """The run if `owner` created it (loaded on the threads on a cache miss). One load a run
        at a time, awaited by every request that missed: they resume in arrival order, so a
        run's concurrent batches still take its lock in that order. The load is not bounded by
        one request's timeout: a request that waits past ledger_timeout_s answers 503 while the
        load goes on, and the next one finds it done (or still going)."""
        key = storage_key(owner, run_id)
        r = self.runs.get(key)
        if r is None:
            task = self._loading.get(key)
            if task is None:
                task = asyncio.ensure_future(self._load_once(owner, run_id))
                self._loading[key] = task
                # popped when done; its error is read here (every waiter may have left: no warning)
                task.add_done_callback(lambda t, k=key: (self._loading.pop(k, None),
                                                         t.cancelled() or t.exception()))
            try:
                loaded = await asyncio.wait_for(asyncio.shield(task), self.cfg.limits.ledger_timeout_s + 1.0)
            except TimeoutError:
                raise self._busy("loading the run (it goes on: retry)") from None
            r = self.runs.get(key) or self.cache.cache(loaded)
        return self._ready(r)

    async def _load_once(self, owner: str, run_id: str) -> Run:
        """Load a run on the threads (database busy: 503); cached as soon as it is loaded."""
        try:
            r = await self._off(self._load, owner, run_id)
        except self._sa.exc.OperationalError as e:
            if is_busy(e):
                raise self._busy("reading the run") from None
            raise
        return self.runs.get(r.key) or self.cache.cache(r)

    def trajectory(self, r: Run, *, as_id: str | None = None) -> Trajectory:
        """The run so far as a Trajectory (serve.runs.trajectory)."""
        return trajectory(r, as_id=as_id)

    # ------------------------------------------------------------------ events
    def _commit(self, r: Run, run_id: str, items, t0: float | None = None):
        """Validate the batch, store it (committed before we answer) and fold it (blocking; on
        the threads, under the run's lock): one hop to the threads a request. Returns (added per
        event, the stored verdict when the batch added nothing, and, with no auditor to ask, the
        new verdict and its JSON, stored too)."""
        checked: dict = {}
        events = parse_batch(run_id, items, r.key, checked, len(r.steps),
                             max_events=self.cfg.limits.max_events_per_batch)
        early: list = []           # (verdict, JSON) when it was stored with the events
        seen = self.store.agents_seen(r)
        new_agents = sorted({ev.agent for ev in events} - seen)[:256] if self.store.insert_ignore else []

        def with_events(conn, added, before):
            """The run's new agents are recorded with its events (the web view lists them).
            Auditor off and nothing came in between: fold and answer inside the events'
            transaction, so the verdict is committed with them (one commit a request). The
            fold cannot refuse what `parse_batch` passed; if anything here raises, nothing is
            committed and the caller drops the run's state (rebuilt from the ledger)."""
            if new_agents:
                self.store.record_agents(conn, r.key, new_agents)
            if self.asks or sum(added) != len(events) or before.get(r.key) != r.state.last_seq:
                return
            fold_new(r, events, checked)
            v, data = self._answer(r, len(events), 0, t0)
            conn.execute(self.store.insert_verdict.values(run_id=r.key, seq=v["seq"], record=data))
            self.store.note_alarm(conn, r, v)
            early.append((v, data))

        added, before = self._append(r, events, with_events, early)
        seen.update(new_agents)
        if early:
            return added, None, *early[0]
        n_new = sum(added)
        if n_new == len(events) and before.get(r.key) == r.state.last_seq:
            fold_new(r, events, checked)       # nothing came in between: fold what we stored
        else:
            catch_up(r, self.store)            # another process (or a resend): read the ledger
        stored = self.store.stored_verdict(r.key, r.state.last_seq) if n_new == 0 else None
        if stored is not None or self.asks:
            return added, stored, None, None
        v, data = self._answer(r, n_new, len(added) - n_new, t0)
        try:
            self.store.store_verdict(r.key, v["seq"], data, r if v["decision"] == "ALARM" else None)
        except self._sa.exc.OperationalError:
            log.warning("run %s: verdict for seq %s not stored (ledger busy)", r.key, v["seq"])
        return added, None, v, data

    def _append(self, r: Run, events, with_events, early: list):
        """`SqlLedger.append_batch` with the ledger's refusals as 409/422 naming the event."""
        try:
            try:
                return self.ledger.append_batch(events, then=with_events)
            except LedgerError as e:
                # Another process may have committed these very events between the ledger's two
                # reads (the stored ids, then the run's last seq: two statements under PostgreSQL's
                # READ COMMITTED), so an identical resend looks out of order: once, read again (a
                # batch really out of order fails the same way).
                if e.code != "out_of_order" or early:
                    raise
                return self.ledger.append_batch(events, then=with_events)
        except LedgerError as e:
            i = next((j for j, ev in enumerate(events) if e.message.find(repr(ev.event_id)) >= 0), None)
            raise GatewayError(409, f"{e.code}: {e.message}".replace(f"{r.key!r}", f"{r.run_id!r}"),
                               event_index=i, event_id=events[i].event_id if i is not None else None,
                               field=e.field) from None
        except EventError as e:            # unwritable (checked before: only a store's own refusal)
            raise GatewayError(422, f"{e.field}: {e.message}", field=e.field) from None

    def _answer(self, r: Run, accepted: int, duplicates: int, t0: float):
        """The fold's verdict (auditor off) for the run's newest prefix and its JSON."""
        v = verdict_tail(r, *verdict_head(r, r.state.last_seq, self.policy), t0, self.cfg.intervention,
                         self.metrics)
        v.update(accepted=accepted, duplicates=duplicates)
        return v, orjson.dumps(v)

    async def ingest(self, owner: str, run_id: str, items: list | bytes, *, t0: float | None = None) -> dict:
        """`items`: the batch's events, or the raw POST body (parsed on the threads). `t0`: the
        request's arrival (`time.perf_counter()`); the auditor's deadline counts from it."""
        t0 = time.perf_counter() if t0 is None else t0
        r = await self.arun(owner, run_id)
        lock_by = t0 + self.cfg.limits.ledger_timeout_s     # the run's lock and the ledger: one bound
        while True:        # the lock first (FIFO): a run's concurrent batches are taken in arrival order
            try:
                await asyncio.wait_for(r.lock.acquire(), max(0.001, lock_by - time.perf_counter()))
            except TimeoutError:
                raise self._busy("waiting for the run's earlier requests") from None
            held = r
            try:
                if self.runs.get(r.key) is not r:     # evicted or dropped while we waited: the current one
                    r = await self.arun(owner, run_id)
                    continue
                if r.broken is not None:
                    raise r.broken
                v, data = await self._ingest_locked(r, owner, run_id, items, t0, lock_by)
                break
            finally:
                held.lock.release()
        if data is not None:
            self.streams_hub.publish(r, v["seq"], data)
        self.cache.sweep()
        return v

    async def _ingest_locked(self, r: Run, owner: str, run_id: str, items, t0: float, lock_by: float):
        """Under the run's lock: commit the batch, then (an auditor to ask) the verdict, stored.
        Returns (verdict, its JSON to publish, None for a resend's stored verdict)."""
        try:
            added, stored, v, data = await self._ledger(
                self._commit, r, run_id, items, t0, what="storing the events",
                timeout=max(0.05, lock_by - time.perf_counter()))
        except GatewayError as e:
            if e.status == 503:
                self.cache.drop(r)          # the write may still land: rebuild from the ledger
            self.cache.resize(r)
            raise
        except Exception:
            self.cache.drop(r)              # stored, not folded: never trust this state again
            raise
        self.cache.resize(r)
        n_new = sum(added)
        self.metrics.inc("aftraj_gateway_events_total", n_new)
        self.metrics.inc("aftraj_gateway_duplicate_events_total", len(added) - n_new)
        seq = r.state.last_seq
        if stored is not None:
            stored.update(accepted=0, duplicates=len(added), run_id=run_id)
            return stored, None
        if v is None:                  # an auditor to ask: off the threads while it answers
            v = await self._verdict(r, seq, t0)
            v.update(accepted=n_new, duplicates=len(added) - n_new)
            data = orjson.dumps(v)
            try:
                await self._ledger(self.store.store_verdict, r.key, seq, data,
                                   r if v["decision"] == "ALARM" else None, what="storing the verdict")
            except GatewayError:
                log.warning("run %s: verdict for seq %s not stored (ledger busy)", r.key, seq)
        return v, data

    # ------------------------------------------------------------------ verdicts
    def _render(self, r: Run, t: int):
        a = self.cfg.auditor
        # the run's PrefixCache: a prefix over budget costs the bounded view's work, not the run's length
        return render_prompt(self.trajectory(r), t, a.budget, count_tokens=self.count_tokens, cache=r.prompts)

    async def _verdict(self, r: Run, seq: int, t0: float) -> dict:
        base, decision, status, score, fold_alarm = verdict_head(r, seq, self.policy)
        t = base["t"]
        if self.asks and t >= 0:
            decision, status, score = await self.auditing.answer(r, t, base, decision, score, t0,
                                                                 render=self._render, off=self._off)
        return verdict_tail(r, base, decision, status, score, fold_alarm, t0, self.cfg.intervention, self.metrics)

    def verdict_page(self, key: str, after_seq: int = -1, limit: int | None = None) -> list[tuple[int, bytes]]:
        """Stored verdicts after `after_seq` (serve.store.Store.verdict_page)."""
        return self.store.verdict_page(key, after_seq, *(() if limit is None else (limit,)))

    def verdicts(self, run_id: str, owner: str | None = None) -> list[dict]:
        """Every stored verdict of a run (`run_id` a storage key, or the tenant's id with `owner`)."""
        return self.store.verdicts(storage_key(owner, run_id) if owner is not None else run_id)

    def _view(self, r: Run, after_seq: int = -1, limit: int = VIEW_PAGE) -> dict:
        """The run's observer view and one page of its verdicts (bounded: a run's verdicts are
        never read all at once)."""
        catch_up(r, self.store)
        observer = observer_view(r.state)
        observer["run_id"] = r.run_id
        for k in ("handoffs",):            # the view's lists that grow with the run: the last VIEW_LIST
            if len(observer.get(k) or ()) > VIEW_LIST:
                observer[f"{k}_total"] = len(observer[k])
                observer[k] = observer[k][-VIEW_LIST:]
        page = self.store.verdict_page(r.key, after_seq, limit + 1)
        total = self.store.count_verdicts(r.key)
        more = len(page) > limit
        page = page[:limit]
        return {"run_id": r.run_id, "owner": r.owner, "task": r.task, "agents": r.agents,
                "category": r.category, "observer": observer, "verdicts": [orjson.loads(d) for _, d in page],
                "verdicts_total": int(total), "verdicts_next": page[-1][0] if more and page else None}

    def view(self, owner: str, run_id: str, after_seq: int = -1, limit: int = VIEW_PAGE) -> dict:
        return self._view(self.run(owner, run_id), after_seq, limit)

    async def aview(self, owner: str, run_id: str, after_seq: int = -1, limit: int = VIEW_PAGE) -> dict:
        if not 1 <= limit <= VIEW_PAGE:
            raise GatewayError(422, f"verdicts_limit: must be in 1..{VIEW_PAGE}, got {limit}", field="verdicts_limit")
        r = await self.arun(owner, run_id)
        async with r.lock:
            try:
                return await self._ledger(self._view, r, after_seq, limit, what="reading the run")
            finally:
                self.cache.resize(r)

    # ------------------------------------------------------------------ streams
    def open_stream(self, owner: str, r: Run) -> asyncio.Queue:
        """Register a stream on `r`; 429 past `limits.max_streams_per_key` or `limits.max_streams`."""
        return self.streams_hub.open(owner, r)

    async def stream(self, owner: str, run_id: str, after_seq: int = -1):
        """Async iterator of (seq, verdict JSON bytes), (None, None) for a keep-alive: the
        stored verdicts after `after_seq` (read a page at a time on the threads), then each new
        one. `stream_pages` gives the same a page at a time (one write a page: the router's)."""
        return flatten(await self.stream_pages(owner, run_id, after_seq))

    async def stream_pages(self, owner: str, run_id: str, after_seq: int = -1):
        """Async iterator of pages, each a list of (seq, verdict JSON bytes): the stored verdicts
        after `after_seq`, read a page at a time on the threads (one write a page, not one a
        verdict), then each new one; an empty page is a keep-alive. Ends when the stream lags
        too far behind (the client resumes with Last-Event-ID). 429 past the stream limits."""
        r = await self.arun(owner, run_id)
        q = self.open_stream(owner, r)

        async def read_page(key: str, after: int):
            return await self._ledger(self.store.verdict_page, key, after, what="reading verdicts")
        return self.streams_hub.pages(owner, r, q, after_seq, read_page)

    def subscribe(self, owner: str, run_id: str) -> tuple[asyncio.Queue, list[dict]]:
        """A queue of the run's new verdicts as (seq, bytes) (None: dropped for stalling) and the
        stored ones (for tests and in-process callers; the router streams with `stream`)."""
        r = self.run(owner, run_id)
        return self.open_stream(owner, r), self.store.verdicts(r.key)

    async def aclose(self) -> None:
        await self.auditing.aclose()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.web_pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()


__all__ = ["GatewayError", "GatewayService", "VIEW_PAGE", "storage_key"]
