"""A web view of live runs, served by the gateway: `GET /v1/runs` (the caller's runs, paged) and
pages under /ui (server-rendered HTML, one small script and one style sheet, no build step).

    aftraj serve gateway --config configs/serve/gateway-local.yaml
    open http://127.0.0.1:8080/ui            # sign in with an API key of the gateway
    curl -H "Authorization: Bearer $KEY" "http://127.0.0.1:8080/v1/runs?limit=20&order=newest"

- `/ui`: the caller's runs, newest first, each with its state (running, stalled, ended and how,
  ALARM at step t), when it started, its last activity and duration, its steps, verdicts and
  agents; filters (state, agent, ALARM only), a search (run id or task) and paging. `/ui/runs/{id}`:
  a trace view of one page of the run's steps (`STEPS_PAGE`, the latest by default): a timeline
  of agents and their handoffs, then one row per step (time, the time since the step before,
  agent, kind, content (the first `CONTENT_PREVIEW` characters, the rest behind "show all"), tool,
  tokens, the verdict given at that step and how long it took); the first ALARM is marked where
  it was raised and at its decisive step k; the fold's findings are listed with their evidence
  steps. The page follows the run live: its script listens to `/ui/runs/{id}/stream` (the run's
  verdicts as server-sent events, as `/v1/runs/{id}/stream` sends them) and, at each verdict,
  fetches the timeline again, rendered by the server (`/ui/runs/{id}/fragment`). One renderer,
  no client-side templates. A run without a termination event whose last verdict is older than
  `stalled_after_s` shows as "stalled". A step's time is its event's `ts` when the agent gave
  one, else when the gateway answered the batch that brought it.
- Bounded per request: a page reads at most `STEPS_PAGE` steps and `READ_BYTES` of their
  records (the rest of the page is left to the next), their verdicts, and a few single rows (the
  last verdict, the first ALARM through `aftraj_alarms`, the last event); an HTML answer stops at
  `MAX_FRAGMENT_BYTES`. The run list examines at most `SCAN_RUNS` runs a request. Every read runs
  on the service's web threads (`limits.web_threads`), at most `limits.web_reads_per_key` of a key
  at once, counts against the key's `limits.max_inflight_per_key`, and is abandoned (between rows)
  as soon as the client leaves. A read that waits on a locked ledger past `ledger_timeout_s`
  answers 503 with Retry-After, as the API does.
- Behind the same keys: every /ui route takes the key from the `Authorization: Bearer` header, or
  the sign-in's session: the sign-in form (`POST /ui/login`, refused from another origin: its
  `Origin` (or `Sec-Fetch-Site`) must be this gateway's) sets the `aftraj_session` cookie to a
  random token (HttpOnly, SameSite=Strict, Path=/ui, Max-Age `session_ttl_s`, Secure over https);
  the key itself is never stored in the browser, and the token is kept only as its sha256
  (`aftraj_sessions`). Signing out deletes it. The key's rate limit and failure limit apply as on
  /v1. A run of another key is a 404, as on /v1. Every /ui answer forbids framing and inline
  script (Content-Security-Policy, X-Frame-Options) and every page names the tenant (the key).
- `GET /v1/runs?limit=N&after=RUN_ID`: runs in run-id order (`order=newest`: newest first, `after`
  is then the `next` this answer gave), at most `limit` (1-100, default 50), filtered by
  `state` (running, stalled, ended, alarm), `agent`, `q`; `next` continues (null at the end).
  Per run: task, agents, category, created, last activity, steps, last seq, termination,
  verdict count, the last verdict (t, decision, auditor) and the first ALARM (t, k, agent,
  reason), and `state`.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import functools
import hashlib
import html
import logging
import secrets
import threading
import time
import urllib.parse

import orjson
from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from aftraj.events import event_to_step, parse_event
from serve.errors import GatewayError, is_busy
from serve.service import GatewayService
from serve.store import storage_key
from serve.streams import resume_after, url_int

log = logging.getLogger("aftraj.gateway")

COOKIE = "aftraj_session"
OLD_COOKIE = "aftraj_key"       # what older versions set (the key itself): deleted at sign-in and sign-out
MAX_PAGE = 100                  # runs in one list page
SCAN_RUNS = 1000                # runs examined by one list request (filters that match few runs page on)
STEPS_PAGE = 200                # steps in one page of a run
READ_BYTES = 8 * 1024 * 1024    # stored event records read by one page (the rest of the page: the next one)
MAX_FRAGMENT_BYTES = 2 * 1024 * 1024   # an HTML answer stops growing here (the rest: the next page)
CONTENT_PREVIEW = 600           # characters of a step's content shown before "show all"
CONTENT_INLINE = 20_000         # characters "show all" holds in the page; the rest: the step's own text page
FINDING_STEPS = 50              # evidence steps listed per finding
TIMELINE_LANES = 12             # agents drawn as lanes (the others share one)
SESSION_CACHE_S = 30.0          # a session checked within this long is not read again (sign-out elsewhere: 30 s)
STATES = ("running", "stalled", "ended", "alarm")
WEB_CPU_BURST_S = 0.25          # CPU seconds a key's web reads may take at once before `web_cpu_per_s` paces them
MAX_WEB_QUEUE = 4               # a key's web reads waiting at once; one more is refused (429) at once
MAX_BUDGET_WAIT_S = 5.0         # a read that would wait longer for its key's CPU share is refused (429)

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
}


class CpuBudget:
    """A token bucket of CPU seconds per key: `rate` CPU-s a second, up to `burst`. A key's web
    reads are charged the thread CPU time they took; while its bucket is empty its next read
    waits (or is refused past `MAX_BUDGET_WAIT_S`). Thread-safe (charged on the web threads)."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.level: dict[str, tuple[float, float]] = {}
        self.lock = threading.Lock()

    def _now(self, key: str) -> float:
        lvl, at = self.level.get(key, (self.burst, time.monotonic()))
        now = time.monotonic()
        return min(self.burst, lvl + (now - at) * self.rate)

    def wait(self, key: str) -> float:
        """Seconds until the key's bucket is back above zero (0: go now)."""
        with self.lock:
            lvl = self._now(key)
            return 0.0 if lvl > 0 else -lvl / self.rate

    def charge(self, key: str, cpu_s: float) -> None:
        with self.lock:
            self.level[key] = (self._now(key) - cpu_s, time.monotonic())
            if len(self.level) > 10_000:
                self.level.clear()


class Cancelled(Exception):
    """The client left: the read stops between rows."""


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled


# --------------------------------------------------------------------------- reading (blocking)

def _public_id(owner: str, key: str) -> str:
    prefix = storage_key(owner, "")
    return key[len(prefix):] if prefix and key.startswith(prefix) else key


def _epoch(ts) -> float | None:
    """An event's `ts` (epoch seconds or ISO-8601) as epoch seconds; None if it is neither."""
    if isinstance(ts, (int, float)) and not isinstance(ts, bool):
        return float(ts) if 0 < ts < 1e11 else None
    if isinstance(ts, str) and len(ts) < 64:
        try:
            d = _dt.datetime.fromisoformat(ts.replace("Z", "+00:00"))
        except ValueError:
            return None
        return (d if d.tzinfo else d.replace(tzinfo=_dt.timezone.utc)).timestamp()
    return None


