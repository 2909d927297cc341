"""The gateway as a real process (`aftraj serve gateway --config …`): the example agent loop
stopped by an ALARM, `kill -9` in the middle of 10,000 events from 20 runs, and (marker
`postgres`) two gateway processes sharing one PostgreSQL ledger."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from serve.client import GatewayClient, GatewayClientError

KEY = "proc-test-key"      # the key tests/serve/conftest.py writes into every gateway config


def test_example_agent_loop_is_stopped_by_an_alarm(gateway_process, fake_auditor, gw_key):
    from serve.example_agent import SCRIPT, run_agent

    assert gw_key == KEY
    fake = fake_auditor("418")
    g = gateway_process(auditor={"backend": "openai", "base_url": fake.url, "model": "auditor",
                                 "deadline_s": 5.0})
    g.start()
    lines = []
    with GatewayClient(g.url, KEY) as gw:
        out = run_agent(gw, log=lines.append)
        view = gw.run(out["run_id"])
    assert out["stopped_at"] == 3 and len(out["verdicts"]) == 4 < len(SCRIPT)     # step 3: "17 * 24 = 418"
    last = out["verdicts"][-1]
    assert (last["decision"], last["k"], last["agent"], last["auditor"]) == ("ALARM", 3, "calculator", "ok")
    assert all(v["decision"] == "CONTINUE" for v in out["verdicts"][:-1])
    assert len(fake.bodies) == 4 and "stopped by the auditor at step 3" in lines[-1]
    assert [v["seq"] for v in view["verdicts"]] == [1, 2, 3, 4]


N_RUNS, N_EVENTS, BATCH = 20, 500, 10


def _events(run: str, lo: int, hi: int) -> list[dict]:
    return [{"event_id": f"{run}/{i}", "seq": i, "kind": "message", "agent": f"a{i % 3}",
             "payload": {"content": f"step {i} of {run}"}} for i in range(lo, hi)]


def _post_all(url, runs, acked, stop_at=None):
    """Each run in its own thread posts batches of its events in order; `acked[run]` is the next
    seq not yet acknowledged. A connection error ends the thread (the gateway is gone)."""
    def worker(run):
        with GatewayClient(url, KEY, retries=0, timeout=10) as gw:
            while acked[run] <= N_EVENTS:
                lo = acked[run]
                try:
                    gw.post_events(run, _events(run, lo, min(lo + BATCH, N_EVENTS + 1)))
                except Exception:                           # noqa: BLE001  the gateway was killed
                    return
                acked[run] = min(lo + BATCH, N_EVENTS + 1)

    threads = [threading.Thread(target=worker, args=(r,)) for r in runs]
    for t in threads:
        t.start()
    if stop_at is not None:
        stop_at()
    for t in threads:
        t.join()


@pytest.mark.slow
def test_kill_9_mid_stream_loses_no_acknowledged_event_and_stores_none_twice(gateway_process, tmp_path):
    g = gateway_process()
    g.start()
    runs = [f"k{i}" for i in range(N_RUNS)]
    with GatewayClient(g.url, KEY) as gw:
        for r in runs:
            gw.create_run("load", ["a0", "a1", "a2"], run_id=r)
    acked = {r: 1 for r in runs}

    def kill_when_a_third_is_in():
        while sum(acked.values()) - N_RUNS < N_RUNS * N_EVENTS // 3:
            time.sleep(0.01)
        g.kill9()

    _post_all(g.url, runs, acked, stop_at=kill_when_a_third_is_in)
    acknowledged = {f"{r}/{i}" for r in runs for i in range(1, acked[r])}
    assert 0 < len(acknowledged) < N_RUNS * N_EVENTS
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    with engine.connect() as c:
        rows = list(c.execute(sa.text("SELECT run_id, seq, event_id FROM aftraj_run_events")))
    # every acknowledged event is stored under its own seq, each run's seqs run 0..m without a
    # gap, and at most the one batch in flight at the kill is stored beyond what was acknowledged
    _assert_runs_stored(rows, {r: acked[r] - 1 for r in runs}, slack=BATCH)
    assert acknowledged <= {e for _, _, e in rows}
    # restart and finish: the batch in flight at the kill is resent (stored or not: idempotent)
    g.start()
    _post_all(g.url, runs, acked)
    with GatewayClient(g.url, KEY) as gw:
        last = gw.post_events(runs[0], _events(runs[0], N_EVENTS - BATCH + 1, N_EVENTS + 1))
        assert last["accepted"] == 0 and last["duplicates"] == BATCH        # resending adds nothing
        view = gw.run(runs[-1])
    with engine.connect() as c:
        rows = list(c.execute(sa.text("SELECT run_id, seq, event_id FROM aftraj_run_events")))
    _assert_runs_stored(rows, {r: N_EVENTS for r in runs})          # exactly 0..N_EVENTS, each once
    assert view["observer"]["events"] == N_EVENTS + 1 and view["observer"]["last_seq"] == N_EVENTS


def _assert_runs_stored(rows, last_acked: dict, slack: int = 0) -> None:
    """`rows` (run_id, seq, event_id) hold, per run, run_started at seq 0 and event `{run}/i` at
    seq i for i = 1..m, nothing else, with last_acked[run] <= m <= last_acked[run] + slack (the
    keys cannot catch an event stored twice under two seqs, a gap or a lost ack: this does)."""
    per_run: dict = {}
    for run, seq, eid in rows:
        per_run.setdefault(run.partition("/")[2], []).append((seq, eid))   # stored as '<key name>/<run>'

    assert set(per_run) == set(last_acked)
    for run, got in per_run.items():
        got.sort()
        m = len(got) - 1
        assert last_acked[run] <= m <= last_acked[run] + slack, (run, m, last_acked[run])
        assert got == [(0, f"{run}/run_started")] + [(i, f"{run}/{i}") for i in range(1, m + 1)], run


# --------------------------------------------------------------------------- PostgreSQL

@pytest.mark.postgres
def test_two_gateway_processes_share_one_postgres_ledger(gateway_process, postgres, tmp_path):
    a = gateway_process(ledger_url=postgres, name="a")
    b = gateway_process(ledger_url=postgres, name="b")
    a.start()
    b.start()
    runs = [f"p{i}" for i in range(6)]
    with GatewayClient(a.url, KEY) as ga, GatewayClient(b.url, KEY) as gb:
        for r in runs:
            ga.create_run("shared", ["a0"], run_id=r)
        # the same run's batches alternate between the two processes; each answers for the
        # newest prefix, having folded what the other stored
        for r in runs:
            for k, lo in enumerate(range(1, 61, 10)):
                v = (ga if k % 2 == 0 else gb).post_events(r, _events(r, lo, lo + 10))
                assert v["seq"] == lo + 9 and v["t"] == lo + 8 and v["accepted"] == 10
        # both write the same batch concurrently: stored once, the other sees duplicates
        res = {}

        def send(name, gw):
            try:
                res[name] = gw.post_events(runs[0], _events(runs[0], 61, 71))
            except GatewayClientError as e:
                res[name] = e

        ts = [threading.Thread(target=send, args=(n, g)) for n, g in (("a", ga), ("b", gb))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        accepted = sorted(v["accepted"] if isinstance(v, dict) else -1 for v in res.values())
        assert accepted == [0, 10], res
        va, vb = ga.run(runs[1]), gb.run(runs[1])
    assert va["observer"]["state_hash"] == vb["observer"]["state_hash"] and va["observer"]["events"] == 61
    engine = sa.create_engine(postgres)
    with engine.connect() as c:
        rows = list(c.execute(sa.text("SELECT run_id, seq, event_id FROM aftraj_run_events")))
    _assert_runs_stored(rows, {r: 70 if r == runs[0] else 60 for r in runs})


@pytest.mark.postgres
def test_the_web_view_on_postgres(gateway_process, postgres):
    """Issue 45 items 4, 6, 9 and issue 47 item 1 on PostgreSQL: a sign-in made on one process
    is honoured by the other (sessions live in the ledger), the run list's newest-first order,
    filters and agents, a run's page, and a web read behind a held table lock answers 503 with
    Retry-After (before: a plain 500 with a traceback)."""
    import httpx

    a = gateway_process(ledger_url=postgres, name="a", limits={"ledger_timeout_s": 1.0})
    b = gateway_process(ledger_url=postgres, name="b", limits={"ledger_timeout_s": 1.0})
    a.start()
    b.start()
    with GatewayClient(a.url, KEY) as ga:
        for r in ("w1", "w2", "w3"):
            ga.create_run("web", run_id=r)
        ga.post_events("w2", _events("w2", 1, 6))
        ga.post_events("w3", [{"event_id": "w3/1", "seq": 1, "kind": "termination", "agent": "a0",
                               "payload": {"content": "", "reason": "completed"}}])
    login = httpx.post(f"{a.url}/ui/login", data={"key": KEY}, headers={"Origin": a.url})
    assert login.status_code == 303
    token = login.cookies["aftraj_session"]
    with httpx.Client(base_url=b.url, cookies={"aftraj_session": token}) as c:
        page = c.get("/ui")
        assert page.status_code == 200 and page.text.index(">w3<") < page.text.index(">w2<") < page.text.index(">w1<")
        assert "a0, a1, a2" in page.text or "a1, a2, a0" in page.text or "a0" in page.text
        assert c.get("/ui", params={"state": "ended"}).text.count("/ui/runs/") == 1
        assert c.get("/ui", params={"agent": "a1"}).text.count("/ui/runs/") == 1
        run = c.get("/ui/runs/w2")
        assert run.status_code == 200 and run.text.count("<tr id=step-") == 5
        engine = sa.create_engine(postgres)
        with engine.connect() as conn:
            conn.execute(sa.text("BEGIN"))
            conn.execute(sa.text("LOCK TABLE aftraj_run_events IN ACCESS EXCLUSIVE MODE"))
            t0 = time.monotonic()
            busy = c.get("/ui/runs/w2", timeout=30)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text[:300]
            assert time.monotonic() - t0 < 5
            conn.execute(sa.text("ROLLBACK"))
        engine.dispose()
        assert c.get("/ui/runs/w2").status_code == 200
    for g in (a, b):
        assert "Traceback" not in g.log.read_text(), g.log.read_text()[-2000:]
