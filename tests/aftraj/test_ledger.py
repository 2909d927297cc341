"""The ledger: idempotence, conflicts, ordering, resuming (byte offset / sequence number), and
malformed-input fuzz (every good record folded, every bad one reported, nothing crashes)."""

from __future__ import annotations

import random

import orjson
import pytest

from aftraj.events import EventError, parse_event
from aftraj.fold import Folder, RunState, fold_events, fold_file
from aftraj.ledger import (IngestReport, JsonlLedger, Ledger, LedgerError, LineSplitter,
                           SqlLedger, read_events)


def good(i: int, run: str = "r", **kw) -> dict:
    d = {"event_id": f"{run}/{i}", "seq": i, "run_id": run, "kind": "message", "agent": "A",
         "payload": {"content": f"step {i}"}}
    if i % 3 == 1:
        d.update(kind="tool_call", payload={"content": "", "tool": "search", "arguments": {"q": i}})
    elif i % 3 == 2:
        d.update(kind="tool_result", parent_id=f"{run}/{i - 1}", agent="env",
                 payload={"content": "r", "tool": "search", "result_ids": [f"d{i}"]})
    d.update(kw)
    return d


def test_identical_duplicate_is_counted_and_ignored():
    led = Ledger()
    assert led.append(parse_event(good(0))) is True
    assert led.append(parse_event(good(0))) is False
    assert led.n_duplicates == 1 and len(led) == 1


def test_conflicting_duplicate_names_both():
    led = Ledger()
    led.append(parse_event(good(0)))
    with pytest.raises(LedgerError) as e:
        led.append(parse_event(good(0, payload={"content": "something else"}, seq=5)))
    msg = str(e.value)
    assert e.value.code == "conflict" and "r/0" in msg and "seq 0" in msg and "seq 5" in msg


def test_order_within_a_run():
    led = Ledger()
    led.append(parse_event(good(3)))
    with pytest.raises(LedgerError) as e:
        led.append(parse_event(good(2)))
    assert e.value.code == "out_of_order" and e.value.field == "seq"
    led.append(parse_event(good(0, run="other")))          # other runs have their own order
    ev = parse_event(good(9, seq=None))
    led.append(ev)
    assert ev.seq == 4 and led.last_seq("r") == 4          # a missing seq is assigned


def test_jsonl_ledger_reopens_and_stays_idempotent(tmp_path):
    p = tmp_path / "ledger.jsonl"
    with JsonlLedger(p) as led:
        for i in range(6):
            led.append(parse_event(good(i)))
        assert led.append(parse_event(good(5))) is False
    with JsonlLedger(p) as led:
        assert len(led) == 6 and led.last_seq("r") == 5
        assert led.append(parse_event(good(2))) is False
        led.append(parse_event(good(6)))
    assert len(p.read_bytes().splitlines()) == 7


def test_read_events_resumes_from_a_byte_offset(tmp_path):
    p = tmp_path / "l.jsonl"
    p.write_bytes(b"".join(orjson.dumps(good(i)) + b"\n" for i in range(10)))
    items = list(read_events(p))
    line, off, ev = items[3]
    rest = list(read_events(p, off, first_line=line + 1))
    assert [x[2].event_id for x in rest] == [x[2].event_id for x in items[4:]]
    assert [x[0] for x in rest] == [x[0] for x in items[4:]]


def test_line_splitter_any_chunking():
    data = b"".join(orjson.dumps(good(i)) + b"\n" for i in range(20)) + b'{"tail": 1}'
    rng = random.Random(1)
    for _ in range(20):
        sp, out, pos = LineSplitter(), [], 0
        while pos < len(data):
            n = rng.randint(1, 90)
            out += sp.feed(data[pos:pos + n])
            pos += n
        out += sp.flush()
        assert b"".join(out) == data and len(out) == 21