def _count(svc: GatewayService, conn, table, key: str, steps_only: bool = False) -> tuple[int, int | None]:
    """(rows of the run in `table`, its max seq): the count is read again only when the max seq
    moved (both tables only grow at the end of a run), so a page of a 100k-event run does not
    count its rows every time."""
    sa = svc._sa
    mx = conn.execute(sa.select(sa.func.max(table.c.seq)).where(table.c.run_id == key)).scalar()
    hit = svc.web_counts.get((table.name, key))
    if hit is not None and hit[0] == mx:
        return hit[1], mx
    q = sa.select(sa.func.count()).where(table.c.run_id == key)
    n = int(conn.execute(q.where(table.c.seq > 0) if steps_only else q).scalar() or 0)
    if len(svc.web_counts) > 20_000:
        svc.web_counts.clear()
    svc.web_counts[(table.name, key)] = (mx, n)
    return n, mx


def _state(alarm: dict | None, termination: str | None, last_active: float | None, now: float,
           stalled_after_s: float) -> str:
    if alarm:
        return f"ALARM at step {alarm.get('t')}"
    if termination:
        return f"ended ({termination})"
    if last_active is not None and now - last_active > stalled_after_s:
        return f"stalled (no event for {_ago(now - last_active)})"
    return "running"


def _state_kind(state: str) -> str:
    return ("alarm" if state.startswith("ALARM") else "ended" if state.startswith("ended") else
            "stalled" if state.startswith("stalled") else "running")


def _pairs(sa, table, pairs):
    """`(run_id, seq) IN pairs` as an OR of equalities: SQLite scans the whole table for a
    row-value IN, and looks each pair up in the index for this."""
    return sa.or_(*[sa.and_(table.c.run_id == k, table.c.seq == q) for k, q in pairs])


def _summaries(svc: GatewayService, owner: str, rows: list[tuple], now: float, cancel=None) -> list[dict]:
    """One summary per run (`rows`: (storage key, record bytes, created)), each from a few
    single-row or counted reads: never a scan of a run's verdicts."""
    sa = svc._sa
    ev, vt, al, ag = svc.ledger.table, svc.verdicts_table, svc.store.alarms_table, svc.store.run_agents_table
    keys = [r[0] for r in rows]
    if not keys:
        return []
    out = {k: {"steps": 0, "last_seq": 0, "termination": None, "verdicts": 0, "last_verdict": None, "alarm": None,
               "last_active": None, "seen_agents": []} for k in keys}
    with svc.ledger.reader.connect() as conn:
        last_v = []
        for k in keys:
            n, last = _count(svc, conn, ev, k, steps_only=True)
            out[k].update(steps=n, last_seq=int(last or 0))
            nv, mx = _count(svc, conn, vt, k)
            out[k]["verdicts"] = nv
            if mx is not None:
                last_v.append((k, mx))
            _check(cancel)
        last_ev = [(k, s["last_seq"]) for k, s in out.items() if s["steps"]]
        if last_ev:
            for k, kind, rec in conn.execute(sa.select(ev.c.run_id, ev.c.kind, ev.c.record).where(
                    _pairs(sa, ev, last_ev))):
                if kind == "termination":
                    out[k]["termination"] = (orjson.loads(rec).get("payload") or {}).get("reason")
        _check(cancel)
        first_a = list(conn.execute(sa.select(al.c.run_id, sa.func.min(al.c.seq)).where(al.c.run_id.in_(keys))
                                    .group_by(al.c.run_id)))
        _check(cancel)
        wanted = {(k, int(s)) for k, s in last_v + first_a}
        recs = {}
        if wanted:
            recs = {(k, int(s)): orjson.loads(rec) for k, s, rec in conn.execute(
                sa.select(vt.c.run_id, vt.c.seq, vt.c.record).where(_pairs(sa, vt, sorted(wanted))))}
        for k, s in last_v:
            v = recs.get((k, int(s)))
            if v:
                out[k]["last_verdict"] = {"t": v.get("t"), "seq": v.get("seq"), "decision": v.get("decision"),
                                          "auditor": v.get("auditor"), "action": v.get("action"), "ts": v.get("ts")}
                out[k]["last_active"] = v.get("ts")
        for k, s in first_a:
            v = recs.get((k, int(s)))
            if v:
                out[k]["alarm"] = {"t": v.get("t"), "k": v.get("k"), "agent": v.get("agent"), "reason": v.get("reason")}
        for k, a in conn.execute(sa.select(ag.c.run_id, ag.c.agent).where(ag.c.run_id.in_(keys))
                                 .order_by(ag.c.run_id, ag.c.agent)):
            if len(out[k]["seen_agents"]) < 64:
                out[k]["seen_agents"].append(a)
    runs = []
    stalled_after = svc.cfg.stalled_after_s
    for k, rec, created in rows:
        r = orjson.loads(rec)
        s = out[k]
        seen = s.pop("seen_agents")
        agents = list(r.get("agents") or []) + [a for a in seen if a not in (r.get("agents") or [])]
        last_active = s["last_active"] if s["last_active"] is not None else created
        state = _state(s["alarm"], s["termination"], last_active, now, stalled_after)
        runs.append({"run_id": _public_id(owner, k), "task": r.get("task"), "agents": agents,
                     "category": r.get("category"), "state": state, "created": created,
                     **s, "last_active": last_active})
    return runs


def list_runs(svc: GatewayService, owner: str, limit: int = 50, after: str | None = None, *, order: str = "id",
              state: str | None = None, agent: str | None = None, q: str | None = None,
              cancel: threading.Event | None = None, now: float | None = None) -> dict:
    """The owner's runs after `after` (a run id for `order="id"`, the `next` of the previous
    answer for `order="newest"`), at most `limit`, keeping those that match the filters; at
    most `SCAN_RUNS` runs are examined (then `next` continues the scan)."""
    if not 1 <= limit <= MAX_PAGE:
        raise GatewayError(422, f"limit: must be in 1..{MAX_PAGE}, got {limit}", field="limit")
    if order not in ("id", "newest"):
        raise GatewayError(422, f"order: must be 'id' or 'newest', got {order!r}", field="order")
    if state is not None and state not in STATES:
        raise GatewayError(422, f"state: must be one of {', '.join(STATES)}, got {state!r}", field="state")
    if q is not None and len(q) > 200:
        raise GatewayError(422, "q: at most 200 characters", field="q")
    if agent is not None and len(agent) > 512:
        raise GatewayError(422, "agent: at most 512 characters", field="agent")
    now = time.time() if now is None else now
    sa, t, ix, ag = svc._sa, svc.runs_table, svc.store.run_index_table, svc.store.run_agents_table
    filtered = bool(state or agent or q)

    def chunk_query(cursor, n):
        if order == "id":
            qy = sa.select(t.c.run_id, t.c.record, ix.c.created, t.c.run_id).select_from(
                t.outerjoin(ix, ix.c.run_id == t.c.run_id)).where(t.c.owner == owner)
            if cursor:
                qy = qy.where(t.c.run_id > storage_key(owner, cursor))
            qy = qy.order_by(t.c.run_id)
        else:
            qy = sa.select(ix.c.run_id, t.c.record, ix.c.created, ix.c.n).select_from(
                ix.join(t, t.c.run_id == ix.c.run_id)).where(ix.c.owner == owner)
            if cursor:
                try:
                    qy = qy.where(ix.c.n < int(cursor))
                except ValueError:
                    raise GatewayError(422, f"after: with order=newest, the `next` of the previous page "
                                            f"(a number), got {cursor!r}", field="after") from None
            qy = qy.order_by(ix.c.n.desc())
        if agent:
            qy = qy.where(sa.exists().where(ag.c.run_id == t.c.run_id, ag.c.agent == agent))
        with svc.ledger.reader.connect() as conn:
            return [(k, bytes(rec), created, pos) for k, rec, created, pos in conn.execute(qy.limit(n))]

    def position(row):
        return _public_id(owner, row[0]) if order == "id" else str(row[3])

    if not filtered:
        rows = chunk_query(after, limit + 1)
        page = rows[:limit]
        runs = _summaries(svc, owner, [r[:3] for r in page], now, cancel)
        return {"runs": runs, "next": position(page[-1]) if len(rows) > limit else None, "scanned": len(page)}
    found: list[dict] = []
    scanned, cursor, more = 0, after, True
    while more and len(found) < limit and scanned < SCAN_RUNS:
        _check(cancel)
        n = min(200, SCAN_RUNS - scanned)
        rows = chunk_query(cursor, n)
        more = len(rows) == n
        summaries = _summaries(svc, owner, [r[:3] for r in rows], now, cancel)   # a chunk's reads at once
        for i, (row, summary) in enumerate(zip(rows, summaries, strict=True)):
            scanned += 1
            cursor = position(row)
            if state and _state_kind(summary["state"]) != state:
                continue
            if q and q.lower() not in summary["run_id"].lower() and q.lower() not in (summary["task"] or "").lower():
                continue
            found.append(summary)
            if len(found) == limit:
                more = more or i < len(rows) - 1
                break
    return {"runs": found, "next": cursor if more else None, "scanned": scanned}


