"""The gateway's logic behind the router: runs, events in, ledger, fold, prompt, auditor, verdict.

    from serve.service import GatewayService
    svc = GatewayService(load_serve_config("configs/serve/gateway-local.yaml"))
    created = svc.create_run("team-a", RunCreate(task="…", agents=["planner", "coder"]))
    verdict = await svc.ingest("team-a", created.run_id, [event, …])

A batch of events is validated with the one event parser (`aftraj.events.parse_event`) and
`aftraj.events.check_foldable` (everything the ledger and the fold will need of it: no NUL or
lone surrogate in an id, meta nested at most 32 levels, finite numbers, JSON that can be written
back): the whole batch is refused on the first malformed event (nothing stored, the 4xx names
index, event_id and field). It is then stored by `SqlLedger.append_batch` in one committed
transaction (idempotent by event_id through the database's key, ordered by seq) BEFORE anything
is answered; what is committed always folds. The run's fold state then catches up from the
ledger (so several gateway processes sharing one database see every event, whichever process
took it), the newest prefix is rendered with the shared prompt builder
(`aftraj.prompt.render_prompt`, the budget counted with the served model's tokenizer:
`aftraj.tokens`; an `openai` auditor always has a budget) and sent to the auditor through the one
client (`aftraj.llm_client`). The answer is the verdict for that prefix, the fold's findings with
their evidence, and an intervention action. If the auditor is off, slow past `deadline_s` or
down, the verdict says `auditor: unavailable` (decision from the fold's deterministic rules):
never a silent CONTINUE. A batch that adds nothing new (a resend) gets the stored verdict back.
An in-process auditor (`auditor.backend: hf-steps`, any registered name) is asked instead of the
client: prefix t of the run (its id the storage key, so tenants never share its state) on one
thread of its own, within the same deadline; `hf-steps` feeds only the new step onto the run's KV
cache, so the cost of an event does not grow with the run, and the reason is generated only when
the score crosses. The runs it keeps state for are bounded (`auditor.max_sessions`) and ended
when the gateway evicts them.

Nothing blocking runs on the event loop: body parsing and validation, every database call, the
fold, rendering and parsing the auditor's reply run on the service's thread pool
(`limits.worker_threads`); a ledger that stays locked past `limits.ledger_timeout_s` answers 503
(Retry-After) instead of stalling. Streams send their history in pages of stored records.

Run state is a bounded cache: at most `limits.max_cached_runs` runs and
`limits.max_cached_bytes` of step content, idle runs evicted after `limits.run_idle_s`; an
evicted run is rebuilt from the ledger when it is next used. A run whose ledger holds an event
this version cannot fold (written by an older one) answers 409 naming that event, every time.

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
import dataclasses
import hmac
import logging
import math
import os
import secrets
import time
from collections import OrderedDict, defaultdict
from concurrent.futures import ThreadPoolExecutor

import orjson

from aftraj.events import EventError, check_foldable, event_to_step, is_synthetic, make_event, parse_event
from aftraj.fold import RunState, fold
from aftraj.ledger import LedgerError, SqlLedger
from aftraj.prompt import PrefixCache, render_prompt
from aftraj.schema import Label, SchemaError, Trajectory
from aftraj.tokens import approx_tokens
from aftraj.verdict import ParseFailure, parse_verdict
from aftraj.views import observer_view
from serve.config import AUDITOR_BACKENDS, GatewayConfig, hash_key
from serve.protocol import RunCreate, RunCreated

log = logging.getLogger("aftraj.gateway")


class AuditorUnavailable(Exception):
    """An in-process auditor gave no answer (`AuditResult.error`); `kind` as the client's errors."""

    def __init__(self, kind: str, message: str | None):
        super().__init__(message or kind)
        self.kind = kind


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
        """The scheme is case-insensitive (RFC 9110 §11.1): `Bearer`, `bearer`, `BEARER`."""
        if not authorization or len(authorization) > 4096 or authorization[:7].lower() != "bearer ":
            return None
        digest = bytes.fromhex(hash_key(authorization[7:].strip()))
        found = None
        for name, h in self.keys:            # compare with every key: no early exit to time
            if hmac.compare_digest(h, digest):
                found = name
        return found


class RateLimiter:
    """A token bucket per key: `rate` requests a second, bursts up to `burst`. At most
    `max_keys` buckets are kept (the oldest forgotten first: a flood of distinct keys, such as
    client addresses, cannot grow it without bound)."""

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self.tokens: dict[str, float] = {}
        self.stamp: dict[str, float] = {}

    def take(self, key: str) -> float | None:
        """None if allowed, else the seconds to wait."""
        now = time.monotonic()
        tok = min(self.burst, self.tokens.get(key, self.burst) + (now - self.stamp.get(key, now)) * self.rate)
        if key not in self.stamp and len(self.stamp) >= self.max_keys:
            old = next(iter(self.stamp))
            del self.stamp[old]
            self.tokens.pop(old, None)
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
STREAM_QUEUE = 64          # verdicts a stream may lag behind before it is dropped (it resumes from the ledger)
HISTORY_PAGE = 100         # stored verdicts a stream reads from the database at a time
VIEW_PAGE = 1000           # verdicts in one GET /v1/runs/{id} (at most; `verdicts_next` pages on)
VIEW_LIST = 200            # the observer view's growing lists (handoffs) keep their last VIEW_LIST items
HISTORY_READERS = 2        # history pages read at once (all streams): the rest of the threads stay free
STEP_OVERHEAD = 400        # bytes a folded step costs beyond its strings (the cache's estimate)


