"""The append-only event ledger: idempotent by event_id, ordered by seq within a run, resumable.

- `Ledger`: the in-memory index every backend shares. An identical duplicate (same event_id,
  run, kind, agent, parent, payload fingerprint and usage) is counted and ignored; a different
  event under an existing id is a `LedgerError` naming both; a seq not above the run's last is
  rejected (out of order); a missing seq is assigned (last + 1).
- `JsonlLedger`: the ledger as a JSON Lines file (one event a line), appended and flushed.
- `read_events(path, offset)`: stream a JSONL ledger from a byte offset; each item says where
  the next read resumes. Malformed or unexpected records are reported with file, line and
  field and never block the records after them.
- `LineSplitter`: turns arbitrary byte chunks (a socket, a stream cut mid-record) into lines.
- `SqlLedger`: the same ledger in a database through SQLAlchemy (SQLite by default, any
  SQLAlchemy URL), resumable from a sequence number per run.

    aftraj fold ledger.jsonl --run r1          # reads through read_events
    from aftraj.ledger import JsonlLedger; JsonlLedger("runs/ledger.jsonl").append(event)
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from aftraj.events import _MAX_SEQ, Event, EventError, parse_event

_loads = orjson.loads
_JSONError = orjson.JSONDecodeError

# How many rejected records a report keeps in full (all of them are counted).
MAX_KEPT_ERRORS = 10_000


class LedgerError(EventError):
    """An event the ledger refuses: a conflicting duplicate id, or out of order within its run."""

    def __init__(self, message: str, *, code: str, field: str = "event_id", source=None, line=None):
        self.code = code
        super().__init__(message, field=field, source=source, line=line)

    def located(self, source, line) -> LedgerError:
        return LedgerError(self.message, code=self.code, field=self.field, source=source, line=line)


@dataclass
class IngestReport:
    """What an ingest accepted, ignored and rejected. `errors` keeps the first MAX_KEPT_ERRORS."""

    source: str = ""
    n_records: int = 0
    n_appended: int = 0
    n_duplicates: int = 0
    n_rejected: int = 0
    n_filtered: int = 0
    errors: list[EventError] = field(default_factory=list)
    rejected_by_field: Counter = field(default_factory=Counter)
    next_offset: int = 0
    next_line: int = 1
    # bytes of an incomplete last line (no newline, not yet valid JSON: a writer is mid-append)
    # left unread; `next_offset` points at its start, so a later read picks up the whole record
    pending_bytes: int = 0

    def reject(self, err: EventError) -> None:
        self.n_rejected += 1
        self.rejected_by_field[err.field] += 1
        if len(self.errors) < MAX_KEPT_ERRORS:
            self.errors.append(err)

    def to_dict(self) -> dict:
        return {"source": self.source, "records": self.n_records, "appended": self.n_appended,
                "duplicates": self.n_duplicates, "rejected": self.n_rejected,
                "filtered": self.n_filtered, "next_offset": self.next_offset,
                "next_line": self.next_line, "pending_bytes": self.pending_bytes,
                "rejected_by_field": dict(sorted(self.rejected_by_field.items())),
                "errors": [str(e) for e in self.errors[:100]]}


class Ledger:
    """The in-memory, append-only index of events; backends add storage around `append`."""

    def __init__(self) -> None:
        # event_id -> (run_id, kind, agent, parent_id, fingerprint, usage, seq)
        self._index: dict[str, tuple] = {}
        self._last_seq: dict[str, int] = {}
        self.n_appended = 0
        self.n_duplicates = 0

    def __len__(self) -> int:
        return self.n_appended

    def __contains__(self, event_id: str) -> bool:
        return event_id in self._index

    def runs(self) -> list[str]:
        return list(self._last_seq)

    def last_seq(self, run_id: str) -> int:
        """The last sequence number of a run (-1 when none): resume a database read after it."""
        return self._last_seq.get(run_id, -1)

    def admit(self, ev: Event) -> bool:
        """Check and index `ev`: True if new, False for an identical duplicate; raises LedgerError.

        Assigns `ev.seq` when it is missing."""
        eid = ev.event_id
        prev = self._index.get(eid)
        if prev is not None:
            if (prev[0] == ev.run_id and prev[4] == ev.fingerprint and prev[1] == ev.kind
                    and prev[2] == ev.agent and prev[3] == ev.parent_id and prev[5] == ev.usage):
                self.n_duplicates += 1
                return False
            raise LedgerError(
                f"event_id {eid!r} already holds a different event: first {prev[1]} by "
                f"{prev[2]!r} in run {prev[0]!r} at seq {prev[6]} (fingerprint {prev[4][:12]}), "
                f"now {ev.kind} by {ev.agent!r} in run {ev.run_id!r} at seq {ev.seq} "
                f"(fingerprint {ev.fingerprint[:12]})", code="conflict")
        run = ev.run_id
        last = self._last_seq.get(run, -1)
        seq = ev.seq
        if seq is None:
            if last + 1 >= _MAX_SEQ:
                raise _seq_exhausted(eid, run, last)
            ev.seq = seq = last + 1
        elif seq <= last:
            raise LedgerError(f"seq {seq} of event {eid!r} is not after the run's last seq {last} "
                              f"(events are ordered by seq within run {run!r})",
                              code="out_of_order", field="seq")
        self._last_seq[run] = seq
        self._index[eid] = (run, ev.kind, ev.agent, ev.parent_id, ev.fingerprint, ev.usage, seq)
        self.n_appended += 1
        return True

    def append(self, ev: Event) -> bool:
        return self.admit(ev)

    def stored_seq(self, event_id: str) -> int | None:
        """The seq under which `event_id` is stored (None when it is not): a folder that sees a
        duplicate it has not folded yet (its run state is behind) folds it under this seq."""
        ix = self._index.get(event_id)
        return None if ix is None else ix[6]

    def _forget(self, ev: Event, had_seq: bool, last: int | None) -> None:
        """Undo `admit(ev)` when storing it failed, so a retry is appended, not ignored as a
        duplicate of an event that was never stored. `last`: the run's last seq before."""
        del self._index[ev.event_id]
        if last is None:
            del self._last_seq[ev.run_id]
        else:
            self._last_seq[ev.run_id] = last
        self.n_appended -= 1
        if not had_seq:
            ev.seq = None