def _step_records(sa, conn, ev, key: str, start: int | None, total: int, cancel) -> tuple[list, int]:
    """The page's stored event records (at most `STEPS_PAGE` and about `READ_BYTES`) and its
    first step index; `start` None: the last page, read backwards from the end (no OFFSET)."""
    q = sa.select(ev.c.seq, ev.c.record).where(ev.c.run_id == key, ev.c.seq > 0)
    if start is None:
        result = conn.execute(q.order_by(ev.c.seq.desc()).limit(STEPS_PAGE))
    else:
        start = max(0, int(start))
        result = conn.execute(q.order_by(ev.c.seq).limit(STEPS_PAGE).offset(start))
    records, read = [], 0
    for _seq, rec in result:
        if len(records) % 16 == 0:
            _check(cancel)
        if read > READ_BYTES:
            break
        read += len(rec)
        records.append(rec)
    result.close()
    if start is None:
        records.reverse()
        start = max(0, total - len(records))
    return records, start


def _step_rows(records: list, start: int, key: str, cancel) -> list[dict]:
    """The page's steps as the page shows them (from their stored events)."""
    steps = []
    for rec in records:
        if len(steps) % 16 == 0:
            _check(cancel)
        e = parse_event(orjson.loads(rec))
        s = event_to_step(e, start + len(steps), key)
        usage = e.usage or {}
        steps.append({"index": s.index, "agent": s.agent, "kind": e.kind, "content": s.content or "",
                      "tool": s.tool, "error": s.error, "seq": e.seq, "ts": _epoch(e.ts),
                      "arguments": None if s.arguments is None else orjson.dumps(s.arguments).decode(),
                      "reason": e.payload.get("reason") if e.kind == "termination" else None,
                      "tokens": (usage.get("input_tokens"), usage.get("output_tokens")) if usage else None,
                      "cost": usage.get("cost_usd") if usage else None})
    return steps


def _page_verdicts(sa, conn, vt, key: str, steps: list[dict]) -> list[dict]:
    """The verdicts given at the page's steps, and the first one after them (it answered the
    batch that brought the page's last steps)."""
    if not steps:
        return []
    lo, hi = steps[0]["seq"], steps[-1]["seq"]
    verdicts = [orjson.loads(r) for (r,) in conn.execute(
        sa.select(vt.c.record).where(vt.c.run_id == key, vt.c.seq >= lo, vt.c.seq <= hi).order_by(vt.c.seq)
        .limit(STEPS_PAGE))]
    after = conn.execute(sa.select(vt.c.record).where(vt.c.run_id == key, vt.c.seq > hi)
                         .order_by(vt.c.seq).limit(1)).first()
    if after is not None:
        verdicts.append(orjson.loads(after[0]))
    return verdicts


def _run_facts(svc: GatewayService, conn, key: str) -> dict:
    """A few single rows of the run: its verdict count, last verdict, first ALARM (through
    aftraj_alarms), how it ended, when it was created, the agents seen."""
    sa, st = svc._sa, svc.store
    ev, vt, al, ix, ag = svc.ledger.table, st.verdicts_table, st.alarms_table, st.run_index_table, st.run_agents_table
    n_verdicts, _ = _count(svc, conn, vt, key)
    last_v = conn.execute(sa.select(vt.c.record).where(vt.c.run_id == key).order_by(vt.c.seq.desc())
                          .limit(1)).first()
    a_seq = conn.execute(sa.select(sa.func.min(al.c.seq)).where(al.c.run_id == key)).scalar()
    alarm = None
    if a_seq is not None:
        a = conn.execute(sa.select(vt.c.record).where(vt.c.run_id == key, vt.c.seq == a_seq)).first()
        alarm = orjson.loads(a[0]) if a is not None else None
    last_e = conn.execute(sa.select(ev.c.kind, ev.c.record).where(ev.c.run_id == key)
                          .order_by(ev.c.seq.desc()).limit(1)).first()
    termination = None
    if last_e is not None and last_e[0] == "termination":
        termination = (orjson.loads(last_e[1]).get("payload") or {}).get("reason")
    return {"n_verdicts": int(n_verdicts), "last_verdict": orjson.loads(last_v[0]) if last_v is not None else None,
            "alarm": alarm, "termination": termination,
            "created": conn.execute(sa.select(ix.c.created).where(ix.c.run_id == key)).scalar(),
            "seen": [a for (a,) in conn.execute(sa.select(ag.c.agent).where(ag.c.run_id == key)
                                                .order_by(ag.c.agent).limit(64))]}


def _step_times(steps: list[dict], verdicts: list[dict]) -> None:
    """A step's time: its own ts, else when the gateway answered the batch that brought it."""
    vi = 0
    for s in steps:
        while vi < len(verdicts) and (verdicts[vi].get("seq") or 0) < s["seq"]:
            vi += 1
        s["at"] = s["ts"] if s["ts"] is not None else (verdicts[vi].get("ts") if vi < len(verdicts) else None)