class _Run:
    __slots__ = ("key", "run_id", "owner", "task", "agents", "category", "state", "steps", "step_at", "lock",
                 "subscribers", "used", "size", "counted", "broken", "prompts", "traj", "agents_seen",
                 "alarm_stored")

    def __init__(self, key, run_id, owner, task, agents, category, policy):
        self.key, self.run_id, self.owner, self.task = key, run_id, owner, task
        self.agents, self.category = agents, category
        self.state = RunState(key, category=category, policy=policy)
        self.steps: list = []
        self.step_at: list[int | None] = []    # fold position -> step index (None: synthetic)
        self.lock = asyncio.Lock()
        self.subscribers: set[asyncio.Queue] = set()
        self.used = time.monotonic()
        self.size = len(task) + STEP_OVERHEAD      # estimated bytes held (grows on the threads)
        self.counted = 0                           # of which the cache's total holds (the loop's)
        self.broken: GatewayError | None = None
        self.prompts = PrefixCache()               # what rendering the last prefix learnt (under the lock)
        self.traj: Trajectory | None = None        # the first validated Trajectory (its fixed fields)
        self.agents_seen: set[str] | None = None   # agents in aftraj_run_agents (None: not read yet)
        self.alarm_stored = False                  # an ALARM of this run is in aftraj_alarms


_TRAJ_FIELDS = tuple(f.name for f in dataclasses.fields(Trajectory) if f.name != "steps")


class _Unfoldable(Exception):
    def __init__(self, seq, event_id, err):
        self.seq, self.event_id, self.err = seq, event_id, err


def storage_key(owner: str, run_id: str) -> str:
    """Where a tenant's run lives in the database: key names never hold '/', so ids never meet."""
    return f"{owner}/{run_id}"