def test_sql_ledger_resumes_from_a_sequence_number(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    led = SqlLedger(url)
    for i in range(8):
        assert led.append(parse_event(good(i)))
    assert led.append(parse_event(good(4))) is False
    with pytest.raises(LedgerError):
        led.append(parse_event(good(3, payload={"content": "changed"})))
    head = fold_events(led.iter_run("r"))
    again = SqlLedger(url)                                   # a new process: index rebuilt
    assert again.last_seq("r") == 7 and again.append(parse_event(good(3))) is False
    assert fold_events(again.iter_run("r")).state_hash() == head.state_hash()
    # resume from a sequence number: fold 0..5, snapshot, then only what comes after seq 5
    part = fold_events(e for e in again.iter_run("r") if e.seq <= 5)
    assert [e.seq for e in again.iter_run("r", after_seq=5)] == [6, 7]
    resumed = fold_events(again.iter_run("r", after_seq=part.last_seq), RunState.restore(part.snapshot()))
    assert resumed.state_hash() == head.state_hash()


def test_folder_over_a_database_ledger_catches_up_after_restart(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    live = Folder(ledger=SqlLedger(url))
    for i in range(9):
        assert live.ingest(parse_event(good(i)))
    assert live.ingest(parse_event(good(8))) is False
    snap = live.states["r"].snapshot()
    for i in range(9, 12):
        live.ingest(parse_event(good(i)))
    # restart: a fresh process rebuilds everything from the database …
    fresh = Folder(ledger=SqlLedger(url))
    assert fresh.catch_up() == 12
    assert fresh.states["r"].state_hash() == live.states["r"].state_hash()
    # … or restores a snapshot and folds only what came after its seq
    again = Folder(ledger=SqlLedger(url))
    again.states["r"] = RunState.restore(snap)
    assert again.catch_up() == 3
    assert again.states["r"].state_hash() == live.states["r"].state_hash()
    with pytest.raises(TypeError):
        Folder().catch_up()


# --------------------------------------------------------------------------- fuzz

def _bad_records() -> list[tuple[str, bytes]]:
    d = orjson.dumps
    g = good(0)
    bad = [
        ("not json", b"{not json"),
        ("truncated", d(good(0))[:30]),
        ("array", b"[1, 2, 3]"),
        ("string", b'"hello"'),
        ("number", b"42"),
        ("null", b"null"),
        ("invalid utf-8", b'{"event_id": "\xff\xfe", "run_id": "r"}'),
        ("missing event_id", d({k: v for k, v in g.items() if k != "event_id"})),
        ("empty event_id", d({**g, "event_id": ""})),
        ("int event_id", d({**g, "event_id": 7})),
        ("missing run_id", d({k: v for k, v in g.items() if k != "run_id"})),
        ("unknown kind", d({**g, "kind": "chat"})),
        ("list kind", d({**g, "kind": ["message"]})),
        ("missing agent", d({k: v for k, v in g.items() if k != "agent"})),
        ("blank agent", d({**g, "agent": "   "})),
        ("negative seq", d({**g, "seq": -4})),
        ("string seq", d({**g, "seq": "3"})),
        ("float seq", d({**g, "seq": 3.5})),
        ("object ts", d({**g, "ts": {"at": 1}})),
        ("missing payload", d({k: v for k, v in g.items() if k != "payload"})),
        ("list payload", d({**g, "payload": ["x"]})),
        ("int content", d({**g, "payload": {"content": 5}})),
        ("unknown payload key", d({**g, "payload": {"content": "x", "colour": "red"}})),
        ("call without tool", d({**g, "kind": "tool_call", "payload": {"content": ""}})),
        ("string result_ids", d({**g, "kind": "tool_result", "payload": {"content": "", "result_ids": "a"}})),
        ("int in result_ids", d({**g, "kind": "tool_result", "payload": {"content": "", "result_ids": [1]}})),
        ("bad termination reason", d({**g, "kind": "termination", "payload": {"reason": "bored"}})),
        ("handoff without to", d({**g, "kind": "handoff", "payload": {"content": "x"}})),
        ("error without error", d({**g, "kind": "error", "payload": {"content": "x"}})),
        ("usage not object", d({**g, "usage": 12})),
        ("negative usage", d({**g, "usage": {"input_tokens": -3}})),
        ("unknown usage key", d({**g, "usage": {"tokens": 3}})),
        ("unknown top-level field", d({**g, "colour": "red"})),
        ("meta list", d({**g, "meta": [1]})),
        ("empty parent_id", d({**g, "parent_id": ""})),
        ("fingerprint mismatch", d({**g, "fingerprint": "ab" * 32})),
        ("trajectory record", d({"id": "t", "steps": [], "label": {}})),
        ("deep nesting", b'{"a":' * 2000 + b"1" + b"}" * 2000),
        ("huge integer", b'{"event_id": "x", "seq": 123456789012345678901234567890}'),
        ("NaN", b'{"event_id": "x", "seq": NaN}'),
        ("huge kind string", d({**g, "kind": "k" * 100_000})),
    ]
    return bad


def test_malformed_input_fuzz(tmp_path):
    bad = _bad_records()
    assert len(bad) >= 30
    rng = random.Random(7)
    lines: list[bytes] = []
    bad_lines: dict[int, str] = {}
    goods = []
    for i in range(len(bad) * 2):
        rec = good(i)
        goods.append(rec)
        lines.append(orjson.dumps(rec))
        if i % 2 == 1:
            name, raw = bad[i // 2]
            lines.append(raw)
            bad_lines[len(lines)] = name
        if i == 10:
            lines.append(orjson.dumps(good(5)))                                   # identical dup
        if i == 20:
            lines.append(orjson.dumps(good(6, payload={"content": "forged"})))    # conflicting id
            bad_lines[len(lines)] = "conflicting duplicate"
        if i == 30:
            lines.append(orjson.dumps(good(1000, seq=3)))                         # out of order
            bad_lines[len(lines)] = "out of order"
        if rng.random() < 0.2:
            lines.append(b"   ")                                                  # blank: not a record
    p = tmp_path / "fuzz.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    folder, rep = fold_file(p)
    assert rep.n_rejected == len(bad_lines), rep.to_dict()
    assert {e.line for e in rep.errors} == set(bad_lines)
    assert all(e.source == str(p) and e.field for e in rep.errors)
    assert rep.n_appended == len(goods) and rep.n_duplicates == 1
    want = fold_events(parse_event(r) for r in goods)
    assert folder.states["r"].state_hash() == want.state_hash()
    by_line = {e.line: e for e in rep.errors}
    assert by_line[min(k for k, v in bad_lines.items() if v == "missing event_id")].field == "event_id"


def test_ingest_report_is_json(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n' + orjson.dumps(good(0)) + b"\n")
    f = Folder()
    rep = f.ingest_file(p)
    d = rep.to_dict()
    assert d["rejected"] == 1 and d["appended"] == 1 and d["rejected_by_field"] == {"a": 1}
    assert isinstance(rep, IngestReport) and isinstance(f.states["r"], RunState)


# --------------------------------------------------------------------------- a torn last line

def test_resume_reads_a_record_torn_mid_append_whole(tmp_path):
    """A writer mid-append leaves a last line without newline: it is left for the next read
    (next_offset before it), not rejected in two halves and lost."""
    data = b"".join(orjson.dumps(good(i)) + b"\n" for i in range(6))
    cut = len(data) - 25
    p = tmp_path / "l.jsonl"
    p.write_bytes(data[:cut])
    folder = Folder()
    rep = folder.ingest_file(p)
    assert rep.n_rejected == 0 and rep.n_appended == 5 and rep.pending_bytes > 0
    items = list(read_events(p, report=(rr := IngestReport())))
    assert len(items) == 5 and rr.next_offset == rep.next_offset and rr.pending_bytes == rep.pending_bytes
    with open(p, "ab") as f:
        f.write(data[cut:])
    rep2 = folder.ingest_file(p, rep.next_offset, first_line=rep.next_line)
    assert rep2.n_rejected == 0 and rep2.n_appended == 1 and rep2.pending_bytes == 0
    assert folder.states["r"].state_hash() == fold_events(parse_event(good(i)) for i in range(6)).state_hash()
    rest = list(read_events(p, rr.next_offset, first_line=rr.next_line))
    assert [(x[0], x[2].event_id) for x in rest] == [(6, "r/5")]
    # a complete last record without newline is read; a bad complete line is still rejected
    p.write_bytes(data[:-1])
    assert fold_file(p)[1].n_appended == 6
    p.write_bytes(data + b'{"kind": 1}')
    assert fold_file(p)[1].n_rejected == 1


def test_jsonl_ledger_appends_after_a_torn_line_on_a_line_of_its_own(tmp_path):
    p = tmp_path / "l.jsonl"
    p.write_bytes(orjson.dumps(good(0)) + b"\n" + orjson.dumps(good(1))[:20])   # crash mid-append
    with JsonlLedger(p) as led:
        assert len(led) == 1 and led.report.pending_bytes == 20
        led.append(parse_event(good(2)))
    with JsonlLedger(p) as led:
        assert "r/2" in led and led.report.n_rejected == 1 and led.report.errors[0].line == 2


def test_jsonl_ledger_names_the_line_of_a_conflicting_record(tmp_path):
    p = tmp_path / "l.jsonl"
    p.write_bytes(orjson.dumps(good(0)) + b"\n" + orjson.dumps(good(1)) + b"\n"
                  + orjson.dumps(good(0, payload={"content": "changed"})) + b"\n")
    with JsonlLedger(p) as led:
        (err,) = led.report.errors
    assert err.code == "conflict" and err.line == 3 and err.source == str(p)


def _nested(depth: int):
    x = 1
    for _ in range(depth):
        x = {"a": x}
    return x


def test_too_deeply_nested_payload_is_a_rejected_record_not_a_crash(tmp_path):
    """orjson reads 1024 levels but writes only 254: a payload it cannot write back (for the
    fingerprint, or as a ledger line) is a rejected record naming the field, not a crash."""
    deep = (b'{"event_id":"r/1","seq":1,"run_id":"r","kind":"tool_call","agent":"A","payload":'
            b'{"content":"","tool":"t","arguments":' + b'{"a":' * 300 + b"1" + b"}" * 300 + b"}}")
    p = tmp_path / "l.jsonl"
    p.write_bytes(orjson.dumps(good(0)) + b"\n" + deep + b"\n" + orjson.dumps(good(2)) + b"\n")
    folder, rep = fold_file(p)
    assert rep.n_appended == 2 and rep.n_rejected == 1
    assert rep.errors[0].field == "payload" and rep.errors[0].line == 2
    # at the edge the payload writes but the whole record does not: refused before indexing
    edge = good(1, kind="tool_call", payload={"content": "", "tool": "t", "arguments": _nested(253)})
    with JsonlLedger(tmp_path / "j.jsonl") as led:
        with pytest.raises(EventError) as e:
            led.append(parse_event(edge))
        assert "r/1" not in led and e.value.field == "<record>"


def test_category_from_event_meta_is_the_same_live_from_a_file_and_after_restart(tmp_path):
    """The run's category (for the tool contract) comes from the first event carrying
    meta.category, whichever path folds the run."""
    from aftraj.detectors import Policy

    pol = Policy(permitted_tools={"agentic": ["search"]})
    recs = [good(0), good(1, payload={"content": "", "tool": "shell"}, meta={"category": "agentic"}),
            good(2, kind="tool_call", agent="A", parent_id=None, payload={"content": "", "tool": "shell"})]
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    live = Folder(pol, ledger=SqlLedger(url))
    for r in recs:
        live.ingest(parse_event(r))
    fresh = Folder(pol, ledger=SqlLedger(url))
    fresh.catch_up()
    p = tmp_path / "l.jsonl"
    p.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    from_file = Folder(pol)
    from_file.ingest_file(p)
    states = [f.states["r"] for f in (live, fresh, from_file)]
    assert [s.category for s in states] == ["agentic"] * 3
    assert [[f.kind for f in s.findings] for s in states] == [["tool_not_permitted"] * 2] * 3
    assert len({s.state_hash() for s in states}) == 1


def test_sql_ledger_failed_write_is_not_remembered(tmp_path, monkeypatch):
    """A database error while storing an event leaves the index as it was: the retry is
    appended, not ignored as a duplicate of an event that was never stored."""
    led = SqlLedger(f"sqlite:///{tmp_path / 'ledger.db'}")
    led.append(parse_event(good(0)))
    real_begin = led.engine.begin

    def broken():
        raise RuntimeError("database is locked")

    monkeypatch.setattr(led.engine, "begin", broken)
    ev = parse_event(good(1, seq=None))
    with pytest.raises(RuntimeError):
        led.append(ev)
    assert "r/1" not in led and led.last_seq("r") == 0 and len(led) == 1 and ev.seq is None
    monkeypatch.setattr(led.engine, "begin", real_begin)
    assert led.append(ev) is True and ev.seq == 1
    assert [e.event_id for e in led.iter_run("r")] == ["r/0", "r/1"]


# --------------------------------------------------------------------------- issue 14: JSONL resume

def test_jsonl_ledger_completes_a_last_record_without_its_newline(tmp_path):
    """A complete last record without its newline used to get the next append glued to it;
    on reopen both acknowledged events were rejected."""
    p = tmp_path / "l.jsonl"
    p.write_bytes(orjson.dumps(good(0)) + b"\n" + orjson.dumps(good(1)))      # no final newline
    with JsonlLedger(p) as led:
        assert len(led) == 2 and led.report.n_rejected == 0
        assert led.append(parse_event(good(2)))
    with JsonlLedger(p) as led:
        assert len(led) == 3 and led.report.n_rejected == 0 and led.last_seq("r") == 2
    assert p.read_bytes().count(b"\n") == 3


def test_jsonl_ledger_ends_a_line_a_failed_write_left_before_the_next_append(tmp_path):
    p = tmp_path / "l.jsonl"
    led = JsonlLedger(p)
    led.append(parse_event(good(0)))

    class Half:
        """A file whose write stores half the line, then fails (a full disk)."""

        def __init__(self, f):
            self.f = f

        def write(self, b):
            self.f.write(b[:len(b) // 2])
            self.f.flush()
            raise OSError(28, "No space left on device")

        def __getattr__(self, k):
            return getattr(self.f, k)

    real = led._f
    led._f = Half(real)
    with pytest.raises(OSError):
        led.append(parse_event(good(1)))
    led._f = real
    assert "r/1" not in led
    assert led.append(parse_event(good(1)))          # the retry: on a line of its own
    led.close()
    with JsonlLedger(p) as again:
        assert len(again) == 2 and again.report.n_rejected == 1     # the half line, refused
        assert again.report.errors[0].line == 2


def _events_with_findings(n: int) -> list[dict]:
    """Two 'agentic' runs where every 60th event calls a tool the policy does not permit."""
    out = []
    for i in range(n):
        run = "a" if i % 2 else "b"
        j = i // 2
        if j % 60 == 30:
            out.append(good(j, run=run, kind="tool_call", parent_id=None, payload={"content": "", "tool": "shell"}))
        else:
            out.append(good(j, run=run, meta={"category": "agentic"}))
    return out


def _policy():
    from aftraj.detectors import Policy

    return Policy(permitted_tools={"agentic": ["search"]})


def test_folder_over_a_jsonl_ledger_resumes_as_over_sql(tmp_path):
    """A JSONL-backed Folder used to treat the stored events as duplicates after a restart:
    ingest_file folded 200 of 500 events."""
    recs = _events_with_findings(500)
    src = tmp_path / "events.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    whole, rep = fold_file(src, policy=_policy())
    assert rep.n_appended == 500 and rep.n_rejected == 0
    want = {r: s.state_hash() for r, s in whole.states.items()}
    n_findings = sum(len(s.findings) for s in whole.states.values())
    assert n_findings >= 4

    ledger_path = tmp_path / "ledger.jsonl"
    live = Folder(_policy(), ledger=JsonlLedger(ledger_path))
    for r in recs[:300]:
        live.ingest(parse_event(r))
    live.ledger.close()                                  # the service stops (or dies) here

    # restart 1: the same source file is read again from the start
    fresh = Folder(_policy(), ledger=JsonlLedger(ledger_path))
    rep = fresh.ingest_file(src)
    assert rep.n_appended == 500 and rep.n_duplicates == 0
    assert {r: s.state_hash() for r, s in fresh.states.items()} == want
    assert sum(len(s.findings) for s in fresh.states.values()) == n_findings
    fresh.ledger.close()

    # restart 2: catch up from the ledger, then only the new events arrive
    again = Folder(_policy(), ledger=JsonlLedger(ledger_path))
    assert again.catch_up() == 500
    assert again.catch_up() == 0
    assert {r: s.state_hash() for r, s in again.states.items()} == want
    assert again.ingest(parse_event(recs[10])) is False  # folded already: a plain duplicate
    again.ledger.close()

    # restart 3: a snapshot restored, then catch_up folds only what came after it
    snap_folder = Folder(_policy())
    for r in recs[:120]:
        snap_folder.ingest(parse_event(r))
    third = Folder(_policy(), ledger=JsonlLedger(ledger_path))
    third.states = {r: RunState.restore(s.snapshot()) for r, s in snap_folder.states.items()}
    assert third.catch_up() == 380
    assert {r: s.state_hash() for r, s in third.states.items()} == want
    third.ledger.close()


def test_jsonl_catch_up_skips_refused_and_repeated_records(tmp_path):
    p = tmp_path / "l.jsonl"
    lines = [good(0), good(1), good(0, payload={"content": "conflict"}), good(1), good(2), good(1, seq=9)]
    p.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines) + b"not json\n")
    f = Folder(ledger=JsonlLedger(p))
    assert f.catch_up() == 3
    assert f.states["r"].last_seq == 2 and f.states["r"].n_events == 3


# --------------------------------------------------------------------------- issue 23 item 5: the gateway's writes

def test_threaded_ledger_checkpoints_off_the_commits_and_loses_nothing(tmp_path):
    """threaded=True: no connection checkpoints inside its commit (wal_autocheckpoint=0), the
    checkpointer does (after commits, every frame of the WAL checkpointed by close()), and 6
    threads writing at once through the in-process lock store every event, in order per run."""
    import threading

    led = SqlLedger(f"sqlite:///{tmp_path / 'l.db'}", id_scope="run", threaded=True, busy_timeout_s=10)
    led.checkpointer.every_s = 0.01
    with led.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 0
    errors = []

    def writer(k):
        try:
            for i in range(30):
                led.append_many([parse_event(good(i * 2 + j, run=f"r{k}")) for j in range(2)])
        except Exception as e:      # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(led) == 360
    assert all([e.seq for e in led.iter_run(f"r{k}")] == list(range(60)) for k in range(6))
    led.close()
    busy, frames, done = led.checkpointer.last
    assert led.checkpointer.runs >= 1 and led.checkpointer.error is None and frames == done > 0
    plain = SqlLedger(f"sqlite:///{tmp_path / 'p.db'}")
    assert plain.checkpointer is None
    with plain.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 1000     # SQLite's own


def test_threaded_ledger_bounds_the_wait_behind_another_process_lock(tmp_path):
    """A write lock held by another process: the writer waiting in SQLite and the one waiting
    for the in-process lock both fail as 'database is locked' (the gateway's 503) within their
    bound, and the ledger writes again once the lock is gone."""
    import sqlite3
    import threading
    import time

    from sqlalchemy.exc import OperationalError

    led = SqlLedger(f"sqlite:///{tmp_path / 'l.db'}", threaded=True, busy_timeout_s=0.3)
    led.append(parse_event(good(0)))
    other = sqlite3.connect(str(tmp_path / "l.db"), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    out = []

    def writer(i):
        t0 = time.perf_counter()
        try:
            led.append(parse_event(good(i)))
            out.append(("ok", 0.0))
        except OperationalError as e:
            out.append(("locked" if "locked" in str(e) else str(e), time.perf_counter() - t0))
    try:
        threads = [threading.Thread(target=writer, args=(i,)) for i in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert sorted(s for s, _ in out) == ["locked", "locked"] and max(dt for _, dt in out) < 2.0, out
    assert led.append(parse_event(good(1))) is True and led.last_seq("r") == 1
    led.close()


def test_append_batch_commits_what_then_writes_with_the_events_or_nothing(tmp_path):
    """`then` runs inside the events' transaction: its rows are committed with them in one
    commit; if it raises, neither the events nor its rows are stored (seqs it assigned are
    cleared), and the batch is not retried."""
    import sqlalchemy as sa

    led = SqlLedger(f"sqlite:///{tmp_path / 'l.db'}", threaded=True)
    extra = sa.Table("extra", led.metadata, sa.Column("k", sa.Integer, primary_key=True))
    led.metadata.create_all(led.engine)
    commits = []
    sa.event.listen(led.engine, "commit", lambda _c: commits.append(1))
    calls = []

    def then(conn, added, before):
        calls.append((list(added), dict(before)))
        conn.execute(extra.insert().values(k=len(calls)))
    out, before = led.append_batch([parse_event(good(0)), parse_event(good(1))], then=then)
    assert out == [True, True] and calls == [([True, True], {"r": -1})] and len(commits) == 1

    def failing(conn, added, before):
        conn.execute(extra.insert().values(k=99))
        raise RuntimeError("refused after the insert")
    ev = parse_event(good(2, seq=None))
    with pytest.raises(RuntimeError):
        led.append_batch([ev], then=failing)
    assert ev.seq is None and led.last_seq("r") == 1 and len(led) == 2
    with led.engine.connect() as conn:
        assert [k for (k,) in conn.execute(sa.select(extra.c.k))] == [1]
    led.close()