def run_page_data(svc: GatewayService, owner: str, run_id: str, start: int | None = None, *,
                  cancel: threading.Event | None = None, now: float | None = None) -> dict:
    """One page of a run (see the module docstring: bounded reads): its record, the page's
    steps (from step `start`; default: the last page) with their verdicts and times, the run's
    last verdict's findings, its first ALARM, its state. 404 for a run the owner did not create."""
    sa, t, ev = svc._sa, svc.runs_table, svc.ledger.table
    key = storage_key(owner, run_id)
    now = time.time() if now is None else now
    with svc.ledger.reader.connect() as conn:
        row = conn.execute(sa.select(t.c.owner, t.c.record).where(t.c.run_id == key)).first()
        if row is None or row[0] != owner:
            raise GatewayError(404, f"no run {run_id!r}")
        total, _ = _count(svc, conn, ev, key, steps_only=True)
        records, start = _step_records(sa, conn, ev, key, start, total, cancel)
        steps = _step_rows(records, start, key, cancel)
        _check(cancel)
        verdicts = _page_verdicts(sa, conn, svc.verdicts_table, key, steps)
        _check(cancel)
        facts = _run_facts(svc, conn, key)
    _step_times(steps, verdicts)
    rec = orjson.loads(row[1])
    agents = list(rec.get("agents") or []) + [a for a in facts.pop("seen") if a not in (rec.get("agents") or [])]
    last_v, created = facts["last_verdict"], facts["created"]
    last_active = (last_v or {}).get("ts") or created
    return {"run_id": run_id, "tenant": owner, "task": rec.get("task") or "", "agents": agents,
            "category": rec.get("category"), "last_active": last_active, "now": now,
            "steps": steps, "start": start, "total_steps": int(total), "page_size": STEPS_PAGE,
            "verdicts": verdicts, **facts, "findings": (last_v or {}).get("findings") or [],
            "state": _state(facts["alarm"], facts["termination"], last_active, now, svc.cfg.stalled_after_s)}


def step_text(svc: GatewayService, owner: str, run_id: str, index: int, cancel=None) -> str:
    """Step `index`'s whole content (the page shows its first `CONTENT_INLINE` characters)."""
    sa, t, ev = svc._sa, svc.runs_table, svc.ledger.table
    key = storage_key(owner, run_id)
    with svc.ledger.reader.connect() as conn:
        row = conn.execute(sa.select(t.c.owner).where(t.c.run_id == key)).first()
        if row is None or row[0] != owner:
            raise GatewayError(404, f"no run {run_id!r}")
        rec = conn.execute(sa.select(ev.c.record).where(ev.c.run_id == key, ev.c.seq > 0).order_by(ev.c.seq)
                           .limit(1).offset(index)).first()
    if rec is None:
        raise GatewayError(404, f"run {run_id!r} has no step {index}")
    return event_to_step(parse_event(orjson.loads(rec[0])), index, key).content or ""


def new_session(svc: GatewayService, owner: str, now: float | None = None) -> str:
    """A sign-in: a random token (the cookie's), stored as its sha256 with its expiry."""
    now = time.time() if now is None else now
    token = secrets.token_urlsafe(32)
    t = svc.store.sessions_table
    with svc.ledger.write() as conn:
        conn.execute(t.delete().where(t.c.expires < now))          # expired ones go at each sign-in
        conn.execute(t.insert().values(token_sha256=hashlib.sha256(token.encode()).hexdigest(), owner=owner,
                                       expires=now + svc.cfg.session_ttl_s))
    return token


def session_owner(svc: GatewayService, token: str, now: float | None = None) -> str | None:
    """The owner of a live session token, or None (unknown, expired, signed out)."""
    now = time.time() if now is None else now
    if not token or len(token) > 128:
        return None
    h = hashlib.sha256(token.encode()).hexdigest()
    hit = svc._sessions.get(h)
    if hit is not None and now - hit[2] < SESSION_CACHE_S:
        return hit[0] if hit[1] > now else None
    t = svc.store.sessions_table
    with svc.ledger.reader.connect() as conn:
        row = conn.execute(svc._sa.select(t.c.owner, t.c.expires).where(t.c.token_sha256 == h)).first()
    if row is None or row[1] <= now or row[0] not in {n for n, _ in svc.keys.keys}:
        svc._sessions.pop(h, None)
        return None
    if len(svc._sessions) > 10_000:
        svc._sessions.clear()
    svc._sessions[h] = (row[0], row[1], now)
    return row[0]


def end_session(svc: GatewayService, token: str) -> None:
    h = hashlib.sha256(token.encode()).hexdigest()
    svc._sessions.pop(h, None)
    t = svc.store.sessions_table
    with svc.ledger.write() as conn:
        conn.execute(t.delete().where(t.c.token_sha256 == h))


# --------------------------------------------------------------------------- rendering

def _e(x) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _q(x: str) -> str:
    return urllib.parse.quote(x, safe="")


