"""SqlLedger on PostgreSQL (marker `postgres`): concurrent appends to one run through two ledgers
(two connections pools, as two gateway processes) are serialized per run, so under READ
COMMITTED no writer reads a tail another is about to extend: every append is acknowledged, the
run's seqs are 0..N-1 with no gap and no duplicate, and an identical resend is a duplicate,
never out of order."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

from aftraj.events import parse_event
from aftraj.ledger import SqlLedger

pytestmark = pytest.mark.postgres


def _event(run: str, eid: str, seq=None):
    return parse_event({"event_id": eid, "run_id": run, "seq": seq, "kind": "message", "agent": "a",
                        "payload": {"content": f"{eid} of {run}"}})


def _threads(n, target):
    errors: list = []
    start = threading.Barrier(n)

    def run(i):
        try:
            start.wait()
            target(i)
        except BaseException as e:          # noqa: BLE001  reported below, with the thread's index
            errors.append((i, f"{type(e).__name__}: {e}"))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "a writer hung"
    return errors


def _stored(url, table, run):
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            return c.execute(sa.text(f"SELECT seq, event_id FROM {table} WHERE run_id = :r ORDER BY seq"),
                             {"r": run}).all()
    finally:
        engine.dispose()


@pytest.mark.parametrize("id_scope", ["run", "global"])
def test_concurrent_appends_to_one_run_get_every_seq_once(postgres, id_scope):
    """16 threads, 25 events each, no seq given (the ledger assigns it), half of them through each
    of two ledgers. Before the per-run lock two transactions read the same last seq, one insert
    violated (run_id, seq), and its one retry could lose again: an IntegrityError to the writer."""
    ledgers = [SqlLedger(postgres, id_scope=id_scope) for _ in range(2)]
    run, n_threads, per_thread = "tenant-a/prod-7", 16, 25
    acked: list = []

    def writer(i):
        for j in range(per_thread):
            ev = _event(run, f"t{i}/e{j}")
            assert ledgers[i % 2].append(ev) is True
            acked.append((ev.seq, ev.event_id))

    try:
        errors = _threads(n_threads, writer)
        assert errors == [], errors[:5]
        n = n_threads * per_thread
        rows = _stored(postgres, ledgers[0].table.name, run)
        assert [s for s, _ in rows] == list(range(n))           # no gap, no duplicate
        assert sorted(acked) == [tuple(r) for r in rows]       # each writer was told its own seq
    finally:
        for led in ledgers:
            led.close()


def test_an_identical_resend_racing_the_original_is_a_duplicate_never_out_of_order(postgres):
    """Four writers (two per ledger) send the same 60 events with their seqs, in order, as a
    client retrying against two gateway processes would. Each event is stored once and every
    other send of it is an acknowledged duplicate. Before the lock, a writer that read the ids
    (not there yet), then the run's last seq (just committed by another writer: READ COMMITTED),
    found its own event 'not after the run's last seq': out of order."""
    ledgers = [SqlLedger(postgres, id_scope="run") for _ in range(2)]
    run, n_threads, n = "tenant-b/prod-7", 4, 60
    added: list = []

    def writer(i):
        for s in range(n):
            if ledgers[i % 2].append(_event(run, f"e{s}", seq=s)):
                added.append(s)

    try:
        errors = _threads(n_threads, writer)
        assert errors == [], errors[:5]
        assert sorted(added) == list(range(n))                 # each stored by exactly one writer
        assert [tuple(r) for r in _stored(postgres, "aftraj_run_events", run)] == [(s, f"e{s}") for s in range(n)]
    finally:
        for led in ledgers:
            led.close()


def test_the_lock_is_per_run_and_bounded_by_the_busy_timeout(postgres):
    """A transaction holding one run's lock delays only that run: another tenant's run with the
    same name is written at once, and a writer of the locked run fails after `busy_timeout_s`
    (PostgreSQL's lock_timeout) instead of waiting forever."""
    import time

    held = SqlLedger(postgres, id_scope="run")
    other = SqlLedger(postgres, id_scope="run", busy_timeout_s=0.5)
    try:
        with held.write() as conn:
            held._store(conn, [_event("tenant-a/r", "x")])           # takes tenant-a/r's lock
            t0 = time.perf_counter()
            assert other.append(_event("tenant-b/r", "y")) is True   # tenant-b's run: not blocked
            assert time.perf_counter() - t0 < 0.5
            with pytest.raises(sa.exc.OperationalError, match="lock timeout"):
                other.append(_event("tenant-a/r", "z"))
        assert other.append(_event("tenant-a/r", "z")) is True and other.last_seq("tenant-a/r") == 1
    finally:
        held.close()
        other.close()