# --------------------------------------------------------------------------- JSON Lines

class LineSplitter:
    """Bytes in arbitrary chunks -> complete lines (b'...\\n'); `flush()` returns a last line
    that has no newline (a record at end of stream)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk
        if b"\n" not in chunk:
            self._buf = buf
            return []
        lines = buf.split(b"\n")
        self._buf = lines.pop()
        return [ln + b"\n" for ln in lines]

    def flush(self) -> list[bytes]:
        rest, self._buf = self._buf, b""
        return [rest] if rest else []


def decode_line(raw: bytes) -> Event:
    """One JSONL line -> Event, or EventError naming the field."""
    try:
        d = _loads(raw)
    except _JSONError as e:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as ue:
            raise EventError(f"invalid UTF-8 at byte {ue.start}", field="<record>") from None
        raise EventError(f"invalid JSON: {e}", field="<record>") from None
    return parse_event(d)


def read_events(path: str | Path, offset: int = 0, *, first_line: int = 1,
                report: IngestReport | None = None) -> Iterator[tuple[int, int, Event | EventError]]:
    """Yield `(line, next_offset, Event or EventError)` from byte `offset` of a JSONL ledger.

    `next_offset` is where a later read resumes (it always points at a record boundary). A
    last line without newline is a record if it decodes as JSON; otherwise it is a record still
    being written: it is left unread (`report.pending_bytes`) and `next_offset` stays before it,
    so resuming later reads it whole instead of rejecting its two halves."""
    src = str(path)
    pending = 0
    with open(path, "rb") as f:
        f.seek(offset)
        line = first_line - 1
        for raw in f:
            try:
                item: Event | EventError = decode_line(raw)
            except EventError as e:
                if not raw.strip():             # a blank line is not a record
                    line += 1
                    offset += len(raw)
                    continue
                if is_torn(raw):
                    pending = len(raw)
                    break
                item = e.located(src, line + 1)
            line += 1
            offset += len(raw)
            yield line, offset, item
    if report is not None:
        report.source = src
        report.next_offset, report.next_line, report.pending_bytes = offset, line + 1, pending


def is_torn(raw: bytes) -> bool:
    """A last line with no newline that is not valid JSON: a record a writer has not finished."""
    if raw.endswith(b"\n"):
        return False
    try:
        _loads(raw)
    except _JSONError:
        return True
    return False


class JsonlLedger(Ledger):
    """A ledger stored as one JSONL file; existing records are indexed when it is opened.

    Every record this ledger writes starts on a line of its own: a last line without its
    newline (written by another tool, or cut by a crash or a failed write) is completed before
    the next append, never glued to it. `iter_stored` replays what the file holds, so a
    `Folder` over a JSONL ledger resumes with `catch_up()` as over a database."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.report = IngestReport(source=str(self.path))
        if self.path.exists():
            for line, _, item in read_events(self.path, report=self.report):
                self.report.n_records += 1
                if isinstance(item, EventError):
                    self.report.reject(item)
                    continue
                try:
                    if self.admit(item):
                        self.report.n_appended += 1
                    else:
                        self.report.n_duplicates += 1
                except LedgerError as e:
                    self.report.reject(e.located(str(self.path), line))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a+b")     # readable too: _terminate reads the last byte
        # a last line without its newline: a complete record (indexed above) is completed; a
        # torn one (a crash mid-append) is ended, so it stays a rejected line of its own
        self._unterminated = True
        self._terminate()

    def _terminate(self) -> None:
        """End the file's last line if it lacks its newline (checked only when it may)."""
        if not self._unterminated:
            return
        fd = self._f.fileno()
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            self._f.write(b"\n")
            self._f.flush()
        self._unterminated = False

    def append(self, ev: Event) -> bool:
        had_seq, last = ev.seq is not None, self._last_seq.get(ev.run_id)
        line = ev.dumps()                   # before admit: an unwritable event is not indexed
        self._terminate()
        if not self.admit(ev):
            return False
        if not had_seq:                     # admit assigned the seq
            line = ev.dumps()
        try:
            self._f.write(line + b"\n")
            self._f.flush()
        except BaseException:
            # part of the line may have reached the file: the next append completes it first
            self._unterminated = True
            self._forget(ev, had_seq, last)
            raise
        return True

    def iter_stored(self, after_seq=lambda run_id: -1) -> Iterator[Event]:
        """The events this ledger holds, in file order, each once, as they were indexed (a
        rejected or conflicting record never comes back), skipping those whose seq is not above
        `after_seq(run_id)` (evaluated as the replay goes: a folder passes its runs' last seq)."""
        self._f.flush()
        seen: dict[str, int] = {}
        for _, _, item in read_events(self.path):
            if isinstance(item, EventError):
                continue
            ix = self._index.get(item.event_id)
            run = item.run_id
            if item.seq is None:            # indexed with the seq admit assigned on open
                item.seq = seen.get(run, -1) + 1
            if ix is None or ix[0] != run or ix[6] != item.seq or ix[4] != item.fingerprint:
                continue
            seen[run] = item.seq
            if item.seq > after_seq(run):
                yield item

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> JsonlLedger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- database