def _utc(ts: float | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    if ts is None:
        return ""
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime(fmt)


def _ago(s: float) -> str:
    s = max(0.0, s)
    return (f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h" if s < 172800
            else f"{s / 86400:.0f} d")


def _dur(s: float | None) -> str:
    if s is None:
        return ""
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s" if s < 90 else _ago(s)


CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:.2em 0} h2{font-size:1.1em} table{border-collapse:collapse;width:100%}
td,th{border-bottom:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top} th{background:#f4f4f4}
.state,.decision{font-weight:600;padding:1px 6px;border-radius:3px;white-space:nowrap}
.s-running{background:#e6f0ff}.s-ended{background:#eee}.s-stalled{background:#fff3e0;color:#8a4b00}
.s-alarm,.d-ALARM{background:#c62828;color:#fff} .d-CONTINUE{background:#e8f5e9;color:#1b5e20}
tr.alarm-raised{outline:3px solid #c62828} tr.decisive{background:#ffebee}
tr.evidence td:first-child{border-left:4px solid #ef6c00}
.content{white-space:pre-wrap;max-width:60em;overflow-wrap:anywhere} .muted{color:#777} .finding.alarm{color:#b71c1c}
.num{text-align:right;white-space:nowrap} .rid{white-space:nowrap} .time{white-space:nowrap;font-variant-numeric:tabular-nums}
header.top{display:flex;gap:1em;align-items:center;justify-content:space-between;border-bottom:1px solid #ddd;
margin-bottom:.8em;padding-bottom:.4em} .tenant{font-weight:600} form.inline{display:inline}
form.filters{margin:.6em 0;display:flex;gap:.6em;flex-wrap:wrap;align-items:end}
.pager a{margin-right:1em} details summary{cursor:pointer;color:#1565c0} svg.lanes{width:100%;height:auto;
border:1px solid #eee;background:#fafafa} #live{margin-left:1em} body[data-live=on] #live::after{content:"live";color:#2e7d32}
body[data-live=reconnecting] #live::after{content:"reconnecting\\2026";color:#ef6c00}
"""


def _page(title: str, body: str, *, tenant: str | None = None, script: bool = False) -> str:
    js = '<script src="/ui/app.js" defer></script>' if script else ""
    top = ""
    if tenant is not None:
        top = (f"<header class=top><span><a href=/ui>AgentForesight</a> &middot; tenant "
               f"<span class=tenant id=tenant>{_e(tenant)}</span><span id=live></span></span>"
               f"<form class=inline method=post action=/ui/logout><button>Sign out</button></form></header>")
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>"
            f"<link rel=stylesheet href=/ui/app.css>{js}</head><body>{top}{body}</body></html>")


def login_page(msg: str = "") -> str:
    return _page("AgentForesight: sign in", (
        "<h1>AgentForesight gateway</h1>"
        + (f"<p class=muted>{_e(msg)}</p>" if msg else "")
        + "<form method=post action=/ui/login><label>API key <input name=key type=password autocomplete=off "
          "size=40></label> <button>Sign in</button></form>"))


def _state_class(state: str) -> str:
    return f"s-{_state_kind(state)}"


def _qs(**kw) -> str:
    return urllib.parse.urlencode({k: v for k, v in kw.items() if v not in (None, "")})


def runs_page(data: dict, owner: str, filters: dict, now: float) -> str:
    rows = "".join(
        f"<tr><td class=rid><a href=\"/ui/runs/{_e(_q(r['run_id']))}\">{_e(r['run_id'])}</a></td>"
        f"<td><span class=\"state {_state_class(r['state'])}\">{_e(r['state'])}</span></td>"
        f"<td class=time title=\"{_e(_utc(r['created']))} UTC\">{_e(_utc(r['created'], '%m-%d %H:%M:%S'))}</td>"
        f"<td class=time>{_e(_ago(now - r['last_active']) + ' ago' if r['last_active'] else '')}</td>"
        f"<td class=num>{_e(_dur(r['last_active'] - r['created']) if r['last_verdict'] and r['created'] else '')}</td>"
        f"<td class=num>{r['steps']}</td><td class=num>{r['verdicts']}</td><td>{_e(', '.join(r['agents']))}</td>"
        f"<td>{_e((r['task'] or '')[:120])}</td></tr>" for r in data["runs"])
    st = filters.get("state") or ""
    opts = "".join(f"<option value=\"{v}\"{' selected' if v == st else ''}>{label}</option>"
                   for v, label in (("", "any state"), ("running", "running"), ("stalled", "stalled"),
                                    ("ended", "ended"), ("alarm", "ALARM")))
    form = (f"<form class=filters method=get action=/ui id=filters><label>state <select name=state>{opts}</select>"
            f"</label><label>agent <input name=agent size=14 value=\"{_e(filters.get('agent'))}\"></label>"
            f"<label>search <input name=q size=24 placeholder=\"run id or task\" value=\"{_e(filters.get('q'))}\">"
            f"</label><button>Filter</button> <a href=/ui>clear</a></form>")
    pager = []
    if filters.get("after"):
        pager.append(f"<a href=\"/ui?{_e(_qs(**{**filters, 'after': None}))}\">newest</a>")
    if data["next"]:
        pager.append(f"<a id=older href=\"/ui?{_e(_qs(**{**filters, 'after': data['next']}))}\">older runs</a>")
    empty = "no runs match" if any(filters.get(k) for k in ("state", "agent", "q")) else "no runs yet"
    return _page("AgentForesight: runs", (
        f"<h1>Runs</h1>{form}<table id=runs><tr><th>run</th><th>state</th><th>started (UTC)</th><th>last activity</th>"
        f"<th>duration</th><th>steps</th><th>verdicts</th><th>agents</th><th>task</th></tr>"
        f"{rows or f'<tr><td colspan=9 class=muted>{empty}</td></tr>'}</table>"
        f"<p class=pager>{''.join(pager)}<span class=muted>{len(data['runs'])} shown, "
        f"{data.get('scanned', 0)} examined</span></p>"), tenant=owner)


def _verdict_cell(v: dict | None) -> str:
    if v is None:
        return ""
    d = v.get("decision")
    out = f"<span class=\"decision d-{_e(d)}\">{_e(d)}</span> <span class=muted>auditor {_e(v.get('auditor'))}"
    if v.get("latency_ms") is not None:
        out += f", {v['latency_ms']:.0f} ms"
    if v.get("model_latency_ms") is not None:
        out += f" (model {v['model_latency_ms']:.0f} ms)"
    out += "</span>"
    if d == "ALARM":
        out += f"<br>k={_e(v.get('k'))} {_who(v.get('agent'))}: {_e(v.get('reason'))}"
    return out


def _who(agent) -> str:
    return f"agent {_e(agent)}" if agent else "<span class=muted>(no agent named)</span>"


def _lanes(data: dict) -> str:
    """A timeline of the page's steps: one lane an agent, a mark a step, a line a handoff."""
    steps = data["steps"]
    if not steps:
        return ""
    order: list[str] = []
    for s in steps:
        if s["agent"] not in order:
            order.append(s["agent"])
    lanes = order[:TIMELINE_LANES]
    lane = {a: (lanes.index(a) if a in lanes else len(lanes)) for a in order}
    n_lanes = len(lanes) + (len(order) > len(lanes))
    w, lh, left = 1000, 22, 150
    h = n_lanes * lh + 10
    dx = (w - left - 20) / max(1, len(steps) - 1)
    alarm = data["alarm"] or {}
    parts = [f"<svg class=lanes id=lanes viewBox=\"0 0 {w} {h}\" role=img aria-label=\"agents and handoffs\">"]
    for i, a in enumerate(lanes + (["(others)"] if n_lanes > len(lanes) else [])):
        y = 5 + i * lh + lh / 2
        parts.append(f"<line x1={left} y1={y:.0f} x2={w - 10} y2={y:.0f} stroke=\"#e0e0e0\"/>"
                     f"<text x=4 y={y + 4:.0f} font-size=12 fill=\"#333\">{_e(a[:20])}</text>")
    prev = None
    handoffs = 0
    for j, s in enumerate(steps):
        x, y = left + j * dx, 5 + lane[s["agent"]] * lh + lh / 2
        if prev is not None and prev[2] != s["agent"]:
            handoffs += 1
            parts.append(f"<line class=handoff x1={prev[0]:.1f} y1={prev[1]:.0f} x2={x:.1f} y2={y:.0f} "
                         f"stroke=\"#90a4ae\" stroke-width=\"1.5\"/>")
        prev = (x, y, s["agent"])
    for j, s in enumerate(steps):
        x, y = left + j * dx, 5 + lane[s["agent"]] * lh + lh / 2
        red = s["index"] in (alarm.get("t"), alarm.get("k"))
        fill = "#c62828" if red else "#ef6c00" if s["kind"] in ("tool_call", "tool_result") else \
            "#757575" if s["kind"] == "termination" else "#1565c0"
        parts.append(f"<a href=\"#step-{s['index']}\"><circle class=mark cx={x:.1f} cy={y:.0f} r={5 if red else 3.5} "
                     f"fill=\"{fill}\"><title>step {s['index']} {_e(s['agent'])} {_e(s['kind'])}</title></circle></a>")
    parts.append("</svg>")
    return (f"<h2>Agents and handoffs</h2><p class=muted>steps {steps[0]['index']}&ndash;{steps[-1]['index']}: "
            f"{len(order)} agent{'s' * (len(order) != 1)}, {handoffs} handoff{'s' * (handoffs != 1)} "
            f"(a line between lanes)</p>" + "".join(parts))


def _content_cell(data: dict, s: dict) -> str:
    content = s["content"]
    if s["kind"] == "termination":
        content = f"run ended ({s['reason']})" + (f": {content}" if content else "")
    if len(content) <= CONTENT_PREVIEW:
        shown = _e(content)
    else:
        full = _e(content[:CONTENT_INLINE])
        rest = ""
        if len(content) > CONTENT_INLINE:
            rest = (f"<br><a href=\"/ui/runs/{_e(_q(data['run_id']))}/steps/{s['index']}\">the whole step "
                    f"({len(content):,} characters)</a>")
        shown = (f"<details id=more-{s['index']}><summary>{_e(content[:CONTENT_PREVIEW])}&hellip; show all "
                 f"({len(content) - CONTENT_PREVIEW:,} more characters)</summary>{full}{rest}</details>")
    extra = "".join(f"<br><span class=muted>{k}: {_e((s[k] or '')[:CONTENT_INLINE])}</span>"
                    for k in ("tool", "arguments", "error") if s.get(k))
    return shown + extra


def timeline(data: dict) -> str:
    """The part of a run's page the script refreshes: state, findings, agents, the step table."""
    alarm, verdicts, now = data["alarm"], data["verdicts"], data["now"]
    by_t: dict[int, dict] = {}
    for v in verdicts:
        by_t[v.get("t")] = v          # a resent batch keeps one verdict per step (the last)
    evidence = {s for f in data["findings"] for s in f.get("steps", [])}
    state = data["state"]
    started, last = data["created"], data["last_active"]
    head = (f"<p>state: <span id=state class=\"state {_state_class(state)}\">{_e(state)}</span> "
            f"<span class=muted id=summary>{data['total_steps']} steps, {data['n_verdicts']} verdicts"
            + (f"; started {_e(_utc(started))} UTC" if started else "")
            + (f"; last activity {_e(_ago(now - last))} ago" if last else "")
            + (f"; duration {_e(_dur(last - started))}" if last and started else "") + "</span></p>")
    if alarm:
        head += (f"<p id=alarm class=\"finding alarm\">ALARM raised at step {_e(alarm.get('t'))}: decisive step "
                 f"{_e(alarm.get('k'))}, {_who(alarm.get('agent'))}: {_e(alarm.get('reason'))}</p>")
    fl = []
    for f in data["findings"][:50]:
        st = f.get("steps", [])
        links = ", ".join(f"<a href=\"#step-{int(s)}\">{int(s)}</a>" for s in st[:FINDING_STEPS])
        more = f" and {len(st) - FINDING_STEPS} more" if len(st) > FINDING_STEPS else ""
        fl.append(f"<li class=\"finding{' alarm' if f.get('alarm') else ''}\"><b>{_e(f.get('kind'))}</b>: "
                  f"{_e(f.get('reason'))} <span class=muted>evidence steps {links}{more}</span></li>")
    head += f"<h2>Findings</h2><ul id=findings>{''.join(fl) or '<li class=muted>none</li>'}</ul>"
    head += _lanes(data)
    steps, start, total, size = data["steps"], data["start"], data["total_steps"], data["page_size"]
    rid = _e(_q(data["run_id"]))
    end = start + len(steps)
    pager = [f"<span class=muted>steps {start}&ndash;{max(start, end - 1)} of {total}</span>"] if steps else []
    if start > 0:
        pager.append(f"<a href=\"/ui/runs/{rid}?start=0\">first</a>"
                     f"<a id=prev href=\"/ui/runs/{rid}?start={max(0, start - size)}\">earlier steps</a>")
    if end < total:
        pager.append(f"<a id=next href=\"/ui/runs/{rid}?start={end}\">later steps</a>"
                     f"<a href=\"/ui/runs/{rid}\">latest</a>")
    rows, size_now = [], len(head)
    prev_at = None
    for s in steps:
        i = s["index"]
        cls = [c for c, on in (("alarm-raised", alarm is not None and alarm.get("t") == i),
                               ("decisive", alarm is not None and alarm.get("k") == i),
                               ("evidence", i in evidence)) if on]
        at = s.get("at")
        delta = _dur(at - prev_at) if at is not None and prev_at is not None else ""
        prev_at = at if at is not None else prev_at
        tok = s.get("tokens")
        tok_s = "" if not tok else f"{tok[0] or 0}&rarr;{tok[1] or 0}" + (f"<br>${s['cost']:.4f}" if s.get("cost") else "")
        row = (f"<tr id=step-{i} class=\"{' '.join(cls)}\" data-step={i}><td class=num>{i}</td>"
               f"<td class=time title=\"{_e(_utc(at, '%Y-%m-%d %H:%M:%S.%f')[:-3]) if at else ''}\">"
               f"{_e(_utc(at, '%H:%M:%S.%f')[:-3]) if at else ''}</td><td class=num>{delta}</td>"
               f"<td>{_e(s['agent'])}</td><td>{_e(s['kind'])}</td><td class=content>{_content_cell(data, s)}</td>"
               f"<td class=num>{tok_s}</td><td class=verdict>{_verdict_cell(by_t.get(i))}</td></tr>")
        size_now += len(row)
        if size_now > MAX_FRAGMENT_BYTES:
            rows.append(f"<tr><td colspan=8 class=muted id=cut>steps {i}&ndash;{end - 1} are not shown here (this "
                        f"page is over {MAX_FRAGMENT_BYTES // 1024 // 1024} MB): "
                        f"<a href=\"/ui/runs/{rid}?start={i}\">continue from step {i}</a></td></tr>")
            break
        rows.append(row)
    if end < total and len(steps) < size and steps:
        rows.append(f"<tr><td colspan=8 class=muted>the page stops at step {end - 1} (its steps are large): "
                    f"<a href=\"/ui/runs/{rid}?start={end}\">continue</a></td></tr>")
    return (head + f"<h2>Steps</h2><p class=pager id=pager>{''.join(pager)}</p>"
            "<table id=timeline><tr><th>step</th><th>time (UTC)</th><th>+time</th><th>agent</th><th>kind</th>"
            "<th>content</th><th>tokens</th><th>verdict</th></tr>" + "".join(rows) + "</table>")


def run_page(data: dict) -> str:
    latest = data["start"] + len(data["steps"]) >= data["total_steps"]
    return _page(f"run {data['run_id']}", (
        f"<p><a href=/ui>all runs</a></p><h1>Run {_e(data['run_id'])} <span class=muted>(tenant "
        f"{_e(data['tenant'])})</span></h1><p class=muted>task: {_e(data['task'][:500])}<br>agents: "
        f"<span id=agents>{_e(', '.join(data['agents']))}</span>"
        + (f"; category {_e(data['category'])}" if data["category"] else "")
        + f"</p><div id=run data-run=\"{_e(data['run_id'])}\" data-start=\"{data['start']}\" "
          f"data-latest=\"{1 if latest else 0}\">{timeline(data)}</div>"), tenant=data["tenant"], script=True)


APP_JS = """// AgentForesight run page: follow the run's verdicts (SSE) and re-fetch the server-rendered timeline.
(function () {
  var root = document.getElementById("run");
  if (!root) return;
  var base = "/ui/runs/" + encodeURIComponent(root.dataset.run);
  var busy = false, again = false;
  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    // the latest page follows the run; an earlier page keeps its steps
    var url = base + "/fragment" + (root.dataset.latest === "1" ? "" : "?start=" + root.dataset.start);
    fetch(url, {credentials: "same-origin", cache: "no-store"})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null) return;
        var open = [].map.call(root.querySelectorAll("details[open]"), function (d) { return d.id; });
        root.innerHTML = html;
        open.forEach(function (id) { var d = document.getElementById(id); if (d) d.open = true; });
      })
      .finally(function () { busy = false; if (again) { again = false; refresh(); } });
  }
  var es = new EventSource(base + "/stream");
  es.addEventListener("verdict", refresh);
  es.onopen = function () { document.body.dataset.live = "on"; };
  es.onerror = function () { document.body.dataset.live = "reconnecting"; };
})();
"""


# --------------------------------------------------------------------------- routes

def verdict_emitter(svc: GatewayService):
    """`emit(verdict, run_id, tenant, body)`: each new verdict as an OTel span / Langfuse score
    when `AFTRAJ_EMIT` names them (aftraj/adapters/emit.py; a resent batch's stored verdict is not
    emitted again); a no-op otherwise. Every id written downstream is derived from the tenant and
    the run (two tenants' `prod-7` never share a trace or a score); `body`, the posted batch,
    places the verdict on the judged step's span. Fails open: an emitter's error is logged,
    never raised into a request."""
    from aftraj.adapters.emit import from_env
    try:
        emitters = from_env()
    except (ValueError, ImportError) as e:     # a bad AFTRAJ_EMIT is the operator's to fix: say so once
        log.error("AFTRAJ_EMIT: %s; verdicts are not emitted", e)
        emitters = None
    model = svc.cfg.auditor.model if svc.cfg.auditor.backend == "openai" else None
    svc.emitters = emitters

    def emit(v, run_id: str, tenant: str, body=None) -> None:
        if emitters and isinstance(v, dict) and v.get("accepted", 1) > 0:
            emitters.emit(v, tenant=tenant, run_id=run_id, model=model, step=body)
    return emit


def _same_origin(request: Request) -> bool:
    """A browser's POST from this gateway's own pages: its Origin is this host (or, without an
    Origin, Sec-Fetch-Site says same-origin). A client that sends neither (curl, a script) is no
    browser and carries no other site's cookies: allowed."""
    origin = request.headers.get("origin")
    host = (request.headers.get("host") or "").lower()
    if origin is not None:
        return bool(host) and origin.lower() in (f"http://{host}", f"https://{host}")
    return request.headers.get("sec-fetch-site") in (None, "same-origin", "none")


async def _disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _headers(extra: dict | None = None) -> dict:
    return {**SECURITY_HEADERS, "Cache-Control": "no-store", **(extra or {})}


def _html(body: str, status: int = 200, headers: dict | None = None) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=_headers(headers))


def _signed_out(request: Request, e: GatewayError) -> HTMLResponse:
    msg = "" if e.status == 401 and not request.cookies.get(COOKIE) else (
        "your sign-in has ended: sign in again" if e.status == 401 else e.detail)
    return _html(login_page(msg), e.status, e.headers)


def _gone() -> Response:
    return Response(status_code=499)


def _peer(request: Request) -> str | None:
    return request.client.host if request.client else None


class WebReads:
    """How the web view reads: `fn(*args, cancel=…, **kw)` (then `render(result)`) on the web
    threads, within the key's CPU budget for web reads (`CpuBudget`), in one of its web slots
    (`limits.web_reads_per_key`), counted in flight, bounded by ledger_timeout_s (+1 s),
    abandoned (`Cancelled`) when the client leaves."""

    def __init__(self, svc: GatewayService):
        self.svc, self.lim = svc, svc.cfg.limits
        self.budget = CpuBudget(self.lim.web_cpu_per_s, WEB_CPU_BURST_S)
        self.waiting: dict[str, int] = {}        # a key's web reads waiting for their CPU share or a slot

    def _admit(self, owner: str) -> float:
        """429 past the key's queue of waiting reads or its CPU share; else the seconds to wait."""
        if self.waiting.get(owner, 0) >= MAX_WEB_QUEUE:       # a deeper queue only holds sockets: say so now
            self.svc.metrics.inc("aftraj_gateway_web_reads_limited_total")
            raise GatewayError(429, f"over {MAX_WEB_QUEUE} web reads of this key waiting: retry",
                               headers={"Retry-After": "1"})
        wait = self.budget.wait(owner)
        if wait > MAX_BUDGET_WAIT_S:
            self.svc.metrics.inc("aftraj_gateway_web_reads_limited_total")
            raise GatewayError(429, f"this key's web reads used their share of the gateway's CPU "
                                    f"({self.lim.web_cpu_per_s:g} s a second): retry", headers={
                                        "Retry-After": str(max(1, int(wait + 0.999)))})
        return wait

    def _on_thread(self, owner: str, cancel: threading.Event, fn, args, kw, render):
        c0 = time.thread_time()
        try:
            out = fn(*args, cancel=cancel, **kw)
            return render(out) if render is not None else out
        finally:
            self.budget.charge(owner, time.thread_time() - c0)

    async def _work(self, owner: str, wait: float, cancel: threading.Event, call):
        slots = self.svc.web_slots.get(owner)
        if slots is None:
            slots = self.svc.web_slots[owner] = asyncio.Semaphore(self.lim.web_reads_per_key)
        self.waiting[owner] = self.waiting.get(owner, 0) + 1
        try:
            if wait > 0:
                await asyncio.sleep(wait)    # its share of the CPU (the client may leave meanwhile)
            await slots.acquire()
        finally:
            self.waiting[owner] -= 1
            if self.waiting[owner] <= 0:
                del self.waiting[owner]
        try:
            _check(cancel)
            return await asyncio.get_running_loop().run_in_executor(self.svc.web_pool, call)
        finally:
            slots.release()

    async def read(self, request: Request | None, owner: str, fn, *args, render=None, **kw):
        svc = self.svc
        svc.begin_request(owner)
        cancel = threading.Event()
        try:
            wait = self._admit(owner)
            call = functools.partial(self._on_thread, owner, cancel, fn, args, kw, render)
            task = asyncio.ensure_future(asyncio.wait_for(self._work(owner, wait, cancel, call),
                                                          self.lim.ledger_timeout_s + 1.0))
            gone = asyncio.ensure_future(_disconnected(request)) if request is not None else None
            try:
                await asyncio.wait({task} | ({gone} if gone else set()), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if gone is not None:
                    gone.cancel()
            if not task.done():                    # the client left: stop the read between rows
                cancel.set()
                task.cancel()
                svc.metrics.inc("aftraj_gateway_web_reads_abandoned_total")
                raise Cancelled
            try:
                return task.result()
            except TimeoutError:
                cancel.set()
                raise svc._busy("reading for the web view") from None
            except svc._sa.exc.OperationalError as e:
                if is_busy(e, statement_timeout=True):
                    raise svc._busy("reading for the web view") from None
                raise
        finally:
            svc.end_request(owner)

    async def write(self, fn, *args):
        """A small write (sessions) on the web threads, busy as 503."""
        svc = self.svc
        try:
            return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(svc.web_pool, fn, *args),
                                          self.lim.ledger_timeout_s + 1.0)
        except TimeoutError:
            raise svc._busy("signing in") from None
        except svc._sa.exc.OperationalError as e:
            if is_busy(e):
                raise svc._busy("signing in") from None
            raise


class WebRoutes:
    """The handlers of GET /v1/runs and the /ui pages (`register` adds them to the app)."""

    def __init__(self, svc: GatewayService):
        self.svc, self.reads = svc, WebReads(svc)

    async def _ui_owner(self, request: Request) -> str:
        """The key's owner from the Authorization header or the sign-in's session cookie."""
        svc = self.svc
        auth = request.headers.get("authorization")
        if auth:
            return svc.authenticate(auth, _peer(request))
        token = request.cookies.get(COOKIE)
        owner = None
        if token:
            owner = await self.reads.write(session_owner, svc, token)
        if owner is None:
            return svc.authenticate(None, _peer(request))      # 401 (429 past the address's failures)
        return svc.admit(owner)

    async def runs(self, request: Request, limit: int = Query(50, ge=1, le=MAX_PAGE), after: str | None = Query(None),
                   order: str = Query("id"), state: str | None = Query(None), agent: str | None = Query(None),
                   q: str | None = Query(None), authorization: str | None = Header(None)):
        """The caller's runs, paged: `{"runs": [...], "next": cursor | null}` (run-id order, or
        `order=newest`; filters `state`, `agent`, `q`)."""
        owner = request.scope["aftraj.owner"]
        try:
            data = await self.reads.read(request, owner, list_runs, self.svc, owner, limit, after, order=order,
                                         state=state, agent=agent, q=q, render=orjson.dumps)
        except Cancelled:
            return _gone()
        return Response(data, media_type="application/json")

    async def ui_runs(self, request: Request):
        qp = request.query_params
        after, state, agent, q = qp.get("after"), qp.get("state"), qp.get("agent"), qp.get("q")
        try:
            owner = await self._ui_owner(request)
        except GatewayError as e:
            return _signed_out(request, e)
        filters = {"state": state or None, "agent": agent or None, "q": q or None, "after": after or None}
        now = time.time()
        try:
            page = await self.reads.read(request, owner, list_runs, self.svc, owner, 50, filters["after"],
                                         order="newest", state=filters["state"], agent=filters["agent"],
                                         q=filters["q"], now=now, render=lambda d: runs_page(d, owner, filters, now))
        except Cancelled:
            return _gone()
        except GatewayError as e:
            return _html(_page("AgentForesight: runs", f"<p>{_e(e.detail)}</p><p><a href=/ui>all runs</a></p>",
                               tenant=owner), e.status, e.headers)
        return _html(page)

    async def ui_login(self, request: Request):
        svc = self.svc
        if not _same_origin(request):
            svc.metrics.inc("aftraj_gateway_cross_site_refused_total")
            return _html(login_page("sign-in refused: the form was posted from another site"), 403)
        form = urllib.parse.parse_qs((await request.body()).decode("utf-8", "replace"))
        key = (form.get("key") or [""])[0].strip()
        try:
            owner = svc.authenticate(f"Bearer {key}", _peer(request))
            token = await self.reads.write(new_session, svc, owner)
        except GatewayError as e:
            return _html(login_page(e.detail), e.status, e.headers)
        resp = RedirectResponse("/ui", status_code=303, headers=_headers())
        resp.set_cookie(COOKIE, token, max_age=int(svc.cfg.session_ttl_s), httponly=True, samesite="strict",
                        path="/ui", secure=request.url.scheme == "https")
        resp.delete_cookie(OLD_COOKIE, path="/ui")
        return resp

    async def ui_logout(self, request: Request):
        if not _same_origin(request):
            return _html(login_page("sign-out refused: the form was posted from another site"), 403)
        token = request.cookies.get(COOKIE)
        if token and len(token) <= 128:
            await self.reads.write(end_session, self.svc, token)
        resp = RedirectResponse("/ui", status_code=303, headers=_headers())
        resp.delete_cookie(COOKIE, path="/ui")
        resp.delete_cookie(OLD_COOKIE, path="/ui")
        return resp

    async def ui_js(self, _request: Request):
        return Response(APP_JS, media_type="text/javascript", headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})

    async def favicon(self, _request: Request):             # browsers ask for it: no icon, and no 404 in their console
        return Response(status_code=204, headers={"Cache-Control": "max-age=86400"})

    async def ui_css(self, _request: Request):
        return Response(CSS, media_type="text/css", headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})

    async def _data(self, request: Request, render):
        run_id, start = request.path_params["run_id"], request.query_params.get("start")
        try:
            owner = await self._ui_owner(request)
        except GatewayError as e:
            return None, _signed_out(request, e)
        if start is not None:
            start = url_int(start)
            if start is None:
                return None, _html(_page("bad request", "<p>start must be an integer &gt;= 0</p>", tenant=owner), 422)
        try:
            return await self.reads.read(request, owner, run_page_data, self.svc, owner, run_id, start,
                                         render=render), None
        except Cancelled:
            return None, _gone()
        except GatewayError as e:
            return None, _html(_page("not found" if e.status == 404 else "busy",
                                     f"<p>{_e(e.detail)}</p><p><a href=/ui>all runs</a></p>", tenant=owner),
                               e.status, e.headers)

    async def ui_run(self, request: Request):
        page, err = await self._data(request, run_page)
        return err or _html(page)

    async def ui_fragment(self, request: Request):
        page, err = await self._data(request, timeline)
        return err or _html(page)

    async def ui_step(self, request: Request):
        run_id, index = request.path_params["run_id"], url_int(request.path_params["index"])
        try:
            owner = await self._ui_owner(request)
        except GatewayError as e:
            return _signed_out(request, e)
        if index is None:
            return _html(_page("not found", "<p>no such step</p>", tenant=owner), 404)
        try:
            text = await self.reads.read(request, owner, step_text, self.svc, owner, run_id, index)
        except Cancelled:
            return _gone()
        except GatewayError as e:
            return _html(_page("not found", f"<p>{_e(e.detail)}</p>", tenant=owner), e.status, e.headers)
        return Response(text, media_type="text/plain; charset=utf-8", headers=_headers())

    async def ui_stream(self, request: Request):
        owner = await self._ui_owner(request)           # 401/429 as a Problem (EventSource retries)
        items = await self.svc.stream(owner, request.path_params["run_id"],
                                      resume_after(request.headers.get("last-event-id")))

        async def gen():
            async for seq, data in items:
                yield b": keep-alive\n\n" if seq is None else b"event: verdict\nid: %d\ndata: " % seq + data + b"\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# (path, handler, method, in the OpenAPI schema: its `responses`, else None)
ROUTES = (
    ("/v1/runs", "runs", "GET", {401: {}, 422: {}, 429: {}}),
    ("/ui", "ui_runs", "GET", None),
    ("/ui/login", "ui_login", "POST", None),
    ("/ui/logout", "ui_logout", "POST", None),
    ("/ui/app.js", "ui_js", "GET", None),
    ("/favicon.ico", "favicon", "GET", None),
    ("/ui/app.css", "ui_css", "GET", None),
    ("/ui/runs/{run_id}", "ui_run", "GET", None),
    ("/ui/runs/{run_id}/fragment", "ui_fragment", "GET", None),
    ("/ui/runs/{run_id}/steps/{index}", "ui_step", "GET", None),
    ("/ui/runs/{run_id}/stream", "ui_stream", "GET", None),
)


def register(app: FastAPI, svc: GatewayService):
    """Add `GET /v1/runs` and the /ui pages to the gateway's app (called by serve.router.build_app);
    returns the verdict emitter the events route calls (`verdict_emitter`). The /ui pages are plain
    Starlette routes (they read their own path and query values): FastAPI's parameter handling and
    response checks cost ~0.7 ms of the event loop a request, which a tenant hammering the web
    view took from the others' posts (issue 45); only `GET /v1/runs` is in the OpenAPI schema."""
    routes = WebRoutes(svc)
    for path, name, method, responses in ROUTES:
        if responses is None:
            app.router.routes.append(Route(path, getattr(routes, name), methods=[method], include_in_schema=False))
        else:
            app.add_api_route(path, getattr(routes, name), methods=[method], responses=responses)
    return verdict_emitter(svc)


__all__ = ["list_runs", "register", "run_page_data", "timeline"]
