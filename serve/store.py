"""What the gateway keeps in its database beside the events: the ledger (`aftraj.ledger.SqlLedger`,
SQLite or PostgreSQL) and the gateway's own tables, with every read and write of them that the
service makes (the web view reads the same tables: serve.web).

    store = Store(cfg)                # cfg: serve.config.GatewayConfig; creates missing tables
    store.verdict_page("team-a/run-1", after_seq=-1, limit=100)   # [(seq, stored JSON bytes)]

Tables: aftraj_runs (a run's record and owner), aftraj_verdicts (one verdict a prefix, by seq),
aftraj_alarms (a pointer to a run's first ALARM verdicts), aftraj_run_index (runs in creation
order, for the run list), aftraj_run_agents (the agents seen in a run's events), aftraj_sessions
(web sign-ins: a token's sha256, never the key). A ledger written before the index tables is
backfilled once, at start. Every method here blocks (the service runs them on its threads).
"""

from __future__ import annotations

import logging
import os
import time

import orjson
import sqlalchemy as sa

from aftraj.ledger import SqlLedger

log = logging.getLogger("aftraj.gateway")

HISTORY_PAGE = 100         # stored verdicts read from the database at a time (streams, `verdicts`)


def storage_key(owner: str, run_id: str) -> str:
    """Where a tenant's run lives in the database: key names never hold '/', so ids never meet."""
    return f"{owner}/{run_id}"