class SqlLedger(Ledger):
    """The ledger in a SQL database (SQLAlchemy Core; `sqlite:///ledger.db` by default, any
    SQLAlchemy URL such as `postgresql+psycopg://…` for several writer processes).

    The database is the index: idempotency is its primary key on `event_id` (with `id_scope="run"`:
    on `(run_id, event_id)`) and per-run order
    its unique key on `(run_id, seq)`; nothing of the table is loaded into memory (the old
    version indexed every id at open). `append_many(events)` stores a batch in one transaction
    and returns once it is committed, so an acknowledged event is durable: a duplicate
    (identical kind, agent, parent, payload fingerprint, usage, ts, meta, and seq when given) is
    skipped, a different event (a resend with another seq, ts or meta included) under a stored id is a `LedgerError(code="conflict")`, a seq not above the run's last is
    `LedgerError(code="out_of_order", field="seq")`, and any error rolls the whole batch back
    (seqs it assigned are cleared). On PostgreSQL the writers of one run take turns: a batch
    takes each of its runs' advisory lock before it reads (`_lock_runs`), so under READ
    COMMITTED no two writers extend the same tail (each seq assigned once, an identical resend
    a duplicate, never 'out of order'). Writers still racing on one key (another database, or
    two runs sharing an id with `id_scope="global"`): the loser's insert violates the key, its
    transaction is retried once against what the winner stored.
    SQLite runs in WAL mode, transactions BEGIN IMMEDIATE (writers queue on the lock, with a 30 s
    busy timeout) except reads through `ledger.reader` (deferred: they never hold the lock),
    `busy_timeout_s` bounds a wait for a lock another connection holds (SQLite's busy timeout,
    PostgreSQL's `lock_timeout`); past it the statement fails (OperationalError).
    `synchronous=NORMAL` (durable across a process crash such as
    `kill -9`; a power loss may drop the last commits: use `synchronous=FULL` via `sqlite_sync`).
    `threaded=True` (the gateway: many threads write through one ledger; SQLite files only): the
    process's writes take an in-process lock before BEGIN IMMEDIATE (a waiting thread wakes as the
    lock is freed; on SQLite's own lock it polls with the busy handler's sleeps, which back off to
    100 ms), and WAL checkpoints run on a background thread (`Checkpointer`), rarely, instead of
    inside the commit that crosses `wal_autocheckpoint` (that request would pay the checkpoint's
    two fsyncs, and the restart after it a third).
    Durability is unchanged: a commit is in the WAL before it returns, checkpointed or not.
    On SQLite a batch's three statements (the stored ids, the run's last seq, the insert) run as
    plain SQL on the driver's cursor, inside the same transaction, and what the driver raises
    is re-raised as SQLAlchemy's exception (IntegrityError, OperationalError, …): building and
    compiling them through SQLAlchemy is most of a small batch's time, all of it holding the
    write lock, which the other writer threads queue on.
    `write()` is the one way to write (a transaction, committed on exit).
    `iter_run(run_id, after_seq)` resumes a run from a sequence number. After `append_many`,
    `last_seq_before[run]` is each run's last seq as the committed transaction found it (a
    reader folding the run can skip re-reading its own events when nothing came in between).
    `id_scope="run"` (the gateway's: tenants choose their own ids) makes an event's identity
    `(run_id, event_id)`: the same id in two runs is two events, and a conflict names only the
    run's own stored event; the default `"global"` keeps one id space (the folder's contract)."""

    def __init__(self, url: str = "sqlite:///ledger.db", *, sqlite_sync: str = "NORMAL",
                 id_scope: str = "global", busy_timeout_s: float = 30.0, threaded: bool = False) -> None:
        super().__init__()
        self._write_lock: threading.Lock | None = None
        self.checkpointer: Checkpointer | None = None
        self.busy_timeout_s = busy_timeout_s
        if id_scope not in ("global", "run"):
            raise ValueError(f"id_scope must be 'global' or 'run', got {id_scope!r}")
        self.id_scope = id_scope
        self.last_seq_before: dict[str, int] = {}
        import sqlalchemy as sa

        self._sa = sa
        self.url = url
        if url.startswith("sqlite"):
            if sqlite_sync not in ("OFF", "NORMAL", "FULL", "EXTRA"):
                raise ValueError(f"sqlite_sync must be OFF, NORMAL, FULL or EXTRA, got {sqlite_sync!r}")
            self.engine = sa.create_engine(url, connect_args={"timeout": busy_timeout_s})
            path = sa.engine.make_url(url).database
            on_disk = threaded and bool(path) and path != ":memory:" and not path.startswith("file:")
            if threaded:
                self._write_lock = threading.Lock()

            @sa.event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn, _record):
                dbapi_conn.isolation_level = None     # we emit BEGIN ourselves (below)
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute(f"PRAGMA synchronous={sqlite_sync}")
                if on_disk:                           # the checkpointer's thread does it instead
                    cur.execute("PRAGMA wal_autocheckpoint=0")
                cur.close()

            @sa.event.listens_for(self.engine, "begin")
            def _begin(conn):
                # a write transaction takes the write lock up front: a deferred transaction that
                # read, then writes after another process committed, fails with "database is
                # locked" (a stale WAL snapshot) instead of waiting its turn. Reads stay deferred
                # (BEGIN): in WAL mode they never block a writer.
                conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("aftraj_read")
                                     else "BEGIN IMMEDIATE")
        elif url.startswith("postgresql") and "pg8000" not in url and "asyncpg" not in url:
            # a lock held elsewhere makes a statement fail after busy_timeout_s, never wait forever
            self.engine = sa.create_engine(url, pool_pre_ping=True, connect_args={
                "options": f"-c lock_timeout={int(busy_timeout_s * 1000)}"})
        else:
            self.engine = sa.create_engine(url, pool_pre_ping=True)
        self.reader = self.engine.execution_options(aftraj_read=True)   # `with ledger.reader.connect()`
        md = sa.MetaData()
        self.table = sa.Table(
            "aftraj_events" if id_scope == "global" else "aftraj_run_events", md,
            sa.Column("event_id", sa.String(512), primary_key=True),
            sa.Column("run_id", sa.String(512), nullable=False, index=True, primary_key=id_scope == "run"),
            sa.Column("seq", sa.BigInteger, nullable=False),
            sa.Column("kind", sa.String(32), nullable=False),
            sa.Column("agent", sa.String(512), nullable=False),
            sa.Column("parent_id", sa.String(512), nullable=True),
            sa.Column("fingerprint", sa.String(64), nullable=False),
            sa.Column("usage", sa.LargeBinary, nullable=True),
            sa.Column("record", sa.LargeBinary, nullable=False),
            sa.UniqueConstraint("run_id", "seq", name="uq_aftraj_events_run_seq"),
        )
        self.metadata = md
        md.create_all(self.engine)
        self._sqlite = self.engine.dialect.name == "sqlite" and self.engine.driver == "pysqlite"
        self._pg = self.engine.dialect.name == "postgresql"
        cols = self._cols = [c.name for c in self.table.c]
        self._sql_select = f"SELECT {', '.join(cols)} FROM {self.table.name}"
        self._sql_insert = (f"INSERT INTO {self.table.name} ({', '.join(cols)}) "
                            f"VALUES ({', '.join('?' * len(cols))})")
        if self._write_lock is not None and on_disk:
            self.checkpointer = Checkpointer(path, self._write_lock, busy_timeout_s)
            weakref.finalize(self, self.checkpointer.stop, False)    # a ledger dropped unclosed

    def close(self) -> None:
        """Stop the checkpointer (a last checkpoint first) and close the pooled connections."""
        if self.checkpointer is not None:
            self.checkpointer.stop()
        self.engine.dispose()

    @contextlib.contextmanager
    def write(self):
        """A write transaction on the engine, committed on exit (rolled back on an error). With
        `threaded`, at most one thread of the process writes at a time; a wait for that past
        `busy_timeout_s` is an OperationalError "database is locked", as SQLite's own."""
        lock = self._write_lock
        if lock is not None and not lock.acquire(timeout=self.busy_timeout_s):
            import sqlite3

            raise self._sa.exc.OperationalError(
                "BEGIN IMMEDIATE", None, sqlite3.OperationalError(
                    f"database is locked (this process's writers held it over {self.busy_timeout_s:g} s)"))
        try:
            with self.engine.begin() as conn:
                yield conn
        finally:
            if lock is not None:
                lock.release()
        if self.checkpointer is not None:
            self.checkpointer.committed()

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        sa = self._sa
        with self.reader.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(self.table)).scalar_one()

    def __contains__(self, event_id: str) -> bool:
        sa, t = self._sa, self.table
        with self.reader.connect() as conn:
            return conn.execute(sa.select(t.c.seq).where(t.c.event_id == event_id)).first() is not None

    def runs(self) -> list[str]:
        sa, t = self._sa, self.table
        with self.reader.connect() as conn:
            return [r for (r,) in conn.execute(sa.select(t.c.run_id).distinct().order_by(t.c.run_id))]

    def last_seq(self, run_id: str) -> int:
        sa, t = self._sa, self.table
        with self.reader.connect() as conn:
            v = conn.execute(sa.select(sa.func.max(t.c.seq)).where(t.c.run_id == run_id)).scalar()
        return -1 if v is None else v

    def iter_run(self, run_id: str, after_seq: int = -1) -> Iterator[Event]:
        sa, t = self._sa, self.table
        q = sa.select(t.c.record).where(t.c.run_id == run_id, t.c.seq > after_seq).order_by(t.c.seq)
        with self.reader.connect() as conn:
            for (rec,) in conn.execute(q):
                yield parse_event(orjson.loads(rec))

    # ------------------------------------------------------------------ writes
    def admit(self, ev: Event) -> bool:
        return self.append(ev)

    def append(self, ev: Event) -> bool:
        return self.append_many([ev])[0]

    def append_many(self, events: list[Event]) -> list[bool]:
        """Store a batch in one transaction: True per new event, False per identical duplicate."""
        out, self.last_seq_before = self.append_batch(events)
        return out

    def append_batch(self, events: list[Event], then=None) -> tuple[list[bool], dict[str, int]]:
        """`append_many` for callers in several threads: also returns the per-run last seq as
        the committed transaction found it (instead of setting the shared `last_seq_before`).
        `then(conn, added, last_seq_before)`, if given, runs in the same transaction after the
        events are written and before the commit (what it writes is committed with them, in
        one commit; if it raises, nothing is); once it has run the batch is not retried."""
        for ev in events:
            ev.dumps()                      # an unwritable event fails before anything is stored
            for f in ("event_id", "run_id", "agent", "parent_id"):
                v = getattr(ev, f)
                if v is not None and "\x00" in v:     # PostgreSQL's text refuses NUL
                    raise EventError("must not contain a NUL character", field=f)
        had_seq = [ev.seq is not None for ev in events]
        ran = False
        for attempt in (0, 1):
            try:
                with self.write() as conn:
                    out, before = self._store(conn, events)
                    if then is not None:
                        ran = True
                        then(conn, out, before)
                self.n_appended += sum(out)
                self.n_duplicates += len(out) - sum(out)
                return out, before
            except self._sa.exc.IntegrityError:
                self._reset(events, had_seq)
                if attempt or ran:
                    raise
            except BaseException:
                self._reset(events, had_seq)
                raise
        raise AssertionError("unreachable")

    @staticmethod
    def _same_rest(record: bytes | None, ev: Event) -> bool:
        """The stored record's ts and meta are the resent event's (None: stored by this batch)."""
        if record is None:
            return True
        d = orjson.loads(record)
        return d.get("ts") == ev.ts and (d.get("meta") or {}) == (ev.meta or {})

    @staticmethod
    def _reset(events, had_seq) -> None:
        for ev, had in zip(events, had_seq, strict=True):
            if not had:
                ev.seq = None

    def _store(self, conn, events: list[Event]) -> tuple[list[bool], dict[str, int]]:
        if not self._sqlite:
            return self._store_in(conn, events, None)
        import sqlite3

        try:
            return self._store_in(conn, events, conn.connection.driver_connection.cursor())
        except sqlite3.Error as e:          # as SQLAlchemy's own (IntegrityError, OperationalError, …)
            raise self._sa.exc.DBAPIError.instance(None, None, e, sqlite3.Error) from e

    def _lock_runs(self, conn, runs: set[str]) -> None:
        """PostgreSQL: take each run's transaction-scoped advisory lock, in sorted order (two
        batches over the same runs never deadlock), before the batch reads the stored ids and the
        run's last seq. Under READ COMMITTED each statement sees what was committed before it
        started, so without it two writers read the same tail: both assign (or check against)
        the same last seq, and one fails on the (run_id, seq) key or finds its own event, just
        committed by the other, 'out of order'. The lock is released at commit or rollback; a
        wait for it is bounded by `busy_timeout_s` (lock_timeout). Its key is the table and the
        run id as stored (the gateway's `<tenant>/<run>`, so two tenants' runs of one name never
        wait on each other); a 64-bit hash collision only makes two runs wait in turn."""
        q = self._sa.text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))")
        for run in sorted(runs):
            conn.execute(q, {"k": f"{self.table.name}/{run}"})

    def _store_in(self, conn, events: list[Event], cur) -> tuple[list[bool], dict[str, int]]:
        sa, t = self._sa, self.table
        per_run = self.id_scope == "run"

        def key(run_id, event_id):
            return (run_id, event_id) if per_run else event_id

        # SQLite (`cur`): the same three statements as plain SQL on the driver's cursor (SQLAlchemy
        # building and compiling them is most of a small batch's time, spent holding the write lock).
        if self._pg:
            self._lock_runs(conn, {ev.run_id for ev in events})
        stored = {}
        groups: dict = {}
        for ev in events:
            groups.setdefault(ev.run_id if per_run else None, set()).add(ev.event_id)
        for run_id, id_set in groups.items():
            ids = sorted(id_set)
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                if cur is not None:
                    q = f"{self._sql_select} WHERE event_id IN ({','.join('?' * len(chunk))})"
                    found = cur.execute(q + " AND run_id = ?" if per_run else q,
                                        (*chunk, run_id) if per_run else chunk).fetchall()
                else:
                    q = sa.select(t.c.event_id, t.c.run_id, t.c.seq, t.c.kind, t.c.agent, t.c.parent_id,
                                  t.c.fingerprint, t.c.usage, t.c.record).where(t.c.event_id.in_(chunk))
                    if per_run:
                        q = q.where(t.c.run_id == run_id)
                    found = conn.execute(q)
                stored.update({key(r[1], r[0]): r for r in found})
        last: dict[str, int] = {}
        last_before: dict[str, int] = {}   # per run, as the transaction found it
        rows, out = [], []
        for ev in events:
            usage = orjson.dumps(ev.usage, option=orjson.OPT_SORT_KEYS) if ev.usage is not None else None
            prev = stored.get(key(ev.run_id, ev.event_id))
            if prev is not None:
                if (prev[1] == ev.run_id and prev[6] == ev.fingerprint and prev[3] == ev.kind
                        and prev[4] == ev.agent and prev[5] == ev.parent_id and prev[7] == usage
                        and (ev.seq is None or ev.seq == prev[2]) and self._same_rest(prev[8], ev)):
                    out.append(False)
                    continue
                if prev[8] is not None and prev[6] == ev.fingerprint and (ev.seq is not None and ev.seq != prev[2]
                                                                         or not self._same_rest(prev[8], ev)):
                    raise LedgerError(
                        f"event_id {ev.event_id!r} is stored at seq {prev[2]}; resent with a different "
                        f"seq ({ev.seq}), ts or meta: a resend must be identical", code="conflict")
                raise LedgerError(
                    f"event_id {ev.event_id!r} already holds a different event: first {prev[3]} by "
                    f"{prev[4]!r} in run {prev[1]!r} at seq {prev[2]} (fingerprint {prev[6][:12]}), "
                    f"now {ev.kind} by {ev.agent!r} in run {ev.run_id!r} at seq {ev.seq} "
                    f"(fingerprint {ev.fingerprint[:12]})", code="conflict")
            run = ev.run_id
            if run not in last:
                if cur is not None:
                    v = cur.execute(f"SELECT max(seq) FROM {t.name} WHERE run_id = ?", (run,)).fetchone()[0]
                else:
                    v = conn.execute(sa.select(sa.func.max(t.c.seq)).where(t.c.run_id == run)).scalar()
                last[run] = last_before[run] = -1 if v is None else v
            if ev.seq is None:
                if last[run] + 1 >= _MAX_SEQ:
                    raise _seq_exhausted(ev.event_id, run, last[run])
                ev.seq = last[run] + 1
            elif ev.seq <= last[run]:
                raise LedgerError(f"seq {ev.seq} of event {ev.event_id!r} is not after the run's last "
                                  f"seq {last[run]} (events are ordered by seq within run {run!r})",
                                  code="out_of_order", field="seq")
            last[run] = ev.seq
            stored[key(run, ev.event_id)] = (ev.event_id, run, ev.seq, ev.kind, ev.agent, ev.parent_id,
                                             ev.fingerprint, usage, None)
            rows.append({"event_id": ev.event_id, "run_id": run, "seq": ev.seq, "kind": ev.kind,
                         "agent": ev.agent, "parent_id": ev.parent_id, "fingerprint": ev.fingerprint,
                         "usage": usage, "record": ev.dumps()})
            out.append(True)
        if rows and cur is not None:
            cur.executemany(self._sql_insert, [tuple(r[c] for c in self._cols) for r in rows])
        elif rows:
            conn.execute(t.insert(), rows)
        return out, last_before


