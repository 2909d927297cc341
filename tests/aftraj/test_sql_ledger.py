"""SqlLedger: the database is the index (no table loaded into memory), a batch is one
transaction, and two writers on one database store each event once (PostgreSQL's per-run lock:
tests/aftraj/test_ledger_postgres.py; two gateway processes on one PostgreSQL ledger:
tests/serve/test_gateway_process.py; both marker postgres)."""

from __future__ import annotations

import pytest

from aftraj.events import parse_event
from aftraj.ledger import LedgerError, SqlLedger


def rec(i, run="r", content=None, seq="same"):
    return {"event_id": f"{run}/{i}", "seq": i if seq == "same" else seq, "run_id": run, "kind": "message",
            "agent": "a", "payload": {"content": content or f"m{i}"}}


def test_nothing_is_loaded_at_open_and_lookups_go_to_the_database(tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    led = SqlLedger(url)
    assert led.append_many([parse_event(rec(i)) for i in range(200)]) == [True] * 200
    again = SqlLedger(url)                             # a restart
    assert again._index == {} and again._last_seq == {}   # the old version indexed every id here
    assert len(again) == 200 and "r/7" in again and "r/999" not in again and again.last_seq("r") == 199
    assert again.append(parse_event(rec(7))) is False and again.append(parse_event(rec(200))) is True
    with again.engine.connect() as c:
        mode = c.exec_driver_sql("PRAGMA journal_mode").scalar()
    assert mode == "wal"


def test_a_batch_is_all_or_nothing(tmp_path):
    led = SqlLedger(f"sqlite:///{tmp_path / 'l.db'}")
    led.append_many([parse_event(rec(i)) for i in range(3)])
    batch = [parse_event(rec(3)), parse_event(rec(4, seq=None)), parse_event(rec(1, content="other"))]
    with pytest.raises(LedgerError) as e:
        led.append_many(batch)
    assert e.value.code == "conflict" and "r/1" in str(e.value)
    assert "r/3" not in led and "r/4" not in led and batch[1].seq is None     # rolled back, seq cleared
    with pytest.raises(LedgerError) as e:
        led.append_many([parse_event(rec(5)), parse_event(rec(4))])
    assert e.value.code == "out_of_order" and e.value.field == "seq" and "r/5" not in led
    # duplicates inside one batch and against the table are skipped, new ones stored
    assert led.append_many([parse_event(rec(2)), parse_event(rec(3)), parse_event(rec(3))]) == [False, True, False]


def test_two_writers_on_one_database_store_each_event_once(tmp_path):
    """Two ledger instances (two gateway processes) send the same batches at the same time: each
    event is stored once, and exactly one writer reports it new."""
    import threading

    url = f"sqlite:///{tmp_path / 'l.db'}"
    writers = [SqlLedger(url), SqlLedger(url)]
    news = [0, 0]

    def go(k):
        for lo in range(0, 300, 10):
            news[k] += sum(writers[k].append_many([parse_event(rec(i)) for i in range(lo, lo + 10)]))

    ts = [threading.Thread(target=go, args=(k,)) for k in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sum(news) == 300 and len(writers[0]) == 300 and writers[1].last_seq("r") == 299


def test_sqlite_driver_errors_are_sqlalchemy_errors_and_a_key_violation_is_retried_once(tmp_path):
    """SQLite's batches run as plain SQL on the driver's cursor; what the driver raises reaches
    callers as SQLAlchemy's exceptions (the gateway answers 503 on OperationalError, and the
    two-writer race is retried on IntegrityError), with the batch rolled back and the seqs it
    assigned cleared."""
    import sqlite3

    import sqlalchemy as sa

    url = f"sqlite:///{tmp_path / 'l.db'}"
    led = SqlLedger(url)
    led.append_many([parse_event(rec(0))])
    tries = []
    with led.engine.begin() as c:           # a trigger that refuses run "bad" (SQLITE_CONSTRAINT)
        c.exec_driver_sql("CREATE TRIGGER refuse BEFORE INSERT ON aftraj_events WHEN NEW.run_id = 'bad' "
                          "BEGIN SELECT RAISE(ABORT, 'refused by trigger'); END")
    real = led._store_in
    led._store_in = lambda *a: tries.append(1) or real(*a)
    batch = [parse_event(rec(0, run="bad", seq=None)), parse_event(rec(1, run="bad", seq=None))]
    with pytest.raises(sa.exc.IntegrityError, match="refused by trigger") as e:
        led.append_many(batch)
    assert isinstance(e.value.orig, sqlite3.IntegrityError) and len(tries) == 2    # retried once
    assert [ev.seq for ev in batch] == [None, None] and led.runs() == ["r"]
    with led.engine.begin() as c:
        c.exec_driver_sql("DROP TABLE aftraj_events")
    with pytest.raises(sa.exc.OperationalError, match="no such table"):
        led.append_many([parse_event(rec(1))])