class GatewayService:
    def __init__(self, cfg: GatewayConfig, *, transport=None, auditor=None):
        """`auditor`: the in-process auditor `cfg.auditor.backend` names (an `eval.auditors.Auditor`
        built by the caller: `build_auditor`), when the backend is neither none nor openai."""
        import sqlalchemy as sa

        from aftraj.detectors import default_policy, load_policy

        self.cfg = cfg
        lim = cfg.limits
        self.policy = load_policy(cfg.policy) if cfg.policy else default_policy()
        if cfg.ledger_url.startswith("sqlite:///"):
            path = cfg.ledger_url[len("sqlite:///"):]
            if path and path != ":memory:":
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # tenants' ids never meet; a held lock makes a write wait at most ledger_timeout_s
        # threaded: the service's threads write through one in-process lock (no busy-handler
        # sleeps) and SQLite's WAL checkpoints run on the ledger's own thread, not in a request
        self.ledger = SqlLedger(cfg.ledger_url, id_scope="run", busy_timeout_s=lim.ledger_timeout_s, threaded=True)
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
        # the first ALARM verdicts of each run (a pointer into aftraj_verdicts): the web view and
        # the run list find a run's first ALARM without reading its verdicts
        self.alarms_table = sa.Table(
            "aftraj_alarms", md,
            sa.Column("run_id", sa.String(200), primary_key=True),
            sa.Column("seq", sa.BigInteger, primary_key=True))
        # runs in creation order (n), with their creation time: the run list, newest first
        self.run_index_table = sa.Table(
            "aftraj_run_index", md,
            sa.Column("n", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("run_id", sa.String(200), nullable=False, unique=True),
            sa.Column("owner", sa.String(64), nullable=False, index=True),
            sa.Column("created", sa.Float, nullable=True))
        # the agents seen in a run's events (hook-created runs name none at creation)
        self.run_agents_table = sa.Table(
            "aftraj_run_agents", md,
            sa.Column("run_id", sa.String(200), primary_key=True),
            sa.Column("agent", sa.String(512), primary_key=True))
        # web sign-ins: the cookie holds a random token, stored here as its sha256 (never the key)
        self.sessions_table = sa.Table(
            "aftraj_sessions", md,
            sa.Column("token_sha256", sa.String(64), primary_key=True),
            sa.Column("owner", sa.String(64), nullable=False),
            sa.Column("expires", sa.Float, nullable=False))
        had = set(sa.inspect(self.ledger.engine).get_table_names())
        md.create_all(self.ledger.engine)
        # a verdict stored with its events: a seq answered already (another process) keeps its verdict
        dialect = self.ledger.engine.dialect.name
        if dialect in ("sqlite", "postgresql"):
            ins = __import__(f"sqlalchemy.dialects.{dialect}", fromlist=["insert"]).insert
            self._insert_verdict = ins(self.verdicts_table).on_conflict_do_nothing()
        else:
            self._insert_verdict = self.verdicts_table.insert()
        # an insert that skips a row already there (the index tables: another process wrote it)
        self._insert_ignore = ((lambda table: ins(table).on_conflict_do_nothing())
                               if dialect in ("sqlite", "postgresql") else None)
        if "aftraj_runs" in had and not {"aftraj_alarms", "aftraj_run_index", "aftraj_run_agents"} <= had:
            self._backfill_indexes()
        self.keys = KeyRing(cfg.api_keys)
        self.limiter = RateLimiter(lim.rate_per_s, lim.burst)
        self.fail_limiter = RateLimiter(lim.auth_failures_per_s, lim.auth_failure_burst)
        self.metrics = Metrics()
        self.runs: OrderedDict[str, _Run] = OrderedDict()     # storage key -> run, least recently used first
        self.cached_bytes = 0
        self.streams: dict[str, int] = defaultdict(int)
        self.inflight: dict[str, int] = defaultdict(int)
        self._loading: dict[str, asyncio.Future] = {}
        # History pages read at once, over all streams. The loop shares the GIL with every busy
        # worker thread: 16 streams reading 4,000 verdicts each kept 16 threads runnable, the loop
        # got ~1/17 of the interpreter and /healthz waited behind them (p80 679 ms at load 10-14).
        self._history_slots = asyncio.Semaphore(HISTORY_READERS)
        self.pool = ThreadPoolExecutor(lim.worker_threads, thread_name_prefix="aftraj-gateway")
        # the web view's reads: their own few threads, a few of a key at a time (serve.web)
        self.web_pool = ThreadPoolExecutor(lim.web_threads, thread_name_prefix="aftraj-web")
        self.web_slots: dict[str, asyncio.Semaphore] = {}
        self.pending_bodies: dict[str, int] = defaultdict(int)     # client address -> bodies coming in
        self._sessions: dict[str, tuple[str, float, float]] = {}    # token sha256 -> (owner, expires, checked)
        self.web_counts: dict[tuple[str, str], tuple[int | None, int]] = {}   # (table, run) -> (max seq, rows)
        a = cfg.auditor
        self.client = None
        self.auditor = None            # an in-process auditor (`auditor.backend`: its registered name)
        self.count_tokens = approx_tokens
        if a.backend not in AUDITOR_BACKENDS:
            if auditor is None:
                from aftraj.config import ConfigError

                raise ConfigError(f"{a.backend!r} is an in-process auditor: build it and pass it "
                                  f"(GatewayService(cfg, auditor=…); `aftraj serve gateway` does, with "
                                  f"eval.auditors.get_auditor(backend, **options))", key="auditor.backend")
            self.auditor = auditor
            # one thread: a model is not shared between threads, and the runs it keeps state for
            # (`audited`, least recently audited first) are touched there only
            self.audit_pool = ThreadPoolExecutor(1, thread_name_prefix="aftraj-auditor")
            self.audited: OrderedDict[str, Trajectory] = OrderedDict()
        if a.backend == "openai":
            from aftraj.llm_client import ChatClient, ClientConfig

            self.client = ChatClient(ClientConfig.from_env(
                a.base_url, a.api_key_env, deadline_s=a.deadline_s, retries=1, backoff_s=0.05,
                max_backoff_s=0.5, max_response_bytes=a.max_response_bytes), transport=transport)
        if a.budget is not None and a.tokenizer not in (None, "approx"):
            from aftraj.config import ConfigError
            from aftraj.tokens import tokenizer_counter

            folder = os.path.expanduser(a.tokenizer)
            if not os.path.isdir(folder):     # else transformers reads it as a Hub repo id: "Repo id must be …"
                raise ConfigError(f"{a.tokenizer!r} is not a folder: give the served model's local folder "
                                  f"(its tokenizer counts the prompt budget), or `approx` for a rough count; "
                                  f"nothing is downloaded", key="auditor.tokenizer")
            self.count_tokens = tokenizer_counter(folder)
        elif a.backend == "openai":
            log.warning("auditor.tokenizer is not set: the %d-token budget is counted approximately (3 characters "
                        "a token); give the served model's folder to render over-budget prompts as training did",
                        a.budget)

    @property
    def asks(self) -> bool:
        """An auditor model answers each prefix (else the fold alone, inside the events' commit)."""
        return self.client is not None or self.auditor is not None

    def _audit_here(self, key: str, traj: Trajectory, t: int):
        """On the auditor's thread: prefix t of the run stored under `key`; past `max_sessions`
        runs, the least recently audited one is ended (its state, e.g. a KV cache, freed)."""
        self.audited[key] = traj
        self.audited.move_to_end(key)
        while len(self.audited) > self.cfg.auditor.max_sessions:
            _, old = self.audited.popitem(last=False)
            self.auditor.end(old)
        return self.auditor.audit(traj, t)

    def _end_here(self, key: str) -> None:
        """On the auditor's thread: the run left the gateway's cache; end the auditor's state."""
        old = self.audited.pop(key, None)
        if old is not None:
            self.auditor.end(old)

    def _audit_view(self, r: _Run) -> Trajectory:
        """The run as the in-process auditor reads it: its id is the storage key (the tenant's
        and the run's), so runs of two tenants with one run_id never share the auditor's state."""
        return self.trajectory(r, as_id=r.key)

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
        sa = self._sa
        timeout = self.cfg.limits.ledger_timeout_s if timeout is None else timeout
        try:
            return await asyncio.wait_for(self._off(fn, *args), timeout + 1.0)
        except TimeoutError:
            raise self._busy(what) from None
        except sa.exc.OperationalError as e:
            if "locked" in str(e) or "lock timeout" in str(e) or "busy" in str(e):
                raise self._busy(what) from None
            raise

    # ------------------------------------------------------------------ auth and limits
    def authenticate(self, authorization: str | None, peer: str | None = None) -> str:
        """The key's owner; 401 for a missing or unknown key (429 once `peer`, the client's
        address, has failed more than `limits.auth_failures_per_s` allows); 429 past the key's
        rate limit."""
        owner = self.keys.owner(authorization)
        if owner is None:
            self.metrics.inc("aftraj_gateway_auth_failures_total")
            wait = self.fail_limiter.take(peer or "?")
            if wait is not None:
                self.metrics.inc("aftraj_gateway_auth_failures_limited_total")
                raise GatewayError(429, "too many requests without a valid API key from this address",
                                   headers={"Retry-After": f"{max(1, math.ceil(wait))}"})
            raise GatewayError(401, "missing or unknown API key (Authorization: Bearer <key>)",
                               headers={"WWW-Authenticate": "Bearer"})
        return self.admit(owner)

    def admit(self, owner: str) -> str:
        """The key's rate limit (429 past it); returns the owner."""
        wait = self.limiter.take(owner)
        if wait is not None:
            self.metrics.inc("aftraj_gateway_rate_limited_total")
            raise GatewayError(429, f"rate limit of {self.cfg.limits.rate_per_s:g} requests/s for this key",
                               headers={"Retry-After": f"{max(1, math.ceil(wait))}"})
        return owner

    def begin_request(self, owner: str) -> None:
        """Count a request in flight for `owner`; 429 past `limits.max_inflight_per_key`."""
        lim = self.cfg.limits.max_inflight_per_key
        if self.inflight[owner] >= lim:
            self.metrics.inc("aftraj_gateway_inflight_limited_total")
            raise GatewayError(429, f"over {lim} requests in flight for this key", headers={"Retry-After": "1"})
        self.inflight[owner] += 1

    def end_request(self, owner: str) -> None:
        self.inflight[owner] -= 1
        if self.inflight[owner] <= 0:
            del self.inflight[owner]

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
        t = self.runs_table
        try:
            with self.ledger.write() as conn:       # the run and its run_started, or neither
                conn.execute(t.insert().values(run_id=key, owner=owner, record=orjson.dumps(rec)))
                conn.execute(self.run_index_table.insert().values(run_id=key, owner=owner, created=time.time()))
                self.ledger._store(conn, [started])
        except self._sa.exc.IntegrityError:
            raise GatewayError(409, "run id not available (you already have a run with this id)",
                               field="run_id") from None
        self.metrics.inc("aftraj_gateway_runs_total")
        return RunCreated(run_id=run_id, event_id=started.event_id, seq=0)

    async def acreate_run(self, owner: str, req: RunCreate) -> RunCreated:
        return await self._ledger(self.create_run, owner, req, what="creating the run")

    def _load(self, owner: str, run_id: str) -> _Run:
        """The run from the database (blocking), folded up to what the ledger holds."""
        t, sa = self.runs_table, self._sa
        key = storage_key(owner, run_id)
        with self.ledger.reader.connect() as conn:
            row = conn.execute(sa.select(t.c.run_id, t.c.owner, t.c.record).where(t.c.run_id == key)).first()
            if row is None:      # a run created before ids were scoped by key: its owner still reads it
                row = conn.execute(sa.select(t.c.run_id, t.c.owner, t.c.record).where(
                    t.c.run_id == run_id, t.c.owner == owner)).first()
        if row is None or row[1] != owner:
            raise GatewayError(404, f"no run {run_id!r}")
        rec = orjson.loads(row[2])
        r = _Run(row[0], run_id, owner, rec["task"], rec["agents"], rec["category"], self.policy)
        self._catch_up(r)
        return r

    def run(self, owner: str, run_id: str) -> _Run:
        """The run if `owner` created it; 404 otherwise (blocking: loads it on a cache miss)."""
        r = self.runs.get(storage_key(owner, run_id))
        if r is None:
            r = self._cache(self._load(owner, run_id))
        self._use(r)
        if r.broken is not None:
            raise r.broken
        return r

    async def arun(self, owner: str, run_id: str) -> _Run:
        key = storage_key(owner, run_id)
        r = self.runs.get(key)
        if r is None:
            # one load a run at a time, awaited by every request that missed: they resume in
            # arrival order, so a run's concurrent batches still take its lock in that order
            # The load itself is not bounded by one request's timeout: a long run (202k events)
            # folds for longer than ledger_timeout_s; a request that waits past it answers 503
            # while the load goes on, and the next one finds it done (or still going), instead
            # of starting it over every time.
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
            r = self.runs.get(key) or self._cache(loaded)
        self._use(r)
        if r.broken is not None:
            raise r.broken
        return r

    async def _load_once(self, owner: str, run_id: str) -> _Run:
        """Load a run on the threads (database busy: 503); cached as soon as it is loaded."""
        sa = self._sa
        try:
            r = await self._off(self._load, owner, run_id)
        except sa.exc.OperationalError as e:
            if "locked" in str(e) or "lock timeout" in str(e) or "busy" in str(e):
                raise self._busy("reading the run") from None
            raise
        return self.runs.get(r.key) or self._cache(r)

    # ------------------------------------------------------------------ the bounded run cache
    def _cache(self, r: _Run) -> _Run:
        have = self.runs.get(r.key)
        if have is not None:          # loaded twice at once: the first one stays
            return have
        self.runs[r.key] = r
        self._resize(r)
        self._sweep()
        return r

    def _use(self, r: _Run) -> None:
        r.used = time.monotonic()
        if r.key in self.runs:
            self.runs.move_to_end(r.key)

    def _resize(self, r: _Run) -> None:
        if self.runs.get(r.key) is r:
            self.cached_bytes += r.size - r.counted
            r.counted = r.size

    def _drop(self, r: _Run) -> None:
        if self.runs.get(r.key) is r:
            del self.runs[r.key]
            self.cached_bytes -= r.counted
            r.counted = 0
            if self.auditor is not None:
                self.audit_pool.submit(self._end_here, r.key)

    def _sweep(self) -> None:
        """Evict least recently used runs past the cache's bounds, and idle ones (never a run
        with a request or a stream on it)."""
        lim = self.cfg.limits
        now = time.monotonic()
        for key in list(self.runs):
            r = self.runs[key]
            over = len(self.runs) > lim.max_cached_runs or self.cached_bytes > lim.max_cached_bytes
            if not over and now - r.used < lim.run_idle_s:
                break
            if r.lock.locked() or r.subscribers:
                continue
            self._drop(r)
            self.metrics.inc("aftraj_gateway_runs_evicted_total")

    @staticmethod
    def _grow(r: _Run, steps) -> None:
        r.size += sum(len(s.content) + len(s.agent) + STEP_OVERHEAD for s in steps)

    def _catch_up(self, r: _Run) -> None:
        """Fold what the ledger holds beyond the run's state (events any process stored).
        Blocking. An event the fold cannot take marks the run broken, naming the event."""
        if r.broken is not None:
            raise r.broken
        sa, t = self._sa, self.ledger.table
        q = sa.select(t.c.seq, t.c.event_id, t.c.record).where(
            t.c.run_id == r.key, t.c.seq > r.state.last_seq).order_by(t.c.seq)
        new = []
        try:
            with self.ledger.reader.connect() as conn:
                for seq, eid, rec in conn.execute(q):
                    try:
                        ev = parse_event(orjson.loads(rec))
                        step = None if is_synthetic(ev) else event_to_step(ev, len(r.steps), r.key)
                        fold(r.state, ev)
                    except (SchemaError, ValueError, TypeError, KeyError, IndexError) as e:
                        raise _Unfoldable(seq, eid, e) from None
                    if step is None:
                        r.step_at.append(None)
                    else:
                        r.step_at.append(len(r.steps))
                        r.steps.append(step)
                        new.append(step)
        except _Unfoldable as u:
            field = getattr(u.err, "field", None)
            msg = getattr(u.err, "message", None) or f"{type(u.err).__name__}: {u.err}"
            r.broken = GatewayError(
                409, f"run_unreadable: run {r.run_id!r} holds event {u.event_id!r} (seq {u.seq}) that this "
                     f"gateway cannot fold ({field + ': ' if field else ''}{msg[:300]}); its events are kept in "
                     f"the ledger, the run cannot be audited further", event_id=u.event_id, field=field)
            log.error("run %s: %s", r.key, r.broken.detail)
            self._grow(r, new)
            raise r.broken from None
        self._grow(r, new)

    def _fold_new(self, r: _Run, events, checked: dict | None = None) -> None:
        """Fold `events` onto the run. `checked`: {(id(event), index, seq): step} that
        `check_foldable` built at parse time, reused where the step index and the event's seq
        (the ledger assigns a missing one) are those it was built with."""
        new = []
        for ev in events:
            fold(r.state, ev)
            r.step_at.append(len(r.steps))
            step = checked.get((id(ev), len(r.steps), ev.seq)) if checked else None
            if step is None:
                step = event_to_step(ev, len(r.steps), r.key)
            r.steps.append(step)
            new.append(step)
        self._grow(r, new)

    def trajectory(self, r: _Run, *, as_id: str | None = None) -> Trajectory:
        """The run so far as a Trajectory. The first one is built (and validated) by the
        schema's constructor; later ones copy its fields with the longer steps tuple and skip
        the per-step re-validation (O(run length) a request): the gateway's steps are built by
        `event_to_step` with contiguous indices, so the checks it skips always hold."""
        base = r.traj
        if base is None or not r.steps:
            traj = Trajectory(id=r.run_id, family_id=r.run_id,
                              domain=r.category if r.category in ("math", "coding", "agentic") else "external",
                              source="gateway", task=r.task, steps=tuple(r.steps),
                              label=Label("SAFE", "external"))
            r.traj = traj
            if as_id is None:
                return traj
            base = traj
        traj = object.__new__(Trajectory)
        for f in _TRAJ_FIELDS:
            object.__setattr__(traj, f, getattr(base, f))
        object.__setattr__(traj, "steps", tuple(r.steps))
        if as_id is not None:        # one copy, under another id (`_audit_view`)
            object.__setattr__(traj, "id", as_id)
        return traj

    # ------------------------------------------------------------------ events
    def _parse_body(self, body: bytes) -> list:
        """The POST body (bytes) -> its list of events; 422 naming what is wrong."""
        try:
            d = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise GatewayError(422, f"body: not valid JSON (NaN, Infinity and lone surrogates are not JSON): {e}"
                               ) from None
        if type(d) is not dict:
            raise GatewayError(422, "body: must be an object {\"events\": [...]}")
        extra = sorted(k for k in d if k != "events")
        if extra:
            raise GatewayError(422, f"{extra[0]}: extra inputs are not permitted", field=extra[0])
        items = d.get("events")
        if type(items) is not list or not items:
            raise GatewayError(422, "events: must be a non-empty list of event objects", field="events")
        return items

    def _parse_batch(self, run_id: str, items: list | bytes, key: str | None = None,
                     checked: dict | None = None, start: int = 0) -> list:
        """Validate a batch (blocking: runs on the threads): every check that can refuse an
        event runs here, before anything is stored. `checked`, if given, collects each event's
        step as `check_foldable` built it at step index `start + i` (where it folds when
        nothing comes in between), for `_fold_new`."""
        if isinstance(items, (bytes, bytearray, memoryview)):
            items = self._parse_body(bytes(items))
        lim = self.cfg.limits.max_events_per_batch
        if len(items) > lim:
            raise GatewayError(413, f"batch of {len(items)} events is over the limit of {lim}", field="events")
        key = key or run_id
        events = []
        for i, d in enumerate(items):
            eid = d.get("event_id") if isinstance(d, dict) else None
            eid = eid if isinstance(eid, str) and len(eid) <= 512 else None
            if isinstance(d, dict):
                if "run_id" not in d or d["run_id"] == run_id:
                    d = {**d, "run_id": key}
                elif d["run_id"] != key:
                    raise GatewayError(422, f"event {i} ({eid}): run_id: {d['run_id']!r}"[:300]
                                       + f" is not this run ({run_id!r})",
                                       event_index=i, event_id=eid, field="run_id")
            try:
                ev = parse_event(d)
                step = check_foldable(ev, start + len(events), key)
            except EventError as e:
                raise GatewayError(422, f"event {i} ({eid or 'no event_id'}): {e.field}: {e.message}",
                                   event_index=i, event_id=eid, field=e.field) from None
            if ev.seq == 0 or is_synthetic(ev):
                raise GatewayError(422, f"event {i} ({eid}): seq 0 and synthetic events are the gateway's "
                                        f"(run_started); a run's events take seq >= 1",
                                   event_index=i, event_id=eid, field="seq" if ev.seq == 0 else "meta")
            if checked is not None:
                checked[(id(ev), start + len(events), ev.seq)] = step   # the ledger may assign a seq
            events.append(ev)
        return events

    def _commit(self, r: _Run, run_id: str, items, t0: float | None = None):
        """Validate the batch, store it (committed before we answer) and fold it (blocking; on
        the threads, under the run's lock): one hop to the threads a request. Returns (added per
        event, the stored verdict when the batch added nothing, and, with no auditor to ask, the
        new verdict and its JSON, stored too)."""
        checked: dict = {}
        events = self._parse_batch(run_id, items, r.key, checked, len(r.steps))
        early: list = []           # (verdict, JSON) when it was stored with the events
        seen = self._agents_seen(r)
        new_agents = sorted({ev.agent for ev in events} - seen)[:256] if self._insert_ignore else []

        def with_events(conn, added, before):
            """The run's new agents are recorded with its events (the web view lists them).
            Auditor off and nothing came in between: fold and answer inside the events'
            transaction, so the verdict is committed with them (one commit a request). The
            fold cannot refuse what `_parse_batch` passed; if anything here raises, nothing is
            committed and the caller drops the run's state (rebuilt from the ledger)."""
            if new_agents:
                conn.execute(self._insert_ignore(self.run_agents_table),
                             [{"run_id": r.key, "agent": a} for a in new_agents])
            if self.asks or sum(added) != len(events) or before.get(r.key) != r.state.last_seq:
                return
            self._fold_new(r, events, checked)
            v, data = self._answer(r, len(events), 0, t0)
            conn.execute(self._insert_verdict.values(run_id=r.key, seq=v["seq"], record=data))
            self._note_alarm(conn, r, v)
            early.append((v, data))

        try:
            try:
                added, before = self.ledger.append_batch(events, then=with_events)
            except LedgerError as e:
                # Another process may have committed these very events between the ledger's two
                # reads (the stored ids, then the run's last seq: two statements under PostgreSQL's
                # READ COMMITTED), so an identical resend looks out of order: once, read again (a
                # batch really out of order fails the same way).
                if e.code != "out_of_order" or early:
                    raise
                added, before = self.ledger.append_batch(events, then=with_events)
        except LedgerError as e:
            i = next((j for j, ev in enumerate(events) if e.message.find(repr(ev.event_id)) >= 0), None)
            raise GatewayError(409, f"{e.code}: {e.message}".replace(f"{r.key!r}", f"{r.run_id!r}"),
                               event_index=i, event_id=events[i].event_id if i is not None else None,
                               field=e.field) from None
        except EventError as e:            # unwritable (checked before: only a store's own refusal)
            raise GatewayError(422, f"{e.field}: {e.message}", field=e.field) from None
        seen.update(new_agents)
        if early:
            return added, None, *early[0]
        n_new = sum(added)
        if n_new == len(events) and before.get(r.key) == r.state.last_seq:
            self._fold_new(r, events, checked)      # nothing came in between: fold what we stored
        else:
            self._catch_up(r)              # another process (or a resend): read the ledger
        stored = self._stored_verdict(r.key, r.state.last_seq) if n_new == 0 else None
        if stored is not None or self.asks:
            return added, stored, None, None
        v, data = self._answer(r, n_new, len(added) - n_new, t0)
        try:
            self._store_verdict(r.key, v["seq"], data, r if v["decision"] == "ALARM" else None)
        except self._sa.exc.OperationalError:
            log.warning("run %s: verdict for seq %s not stored (ledger busy)", r.key, v["seq"])
        return added, None, v, data

    def _answer(self, r: _Run, accepted: int, duplicates: int, t0: float):
        """The fold's verdict (auditor off) for the run's newest prefix and its JSON."""
        v = self._verdict_tail(r, *self._verdict_head(r, r.state.last_seq), t0)
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
                try:
                    added, stored, v, data = await self._ledger(
                        self._commit, r, run_id, items, t0, what="storing the events",
                        timeout=max(0.05, lock_by - time.perf_counter()))
                except GatewayError as e:
                    if e.status == 503:
                        self._drop(r)          # the write may still land: rebuild from the ledger
                    self._resize(r)
                    raise
                except Exception:
                    self._drop(r)              # stored, not folded: never trust this state again
                    raise
                self._resize(r)
                n_new = sum(added)
                self.metrics.inc("aftraj_gateway_events_total", n_new)
                self.metrics.inc("aftraj_gateway_duplicate_events_total", len(added) - n_new)
                seq = r.state.last_seq
                if stored is not None:
                    stored.update(accepted=0, duplicates=len(added), run_id=run_id)
                    return stored
                if v is None:                  # an auditor to ask: off the threads while it answers
                    v = await self._verdict(r, seq, t0)
                    v.update(accepted=n_new, duplicates=len(added) - n_new)
                    data = orjson.dumps(v)
                    try:
                        await self._ledger(self._store_verdict, r.key, seq, data,
                                           r if v["decision"] == "ALARM" else None, what="storing the verdict")
                    except GatewayError:
                        log.warning("run %s: verdict for seq %s not stored (ledger busy)", r.key, seq)
                break
            finally:
                held.lock.release()
        self._publish(r, seq, data)
        self._sweep()
        return v

    def _publish(self, r: _Run, seq: int, data: bytes) -> None:
        """Hand the verdict (serialised once) to every stream; a stalled one (queue full) is
        dropped, never raised into ingest (its events are stored, its verdict too): its stream
        ends and a reconnect (with Last-Event-ID) resumes from the stored verdicts."""
        for q in list(r.subscribers):
            try:
                q.put_nowait((seq, data))
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

    def _render(self, r: _Run, t: int):
        a = self.cfg.auditor
        # the run's PrefixCache: a prefix over budget costs the bounded view's work, not the run's length
        return render_prompt(self.trajectory(r), t, a.budget, count_tokens=self.count_tokens, cache=r.prompts)

    @staticmethod
    def _read_reply(text: str, logprobs, t: int):
        """Parse the auditor's reply (blocking: a hostile 1M-character reply costs its parse on
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

    @staticmethod
    def _read_result(res):
        """An in-process auditor's AuditResult as (verdict, error, confidence, (prompt, cached
        tokens)): an endpoint error is raised as the openai path's are (auditor: unavailable)."""
        if res.verdict is None:
            raise AuditorUnavailable(res.error_kind or "error", res.error)
        return res.verdict, None, res.confidence, (res.prompt_tokens, res.cached_tokens)

    def _verdict_head(self, r: _Run, seq: int):
        findings = [self._finding(r, f) for f in r.state.findings]
        fold_alarm = next((d for f, d in zip(r.state.findings, findings) if f.alarm), None)
        t = len(r.steps) - 1
        base = {"run_id": r.run_id, "seq": seq, "t": t, "findings": findings,
                "policy_revision": self.policy.revision, "confidence": None, "k": None,
                "agent": None, "reason": None, "auditor_error": None, "model_latency_ms": None,
                "prompt_tokens": 0, "cached_tokens": 0}
        decision = "CONTINUE"
        if fold_alarm is not None:
            # as the `rules` auditor answers for the same finding: its earliest evidence step, and
            # that step's agent (eval/auditors/rules.py)
            decision = "ALARM"
            k = min(fold_alarm["steps"], default=None)
            base.update(k=k, agent=r.steps[k].agent if k is not None and 0 <= k < len(r.steps) else None,
                        reason=f"{fold_alarm['kind']}: {fold_alarm['reason']}")
        return base, decision, "off", 0.0, fold_alarm

    def _verdict_tail(self, r: _Run, base, decision, status, score, fold_alarm, t0) -> dict:
        base.update(decision=decision, auditor=status,
                    action=self.cfg.intervention.action(score, fold_alarm is not None,
                                                        status in ("unavailable", "parse_failure")))
        latency = 1000 * (time.perf_counter() - t0)
        base["latency_ms"] = round(latency, 3)
        base["ts"] = round(time.time(), 3)
        self.metrics.inc("aftraj_gateway_verdicts_total", auditor=status, decision=decision)
        self.metrics.observe_ms(latency)
        return base

    async def _verdict(self, r: _Run, seq: int, t0: float) -> dict:
        base, decision, status, score, fold_alarm = self._verdict_head(r, seq)
        t = base["t"]
        if self.asks and t >= 0:
            status = "unavailable"
            a = self.cfg.auditor
            left = t0 + a.deadline_s - time.perf_counter()   # one deadline from arrival, lock wait included
            try:
                if left < MIN_AUDIT_S:
                    raise TimeoutError
                async with asyncio.timeout(left):
                    if self.auditor is not None:
                        # past the deadline the answer is dropped, the thread finishes it (and the
                        # next prefix waits for it): one run's walk, one model, in order
                        m0 = time.perf_counter()
                        res = await asyncio.get_running_loop().run_in_executor(
                            self.audit_pool, self._audit_here, r.key, self._audit_view(r), t)
                        base["model_latency_ms"] = round(1000 * (time.perf_counter() - m0), 3)
                        v, err, conf, usage = self._read_result(res)
                    else:
                        rendered = await self._off(self._render, r, t)
                        body = {"model": a.model, "messages": rendered.messages, "temperature": a.temperature,
                                "max_tokens": a.max_tokens}
                        if a.top_logprobs:
                            body.update(logprobs=True, top_logprobs=a.top_logprobs)
                        m0 = time.perf_counter()
                        c = await self.client.acomplete(body)
                        base["model_latency_ms"] = round(1000 * (time.perf_counter() - m0), 3)
                        v, err, conf = await self._off(self._read_reply, c.text, c.logprobs, t)
                        usage = (c.usage.prompt_tokens, c.usage.cached_tokens)
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
        return self._verdict_tail(r, base, decision, status, score, fold_alarm, t0)

    def _store_verdict(self, key: str, seq: int, data: bytes, alarm_of: _Run | None = None) -> None:
        """Store a verdict (`alarm_of`: the run, when it is an ALARM: noted in aftraj_alarms)."""
        t = self.verdicts_table
        try:
            with self.ledger.write() as conn:
                conn.execute(t.insert().values(run_id=key, seq=seq, record=data))
                if alarm_of is not None:
                    self._note_alarm(conn, alarm_of, {"decision": "ALARM", "seq": seq})
        except self._sa.exc.IntegrityError:
            pass       # another process answered this prefix first; its verdict stands

    def _note_alarm(self, conn, r: _Run, v: dict) -> None:
        """Point aftraj_alarms at an ALARM verdict of the run (the first few only: once one is
        noted by this process, later ALARMs of the run are not)."""
        if v.get("decision") == "ALARM" and not r.alarm_stored:
            stmt = (self._insert_ignore(self.alarms_table) if self._insert_ignore else self.alarms_table.insert())
            conn.execute(stmt.values(run_id=r.key, seq=v["seq"]))
            r.alarm_stored = True

    def _agents_seen(self, r: _Run) -> set[str]:
        """The agents recorded for the run in aftraj_run_agents (read once a run load; blocking)."""
        if r.agents_seen is None:
            t = self.run_agents_table
            with self.ledger.reader.connect() as conn:
                r.agents_seen = {a for (a,) in conn.execute(self._sa.select(t.c.agent).where(t.c.run_id == r.key))}
        return r.agents_seen

    def _backfill_indexes(self) -> None:
        """A ledger written before the index tables (aftraj_run_index, aftraj_run_agents,
        aftraj_alarms): fill them once, at start, from the runs, events and verdicts."""
        sa = self._sa
        runs, ix, ag, al = self.runs_table, self.run_index_table, self.run_agents_table, self.alarms_table
        ev, vt = self.ledger.table, self.verdicts_table
        log.warning("filling the web view's index tables from the ledger (once, for a ledger written by an "
                    "older version)")
        with self.ledger.write() as conn:
            have = {k for (k,) in conn.execute(sa.select(ix.c.run_id))}
            rows = [{"run_id": k, "owner": o, "created": None}
                    for k, o in conn.execute(sa.select(runs.c.run_id, runs.c.owner).order_by(runs.c.run_id))
                    if k not in have]
            if rows:
                conn.execute(ix.insert(), rows)
            if self._insert_ignore is None:
                return
            pairs = [{"run_id": k, "agent": a} for k, a in conn.execute(
                sa.select(ev.c.run_id, ev.c.agent).where(ev.c.seq > 0).distinct())]
            if pairs:
                conn.execute(self._insert_ignore(ag), pairs)
            first: dict[str, int] = {}
            for k, seq, rec in conn.execute(sa.select(vt.c.run_id, vt.c.seq, vt.c.record).order_by(vt.c.run_id,
                                                                                                    vt.c.seq)):
                if k not in first and b'"decision":"ALARM"' in bytes(rec):
                    first[k] = seq
            if first:
                conn.execute(self._insert_ignore(al), [{"run_id": k, "seq": q} for k, q in first.items()])

    def _stored_verdict(self, key: str, seq: int) -> dict | None:
        t = self.verdicts_table
        with self.ledger.reader.connect() as conn:
            row = conn.execute(self._sa.select(t.c.record).where(t.c.run_id == key, t.c.seq == seq)).first()
        return None if row is None else orjson.loads(row[0])

    def verdict_page(self, key: str, after_seq: int = -1, limit: int = HISTORY_PAGE) -> list[tuple[int, bytes]]:
        """Stored verdicts after `after_seq`, at most `limit`, as (seq, stored JSON bytes)."""
        t = self.verdicts_table
        with self.ledger.reader.connect() as conn:
            return [(s, bytes(rec)) for s, rec in conn.execute(
                self._sa.select(t.c.seq, t.c.record).where(t.c.run_id == key, t.c.seq > after_seq)
                .order_by(t.c.seq).limit(limit))]

    def verdicts(self, run_id: str, owner: str | None = None) -> list[dict]:
        """Every stored verdict of a run (`run_id` a storage key, or the tenant's id with `owner`)."""
        key = storage_key(owner, run_id) if owner is not None else run_id
        out, after = [], -1
        while True:
            page = self.verdict_page(key, after)
            out += [orjson.loads(rec) for _, rec in page]
            if len(page) < HISTORY_PAGE:
                return out
            after = page[-1][0]

    def _view(self, r: _Run, after_seq: int = -1, limit: int = VIEW_PAGE) -> dict:
        """The run's observer view and one page of its verdicts (bounded: a run with 202k
        verdicts read them all, 6.6 s, and answered 503 every time)."""
        self._catch_up(r)
        observer = observer_view(r.state)
        observer["run_id"] = r.run_id
        for k in ("handoffs",):            # the view's lists that grow with the run: the last VIEW_LIST
            if len(observer.get(k) or ()) > VIEW_LIST:
                observer[f"{k}_total"] = len(observer[k])
                observer[k] = observer[k][-VIEW_LIST:]
        t = self.verdicts_table
        page = self.verdict_page(r.key, after_seq, limit + 1)
        with self.ledger.reader.connect() as conn:
            total = conn.execute(self._sa.select(self._sa.func.count()).where(t.c.run_id == r.key)).scalar() or 0
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
                self._resize(r)

    # ------------------------------------------------------------------ streams
    def open_stream(self, owner: str, r: _Run) -> asyncio.Queue:
        """Register a stream on `r`; 429 past `limits.max_streams_per_key` or `limits.max_streams`."""
        lim = self.cfg.limits
        if self.streams[owner] >= lim.max_streams_per_key or sum(self.streams.values()) >= lim.max_streams:
            self.metrics.inc("aftraj_gateway_streams_refused_total")
            raise GatewayError(429, f"too many open streams (at most {lim.max_streams_per_key} for a key, "
                                    f"{lim.max_streams} in all)", headers={"Retry-After": "5"})
        self.streams[owner] += 1
        q: asyncio.Queue = asyncio.Queue(maxsize=STREAM_QUEUE)
        r.subscribers.add(q)
        return q

    def close_stream(self, owner: str, r: _Run, q) -> None:
        r.subscribers.discard(q)
        self.streams[owner] -= 1
        if self.streams[owner] <= 0:
            del self.streams[owner]

    async def stream(self, owner: str, run_id: str, after_seq: int = -1):
        """Async iterator of (seq, verdict JSON bytes), (None, None) for a keep-alive: the
        stored verdicts after `after_seq` (read a page at a time on the threads), then each new
        one. `stream_pages` gives the same a page at a time (one write a page: the router's)."""
        pages = await self.stream_pages(owner, run_id, after_seq)

        async def items():
            try:
                async for page in pages:
                    if not page:
                        yield None, None
                    for item in page:
                        yield item
            finally:
                await pages.aclose()
        return items()

    async def stream_pages(self, owner: str, run_id: str, after_seq: int = -1):
        """Async iterator of pages, each a list of (seq, verdict JSON bytes): the stored verdicts
        after `after_seq`, read `HISTORY_PAGE` at a time on the threads (one write a page, not
        one a verdict: 16 streams writing 4,000 verdicts one by one delayed /healthz), then each
        new one; an empty page is a keep-alive. Ends when the stream lags `STREAM_QUEUE` verdicts
        behind (the client resumes with Last-Event-ID). 429 past the per-key stream limit."""
        r = await self.arun(owner, run_id)
        q = self.open_stream(owner, r)
        return self._stream_gen(owner, r, q, after_seq)

    async def _stream_gen(self, owner, r, q, last):
        try:
            while True:
                async with self._history_slots:  # a few streams' history at a time on the threads
                    page = await self._ledger(self.verdict_page, r.key, last, what="reading verdicts")
                if page:
                    yield page
                    last = page[-1][0]
                if len(page) < HISTORY_PAGE:
                    break
            while True:
                try:
                    item = await asyncio.wait_for(q.get(), timeout=15)
                except TimeoutError:
                    yield []                     # keep-alive
                    continue
                if item is None:                 # dropped for lagging: end; a reconnect resumes
                    return
                page = [item]
                while not q.empty():             # whatever else is queued goes in the same write
                    nxt = q.get_nowait()
                    if nxt is None:
                        q.put_nowait(None)
                        break
                    page.append(nxt)
                page = [(s, d) for s, d in page if s > last]
                if page:
                    yield page
                    last = page[-1][0]
        finally:
            self.close_stream(owner, r, q)

    def subscribe(self, owner: str, run_id: str) -> tuple[asyncio.Queue, list[dict]]:
        """A queue of the run's new verdicts as (seq, bytes) (None: dropped for stalling) and the
        stored ones (for tests and in-process callers; the router streams with `stream`)."""
        r = self.run(owner, run_id)
        return self.open_stream(owner, r), self.verdicts(r.key)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.auditor is not None:
            self.audit_pool.shutdown(wait=True, cancel_futures=True)
            self.auditor.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.web_pool.shutdown(wait=False, cancel_futures=True)
        self.ledger.close()


__all__ = ["GatewayError", "GatewayService", "KeyRing", "Metrics", "RateLimiter", "storage_key"]