class Checkpointer:
    """WAL checkpoints of one SQLite file on a daemon thread, off the writers' commits. After
    commits it runs a PASSIVE checkpoint at most every `every_s` (it never blocks a writer or a
    reader; its fsyncs release the GIL), again at once (up to 4 times) while writers added
    frames during it, so that it catches up (then the next writer restarts the WAL). Often
    (1 s) rather than rarely: each checkpoint is then small and never stalls the clients' tail
    latency for long (`benchmarks/gateway_load.py --variant` compares). Past `restart_frames`
    frames (writers never left it a moment to catch up) it takes the writers' lock and runs a
    RESTART checkpoint (writers wait for it: bounded disk, rare).
    `stop()` runs a last one."""

    def __init__(self, path: str, write_lock: threading.Lock, busy_timeout_s: float = 30.0,
                 every_s: float = 1.0, restart_frames: int = 16_000):
        self.path, self.lock, self.busy_timeout_s = path, write_lock, busy_timeout_s
        self.every_s, self.restart_frames = every_s, restart_frames
        self.pending = 0                        # commits since the last checkpoint
        self.runs = self.restarts = 0
        self.last: tuple[int, int, int] | None = None      # (busy, WAL frames, checkpointed)
        self.error: str | None = None
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="aftraj-ledger-checkpoint", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        self.pending += 1
        self._wake.set()

    def _loop(self) -> None:
        import sqlite3

        con = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                              check_same_thread=False)
        try:
            while not self._stop.is_set():
                self._wake.wait()
                self._wake.clear()
                if self._stop.is_set():
                    break
                self.checkpoint(con)
                self._stop.wait(self.every_s)       # commits in between are the next one's
            self.checkpoint(con)
        finally:
            con.close()

    def checkpoint(self, con) -> None:
        if not self.pending:
            return
        self.pending = 0
        try:
            for _ in range(5):
                self.last = tuple(con.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone())
                self.runs += 1
                if self.last[1] == self.last[2] or self._stop.is_set():
                    break
            if self.last[1] >= self.restart_frames and self.lock.acquire(timeout=self.busy_timeout_s):
                try:
                    self.last = tuple(con.execute("PRAGMA wal_checkpoint(RESTART)").fetchone())
                    self.restarts += 1
                finally:
                    self.lock.release()
        except Exception as e:      # a checkpoint is maintenance: the next one tries again
            self.error = f"{type(e).__name__}: {e}"
            self.pending += 1

    def stop(self, wait: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.busy_timeout_s + 5)


def _seq_exhausted(event_id: str, run: str, last: int) -> LedgerError:
    return LedgerError(f"event {event_id!r} has no seq and run {run!r} is at seq {last}, the largest a "
                       f"ledger stores (64-bit): no seq can be assigned after it", code="out_of_order", field="seq")