def _tables(md: sa.MetaData) -> dict[str, sa.Table]:
    return {
        "runs_table": sa.Table(
            "aftraj_runs", md,
            sa.Column("run_id", sa.String(200), primary_key=True),
            sa.Column("owner", sa.String(64), nullable=False),
            sa.Column("record", sa.LargeBinary, nullable=False)),
        "verdicts_table": sa.Table(
            "aftraj_verdicts", md,
            sa.Column("run_id", sa.String(200), primary_key=True),
            sa.Column("seq", sa.BigInteger, primary_key=True),
            sa.Column("record", sa.LargeBinary, nullable=False)),
        # the first ALARM verdicts of each run (a pointer into aftraj_verdicts): the web view and
        # the run list find a run's first ALARM without reading its verdicts
        "alarms_table": sa.Table(
            "aftraj_alarms", md,
            sa.Column("run_id", sa.String(200), primary_key=True),
            sa.Column("seq", sa.BigInteger, primary_key=True)),
        # runs in creation order (n), with their creation time: the run list, newest first
        "run_index_table": sa.Table(
            "aftraj_run_index", md,
            sa.Column("n", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("run_id", sa.String(200), nullable=False, unique=True),
            sa.Column("owner", sa.String(64), nullable=False, index=True),
            sa.Column("created", sa.Float, nullable=True)),
        # the agents seen in a run's events (hook-created runs name none at creation)
        "run_agents_table": sa.Table(
            "aftraj_run_agents", md,
            sa.Column("run_id", sa.String(200), primary_key=True),
            sa.Column("agent", sa.String(512), primary_key=True)),
        # web sign-ins: the cookie holds a random token, stored here as its sha256 (never the key)
        "sessions_table": sa.Table(
            "aftraj_sessions", md,
            sa.Column("token_sha256", sa.String(64), primary_key=True),
            sa.Column("owner", sa.String(64), nullable=False),
            sa.Column("expires", sa.Float, nullable=False)),
    }


class Store:
    """The ledger and the gateway's tables (see the module docstring)."""

    def __init__(self, ledger_url: str, ledger_timeout_s: float):
        if ledger_url.startswith("sqlite:///"):
            path = ledger_url[len("sqlite:///"):]
            if path and path != ":memory:":
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # tenants' ids never meet; a held lock makes a write wait at most ledger_timeout_s
        # threaded: the service's threads write through one in-process lock (no busy-handler
        # sleeps) and SQLite's WAL checkpoints run on the ledger's own thread, not in a request
        self.ledger = SqlLedger(ledger_url, id_scope="run", busy_timeout_s=ledger_timeout_s, threaded=True)
        tables = _tables(self.ledger.metadata)
        self.runs_table, self.verdicts_table = tables["runs_table"], tables["verdicts_table"]
        self.alarms_table, self.run_index_table = tables["alarms_table"], tables["run_index_table"]
        self.run_agents_table, self.sessions_table = tables["run_agents_table"], tables["sessions_table"]
        had = set(sa.inspect(self.ledger.engine).get_table_names())
        self.ledger.metadata.create_all(self.ledger.engine)
        # a verdict stored with its events: a seq answered already (another process) keeps its verdict
        dialect = self.ledger.engine.dialect.name
        if dialect in ("sqlite", "postgresql"):
            ins = __import__(f"sqlalchemy.dialects.{dialect}", fromlist=["insert"]).insert
            self.insert_verdict = ins(self.verdicts_table).on_conflict_do_nothing()
            # an insert that skips a row already there (the index tables: another process wrote it)
            self.insert_ignore = lambda table: ins(table).on_conflict_do_nothing()
        else:
            self.insert_verdict = self.verdicts_table.insert()
            self.insert_ignore = None
        if "aftraj_runs" in had and not {"aftraj_alarms", "aftraj_run_index", "aftraj_run_agents"} <= had:
            self._backfill_indexes()

    # ------------------------------------------------------------------ runs
    def insert_run(self, owner: str, key: str, rec: dict, started) -> None:
        """The run, its index row and its run_started event, or none of them (IntegrityError:
        the id is taken)."""
        with self.ledger.write() as conn:
            conn.execute(self.runs_table.insert().values(run_id=key, owner=owner, record=orjson.dumps(rec)))
            conn.execute(self.run_index_table.insert().values(run_id=key, owner=owner, created=time.time()))
            self.ledger._store(conn, [started])

    def run_row(self, owner: str, run_id: str, key: str):
        """(storage key, owner, record bytes) of the run, or None. A run created before ids were
        scoped by key (stored under the bare id) is found for its owner."""
        t = self.runs_table
        with self.ledger.reader.connect() as conn:
            row = conn.execute(sa.select(t.c.run_id, t.c.owner, t.c.record).where(t.c.run_id == key)).first()
            if row is None:
                row = conn.execute(sa.select(t.c.run_id, t.c.owner, t.c.record).where(
                    t.c.run_id == run_id, t.c.owner == owner)).first()
        return row

    def events_after(self, key: str, after_seq: int):
        """The query of the run's stored events past `after_seq`: (seq, event_id, record), by seq."""
        t = self.ledger.table
        return sa.select(t.c.seq, t.c.event_id, t.c.record).where(
            t.c.run_id == key, t.c.seq > after_seq).order_by(t.c.seq)

    def agents_seen(self, r) -> set[str]:
        """The agents recorded for run `r` in aftraj_run_agents (read once a run load)."""
        if r.agents_seen is None:
            t = self.run_agents_table
            with self.ledger.reader.connect() as conn:
                r.agents_seen = {a for (a,) in conn.execute(sa.select(t.c.agent).where(t.c.run_id == r.key))}
        return r.agents_seen

    def record_agents(self, conn, key: str, agents) -> None:
        conn.execute(self.insert_ignore(self.run_agents_table), [{"run_id": key, "agent": a} for a in agents])

    # ------------------------------------------------------------------ verdicts
    def store_verdict(self, key: str, seq: int, data: bytes, alarm_of=None) -> None:
        """Store a verdict (`alarm_of`: the run, when it is an ALARM: noted in aftraj_alarms)."""
        t = self.verdicts_table
        try:
            with self.ledger.write() as conn:
                conn.execute(t.insert().values(run_id=key, seq=seq, record=data))
                if alarm_of is not None:
                    self.note_alarm(conn, alarm_of, {"decision": "ALARM", "seq": seq})
        except sa.exc.IntegrityError:
            pass       # another process answered this prefix first; its verdict stands

    def note_alarm(self, conn, r, v: dict) -> None:
        """Point aftraj_alarms at an ALARM verdict of run `r` (the first few only: once one is
        noted by this process, later ALARMs of the run are not)."""
        if v.get("decision") == "ALARM" and not r.alarm_stored:
            stmt = self.insert_ignore(self.alarms_table) if self.insert_ignore else self.alarms_table.insert()
            conn.execute(stmt.values(run_id=r.key, seq=v["seq"]))
            r.alarm_stored = True

    def stored_verdict(self, key: str, seq: int) -> dict | None:
        t = self.verdicts_table
        with self.ledger.reader.connect() as conn:
            row = conn.execute(sa.select(t.c.record).where(t.c.run_id == key, t.c.seq == seq)).first()
        return None if row is None else orjson.loads(row[0])

    def verdict_page(self, key: str, after_seq: int = -1, limit: int = HISTORY_PAGE) -> list[tuple[int, bytes]]:
        """Stored verdicts after `after_seq`, at most `limit`, as (seq, stored JSON bytes)."""
        t = self.verdicts_table
        with self.ledger.reader.connect() as conn:
            return [(s, bytes(rec)) for s, rec in conn.execute(
                sa.select(t.c.seq, t.c.record).where(t.c.run_id == key, t.c.seq > after_seq)
                .order_by(t.c.seq).limit(limit))]

    def verdicts(self, key: str) -> list[dict]:
        """Every stored verdict of the run stored under `key`."""
        out, after = [], -1
        while True:
            page = self.verdict_page(key, after)
            out += [orjson.loads(rec) for _, rec in page]
            if len(page) < HISTORY_PAGE:
                return out
            after = page[-1][0]

    def count_verdicts(self, key: str) -> int:
        t = self.verdicts_table
        with self.ledger.reader.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).where(t.c.run_id == key)).scalar() or 0)

    # ------------------------------------------------------------------ a ledger of an older version
    def _backfill_indexes(self) -> None:
        """A ledger written before the index tables (aftraj_run_index, aftraj_run_agents,
        aftraj_alarms): fill them once, at start, from the runs, events and verdicts."""
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
            if self.insert_ignore is None:
                return
            pairs = [{"run_id": k, "agent": a} for k, a in conn.execute(
                sa.select(ev.c.run_id, ev.c.agent).where(ev.c.seq > 0).distinct())]
            if pairs:
                conn.execute(self.insert_ignore(ag), pairs)
            first: dict[str, int] = {}
            for k, seq, rec in conn.execute(sa.select(vt.c.run_id, vt.c.seq, vt.c.record).order_by(vt.c.run_id,
                                                                                                    vt.c.seq)):
                if k not in first and b'"decision":"ALARM"' in bytes(rec):
                    first[k] = seq
            if first:
                conn.execute(self.insert_ignore(al), [{"run_id": k, "seq": q} for k, q in first.items()])

    def close(self) -> None:
        self.ledger.close()


__all__ = ["HISTORY_PAGE", "Store", "storage_key"]
