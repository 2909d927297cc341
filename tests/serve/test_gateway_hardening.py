"""Issue 23, the gateway: poison events never break a run, one tenant or one slow client cannot
stall the others (/healthz answers within 100 ms while each attack runs), run state stays
bounded, every string is bounded, /metrics needs a key, run ids are scoped by key, and the
`aftraj serve` CLI answers bad input with one line (exit 2). Traffic only to 127.0.0.1."""

from __future__ import annotations

import json
import socket
import sqlite3
import statistics
import threading
import time

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from serve.config import ApiKey, AuditorConfig, GatewayConfig, LimitsConfig, hash_key, load_serve_config
from serve.router import build_app
from serve.service import GatewayService

KEY_A, KEY_B = "key-a-secret", "key-b-secret"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}


def cfg(tmp_path, **kw) -> GatewayConfig:
    return GatewayConfig(ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}",
                         api_keys=(ApiKey("a", hash_key(KEY_A)), ApiKey("b", hash_key(KEY_B))),
                         auditor=kw.pop("auditor", AuditorConfig(backend="none")), **kw)


def ev(run, i, content="ok", agent="solver", **kw):
    return {"event_id": f"{run}/{i}", "seq": i, "kind": "message", "agent": agent,
            "payload": {"content": content}, **kw}


def post(c, run, events_json: bytes | list, headers=A):
    body = events_json if isinstance(events_json, bytes) else json.dumps({"events": events_json}).encode()
    return c.post(f"/v1/runs/{run}/events", content=body, headers={**headers, "content-type": "application/json"})


@pytest.fixture
def gw(tmp_path):
    svc = GatewayService(cfg(tmp_path))
    with TestClient(build_app(svc)) as c:
        c.svc = svc
        yield c


def new_run(c, run="r1", headers=A, **kw):
    r = c.post("/v1/runs", json={"run_id": run, "task": "t", "agents": ["solver"], **kw}, headers=headers)
    assert r.status_code == 201, r.text
    return run


def _nested(depth: int) -> dict:
    d: dict = {}
    cur = d
    for _ in range(depth - 1):
        cur["a"] = {}
        cur = cur["a"]
    return d


# --------------------------------------------------------------------------- 1. poison events

POISON = {
    # meta holding 33 (and 253) levels of objects below it
    "meta-33-deep": (json.dumps({"events": [ev("r1", 1, meta=_nested(34))]}).encode(), "meta"),
    "meta-253-deep": (json.dumps({"events": [ev("r1", 1, meta=_nested(254))]}).encode(), "meta"),
    "ts-nan": (b'{"events": [{"event_id": "r1/1", "seq": 1, "kind": "message", "agent": "s", '
               b'"payload": {"content": "x"}, "ts": NaN}]}', None),
    "ts-infinity": (b'{"events": [{"event_id": "r1/1", "seq": 1, "kind": "message", "agent": "s", '
                    b'"payload": {"content": "x"}, "ts": Infinity}]}', None),
    "surrogate-agent": (b'{"events": [{"event_id": "r1/1", "seq": 1, "kind": "message", "agent": "s\\ud800", '
                        b'"payload": {"content": "x"}}]}', None),
    "surrogate-event-id": (b'{"events": [{"event_id": "r1/\\udc00", "seq": 1, "kind": "message", "agent": "s", '
                           b'"payload": {"content": "x"}}]}', None),
    "surrogate-meta": (b'{"events": [{"event_id": "r1/1", "seq": 1, "kind": "message", "agent": "s", '
                       b'"payload": {"content": "x"}, "meta": {"k": "\\ud800"}}]}', None),
    "nul-agent": (json.dumps({"events": [ev("r1", 1, agent="s\x00")]}).encode(), "agent"),
    "nul-event-id": (json.dumps({"events": [{**ev("r1", 1), "event_id": "r1/\x00"}]}).encode(), "event_id"),
    "nul-parent-id": (json.dumps({"events": [ev("r1", 1, parent_id="p\x00")]}).encode(), "parent_id"),
}


@pytest.mark.parametrize("name", sorted(POISON))
def test_a_poison_event_is_refused_before_the_commit_and_the_run_stays_whole(tmp_path, name):
    """Before: committed, then a 500 (SchemaError in event_to_step); the next verdict said t=0
    for t=1; after a restart GET/POST/SSE on the run answered 500 forever; NaN stored as null."""
    body, field = POISON[name]
    svc = GatewayService(cfg(tmp_path))
    with TestClient(build_app(svc)) as c:
        new_run(c)
        r = post(c, "r1", body)
        assert r.status_code == 422, (r.status_code, r.text)
        if field:
            assert r.json()["field"].startswith(field), r.json()
        assert [e.seq for e in svc.ledger.iter_run("a/r1")] == [0]       # nothing stored
        r = post(c, "r1", [ev("r1", 1)])
        assert r.status_code == 200 and r.json()["t"] == 0, r.text         # steps still in step
        assert post(c, "r1", [ev("r1", 2)]).json()["t"] == 1
    svc2 = GatewayService(cfg(tmp_path))                                   # a restart folds the ledger
    with TestClient(build_app(svc2)) as c:
        assert c.get("/v1/runs/r1", headers=A).status_code == 200
        assert post(c, "r1", [ev("r1", 3)]).json()["t"] == 2


def test_seq_exhaustion_is_a_409_not_a_500(gw):
    new_run(gw)
    big = (1 << 63) - 1
    assert post(gw, "r1", [ev("r1", 1, seq=big)]).status_code == 200
    r = post(gw, "r1", [{k: v for k, v in ev("r1", 2).items() if k != "seq"}])
    assert r.status_code == 409 and r.json()["field"] == "seq" and "largest" in r.json()["detail"], r.text
    assert post(gw, "r1", [ev("r1", 3, seq=big)]).status_code == 409        # and still answers


@pytest.mark.parametrize("bad", ["agents-surrogate", "task-surrogate", "agents-nul"])
def test_a_run_whose_fields_cannot_be_stored_is_refused(gw, bad):
    body = {"agents-surrogate": b'{"run_id": "x", "task": "t", "agents": ["a\\ud800"]}',
            "task-surrogate": b'{"run_id": "x", "task": "t\\udc00"}',
            "agents-nul": json.dumps({"run_id": "x", "task": "t", "agents": ["a\x00"]}).encode()}[bad]
    r = gw.post("/v1/runs", content=body, headers={**A, "content-type": "application/json"})
    assert r.status_code == 422, r.text


def _insert_raw(db, run_key, seq, eid, record: bytes):
    con = sqlite3.connect(db)
    con.execute("INSERT INTO aftraj_run_events (event_id, run_id, seq, kind, agent, parent_id, fingerprint, usage,"
                " record) VALUES (?, ?, ?, 'message', 's', NULL, ?, NULL, ?)", (eid, run_key, seq, "0" * 64, record))
    con.commit()
    con.close()


def test_a_ledger_event_the_fold_cannot_take_is_reported_by_name(tmp_path):
    """An event stored by an older version that this one cannot fold: every route answers 409
    naming it (before: 500 on GET, POST and SSE, forever)."""
    svc = GatewayService(cfg(tmp_path))
    with TestClient(build_app(svc)) as c:
        new_run(c)
        post(c, "r1", [ev("r1", 1)])
    rec = {**ev("a/r1", 2), "run_id": "a/r1", "meta": _nested(40)}
    _insert_raw(str(tmp_path / "ledger.db"), "a/r1", 2, "r1/2", orjson.dumps(rec))
    svc2 = GatewayService(cfg(tmp_path))
    with TestClient(build_app(svc2)) as c:
        for _ in range(2):
            for r in (c.get("/v1/runs/r1", headers=A), post(c, "r1", [ev("r1", 3)]),
                      c.get("/v1/runs/r1/stream", headers=A)):
                assert r.status_code == 409, (r.status_code, r.text)
                assert "r1/2" in r.json()["detail"] and r.json()["event_id"] == "r1/2", r.json()
        assert [e.seq for e in svc2.ledger.iter_run("a/r1")][:2] == [0, 1]      # nothing lost
        new_run(c, "r2")                                                          # other runs unaffected
        assert post(c, "r2", [ev("r2", 1)]).status_code == 200


# --------------------------------------------------------------------------- 2. one tenant cannot stall everyone

def _probe_healthz(url: str, n: int = 20, gap: float = 0.025) -> list[float]:
    out = []
    with httpx.Client(timeout=30) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            c.get(f"{url}/healthz").raise_for_status()
            out.append(1000 * (time.perf_counter() - t0))
            time.sleep(gap)
    return out


_IDLE: dict[str, float] = {}


def _idle_p80(url: str) -> float:
    """/healthz's own latency on this machine right now, no attack running (p80 of 20 probes)."""
    ms = sorted(_probe_healthz(url))
    return ms[15]


def _assert_healthy(url: str, what: str) -> None:
    """/healthz within 100 ms while the attack runs: the median and 80 % of 20 probes. On a
    loaded 2-core machine (or under `nice`) the gateway's own scheduling delay is added: the
    bound is 100 ms + 2 x the idle p80 measured before the attack (the attacks before the fix
    made /healthz take seconds: 26.8 s for the stalled streams)."""
    ms = _probe_healthz(url)
    ms.sort()
    allow = 100 + 2 * _IDLE.get(url, 0.0)
    print(f"healthz under {what}: p50={statistics.median(ms):.1f} ms p80={ms[15]:.1f} ms max={ms[-1]:.1f} ms "
          f"(idle p80 {_IDLE.get(url, 0.0):.1f} ms, bound {allow:.0f} ms)")
    assert statistics.median(ms) < allow and ms[15] < allow, (what, allow, ms)


def _seed_verdicts(db: str, run_key: str, n: int) -> None:
    v = {"run_id": "big", "t": 0, "decision": "CONTINUE", "action": "none", "auditor": "off", "latency_ms": 1.0,
         "findings": [{"kind": "x", "alarm": False, "reason": "r" * 500, "steps": [1]}]}
    con = sqlite3.connect(db)
    con.executemany("INSERT INTO aftraj_verdicts (run_id, seq, record) VALUES (?, ?, ?)",
                    [(run_key, i, orjson.dumps({**v, "seq": i})) for i in range(1, n + 1)])
    con.commit()
    con.close()


def _raw_get(port: int, path: str, key: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
    return s


def test_healthz_answers_while_stalled_streams_hold_a_big_history(gateway_process, gw_key, tmp_path):
    """60 streams that never read, on a run with 4,000 verdicts (before: /healthz took 26.8 s);
    at most max_streams_per_key (16) are accepted, the rest get 429."""
    g = gateway_process(limits={"max_streams_per_key": 16})
    g.start()
    _IDLE[g.url] = _idle_p80(g.url)
    httpx.post(f"{g.url}/v1/runs", json={"run_id": "big", "task": "t"},
               headers={"Authorization": f"Bearer {gw_key}"}).raise_for_status()
    _seed_verdicts(str(tmp_path / "ledger.db"), "t/big", 4000)
    socks = [_raw_get(g.port, "/v1/runs/big/stream", gw_key) for _ in range(60)]
    try:
        time.sleep(0.5)
        _assert_healthy(g.url, "60 stalled streams")
        statuses = []
        for s in socks:
            s.settimeout(5)
            statuses.append(s.recv(64).split(b" ")[1])
        assert statuses.count(b"200") == 16 and statuses.count(b"429") == 44, statuses
    finally:
        for s in socks:
            s.close()


@pytest.mark.slow
def test_healthz_answers_while_another_process_holds_the_write_lock(gateway_process, gw_key, tmp_path):
    """A writer elsewhere holds SQLite's lock: posts answer 503 (Retry-After) within about
    ledger_timeout_s (before: every request stalled, a 2 s deadline became 5.7 s)."""
    g = gateway_process(limits={"ledger_timeout_s": 1.0})
    g.start()
    _IDLE[g.url] = _idle_p80(g.url)
    h = {"Authorization": f"Bearer {gw_key}"}
    httpx.post(f"{g.url}/v1/runs", json={"run_id": "w", "task": "t"}, headers=h).raise_for_status()
    con = sqlite3.connect(str(tmp_path / "ledger.db"), isolation_level=None)
    con.execute("BEGIN IMMEDIATE")
    out = []

    def poster(i):
        t0 = time.perf_counter()
        r = httpx.post(f"{g.url}/v1/runs/w/events", json={"events": [ev("w", i)]}, headers=h, timeout=30)
        out.append((r.status_code, time.perf_counter() - t0))
    threads = [threading.Thread(target=poster, args=(i,)) for i in range(1, 9)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.2)
        _assert_healthy(g.url, "a held SQLite write lock")
        for t in threads:
            t.join(30)
    finally:
        con.execute("ROLLBACK")
        con.close()
    assert {s for s, _ in out} == {503} and max(dt for _, dt in out) < 5.0, out
    r = httpx.post(f"{g.url}/v1/runs/w/events", json={"events": [ev("w", 1)]}, headers=h)
    assert r.status_code == 200, r.text                       # the lock gone, the run goes on


@pytest.mark.slow
def test_half_sent_requests_are_closed_after_the_header_timeout(gateway_process):
    """300 unauthenticated requests that never finish their headers (before: 2,000 stayed open
    after 30 s): /healthz answers meanwhile, and the server closes them after header_timeout_s."""
    g = gateway_process(limits={"header_timeout_s": 1.0, "body_timeout_s": 1.0})
    g.start()
    _IDLE[g.url] = _idle_p80(g.url)
    socks = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", g.port))
            s.sendall(b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Le")
            socks.append(s)
        _assert_healthy(g.url, "300 half-sent requests")
        time.sleep(1.5)
        closed = 0
        for s in socks:
            s.settimeout(5)
            try:
                closed += s.recv(1024) == b""
            except OSError:
                closed += 1
        assert closed == 300, closed
        # a body that never comes: 408 after body_timeout_s
        s = socket.create_connection(("127.0.0.1", g.port))
        s.sendall("POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer proc-test-key\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode())
        s.settimeout(10)
        assert s.recv(64).split(b" ")[1] == b"408"
        s.close()
    finally:
        for s in socks:
            s.close()


class _BigReplyAuditor:
    """An OpenAI-compatible endpoint whose reply is a 1M-character '[' (before: 564 ms of parsing
    on the event loop per verdict)."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": "[" * 1_000_000},
                                        "finish_reason": "stop"}], "usage": {"prompt_tokens": 1}}).encode()

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_healthz_answers_while_hostile_replies_are_parsed(gateway_process, gw_key):
    big = _BigReplyAuditor()
    g = gateway_process(auditor={"backend": "openai", "base_url": big.url, "model": "m", "deadline_s": 20,
                                 "tokenizer": "approx"})
    g.start()
    _IDLE[g.url] = _idle_p80(g.url)
    h = {"Authorization": f"Bearer {gw_key}"}
    httpx.post(f"{g.url}/v1/runs", json={"run_id": "p", "task": "t"}, headers=h).raise_for_status()
    out = []

    def poster():
        for i in range(1, 6):
            r = httpx.post(f"{g.url}/v1/runs/p/events", json={"events": [ev("p", i)]}, headers=h, timeout=60)
            out.append(r.json())
    t = threading.Thread(target=poster)
    try:
        t.start()
        time.sleep(0.1)
        _assert_healthy(g.url, "1M-character auditor replies")
    finally:
        t.join(60)
        big.server.shutdown()
    assert len(out) == 5 and all(v["auditor"] == "parse_failure" for v in out), out


def test_streams_and_requests_in_flight_are_limited_per_key(tmp_path):
    svc = GatewayService(cfg(tmp_path, limits=LimitsConfig(max_streams_per_key=2, max_inflight_per_key=1)))
    from serve.protocol import RunCreate
    from serve.service import GatewayError
    svc.create_run("a", RunCreate(run_id="r", task="t"))
    r = svc.run("a", "r")
    svc.open_stream("a", r)
    svc.open_stream("a", r)
    with pytest.raises(GatewayError) as e:
        svc.open_stream("a", r)
    assert e.value.status == 429
    svc.open_stream("b", r)                        # another key has its own allowance
    svc.begin_request("a")
    with pytest.raises(GatewayError) as e:
        svc.begin_request("a")
    assert e.value.status == 429
    svc.end_request("a")
    svc.begin_request("a")


def test_a_stream_resumes_after_last_event_id(tmp_path):
    from serve.protocol import RunCreate
    svc = GatewayService(cfg(tmp_path))
    import asyncio

    async def go():
        svc.create_run("a", RunCreate(run_id="r", task="t"))
        for i in range(1, 251):                    # more than one history page
            await svc.ingest("a", "r", [ev("r", i)])
        items = await svc.stream_pages("a", "r", after_seq=120)
        got = []
        async for page in items:
            got += [seq for seq, _ in page]
            if got[-1] == 250:
                break
        await items.aclose()
        return got
    got = asyncio.run(go())
    assert got == list(range(121, 251))
    assert not svc.streams                         # the stream's count was given back


# --------------------------------------------------------------------------- 3. bounded run state

def test_run_state_is_bounded_and_rebuilt_from_the_ledger(tmp_path):
    """Before: every step of every run stayed in RAM (150 posts of 0.9 MB: +141 MB)."""
    c_ = cfg(tmp_path, limits=LimitsConfig(max_cached_runs=4, max_cached_bytes=4 << 20, max_body_bytes=2 << 20))
    svc = GatewayService(c_)
    with TestClient(build_app(svc)) as c:
        for k in range(12):
            new_run(c, f"r{k}")
            r = post(c, f"r{k}", [ev(f"r{k}", 1, "x" * 900_000)])
            assert r.status_code == 200 and r.json()["t"] == 0
            assert len(svc.runs) <= 4 and svc.cached_bytes <= (4 << 20) + 1_000_000, (len(svc.runs), svc.cached_bytes)
        # an evicted run comes back from the ledger, its steps in step
        assert "a/r0" not in svc.runs
        assert post(c, "r0", [ev("r0", 2)]).json()["t"] == 1
        assert c.get("/v1/runs/r0", headers=A).json()["observer"]["events"] == 3
    svc2 = GatewayService(cfg(tmp_path, limits=LimitsConfig(run_idle_s=0.05)))
    with TestClient(build_app(svc2)) as c:
        post(c, "r1", [ev("r1", 2)])
        time.sleep(0.1)
        post(c, "r2", [ev("r2", 2)])
        assert "a/r1" not in svc2.runs and "a/r2" in svc2.runs       # idle: evicted at the next sweep


def test_an_openai_auditor_always_has_a_budget():
    """Before: `budget: null` (the shipped gateway-local.yaml) re-rendered and re-sent the whole
    run at every event (19 MB and 833 ms a request at step 399)."""
    from aftraj.tokens import prompt_budget

    a = AuditorConfig(backend="openai", base_url="http://x/v1", model="m")
    assert a.max_prompt_tokens == 8192 and a.budget == prompt_budget(8192) == 8160
    local = load_serve_config("configs/serve/gateway-local.yaml")
    assert local.auditor.budget == prompt_budget(local.auditor.max_prompt_tokens) and local.auditor.tokenizer
    assert AuditorConfig().budget is None              # no model to prompt: no budget


def test_the_budget_is_one_knob_and_an_old_config_reads_the_same():
    """Issue 48 item 5: the render budget is `prompt_budget(max_prompt_tokens)`, the rule every
    stage uses; a config with the old key `budget: N` renders within the same N, and one that
    gives both keys in disagreement is refused naming `auditor.budget`."""
    from aftraj.tokens import TEMPLATE_MARGIN, prompt_budget
    from serve.config import ConfigError, config_from_dict

    base = {"backend": "openai", "base_url": "http://x/v1", "model": "m", "tokenizer": "approx"}
    new = config_from_dict({"kind": "gateway", "auditor": {**base, "max_prompt_tokens": 4096}}).auditor
    assert new.budget == prompt_budget(4096) == 4096 - TEMPLATE_MARGIN
    old = config_from_dict({"kind": "gateway", "auditor": {**base, "budget": 4064}}).auditor
    assert (old.max_prompt_tokens, old.budget) == (4096, 4064)
    same = config_from_dict({"kind": "gateway", "auditor": {**base, "budget": 4064, "max_prompt_tokens": 4096}})
    assert same.auditor == new
    with pytest.raises(ConfigError, match=r"gw.yaml: auditor.budget: is derived from max_prompt_tokens "
                                          r"\(prompt_budget\(4096\) = 4064\), got 7648"):
        config_from_dict({"kind": "gateway", "auditor": {**base, "budget": 7648, "max_prompt_tokens": 4096}},
                         "gw.yaml")


def test_the_bytes_sent_per_verdict_do_not_grow_with_the_run(tmp_path):
    bodies = []

    def handler(request):
        bodies.append(len(request.content))
        text = '<think>x</think><answer>{"answer": "SAFE", "agent": null, "reason": null}</answer>'
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": text},
                                                      "finish_reason": "stop"}], "usage": {"prompt_tokens": 1}})
    a = AuditorConfig(backend="openai", base_url="http://x/v1", model="m", max_prompt_tokens=2032, tokenizer="approx")
    svc = GatewayService(cfg(tmp_path, auditor=a), transport=httpx.MockTransport(handler))
    with TestClient(build_app(svc)) as c:
        new_run(c)
        for i in range(1, 201):
            assert post(c, "r1", [ev("r1", i, f"step {i} " + "w" * 2000)]).status_code == 200
    assert max(bodies[100:]) < 2000 * 3 * 2 + 20_000 and max(bodies[100:]) < 1.3 * max(bodies[40:100]), \
        (max(bodies[40:100]), max(bodies[100:]))


# --------------------------------------------------------------------------- 4. smaller

@pytest.mark.parametrize("what", ["run-agents", "tool", "handoff-to", "usage-model"])
def test_every_string_field_is_bounded(gw, what):
    new_run(gw)
    if what == "run-agents":
        r = gw.post("/v1/runs", json={"run_id": "x", "task": "t", "agents": ["a" * 100_000] * 9}, headers=A)
        assert r.status_code == 422, r.text
        return
    e = {"tool": {"event_id": "r1/1", "seq": 1, "kind": "tool_call", "agent": "s",
                  "payload": {"content": "", "tool": "t" * 400_000}},
         "handoff-to": {"event_id": "r1/1", "seq": 1, "kind": "handoff", "agent": "s",
                        "payload": {"content": "", "to": "b" * 400_000}},
         "usage-model": {**ev("r1", 1), "usage": {"model": "m" * 400_000}}}[what]
    r = post(gw, "r1", [e])
    assert r.status_code == 422, r.text


def test_metrics_need_a_key_unless_public(tmp_path):
    with TestClient(build_app(GatewayService(cfg(tmp_path, metrics_keys=("a",))))) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=A).status_code == 200
        # issue 45 item 9: a tenant's key does not read the counters of every tenant
        r = c.get("/metrics", headers=B)
        assert r.status_code == 403 and "metrics_keys" in r.json()["detail"] and "aftraj_gateway" not in r.text
    with TestClient(build_app(GatewayService(cfg(tmp_path, metrics_public=True)))) as c:
        assert c.get("/metrics").status_code == 200


def test_run_ids_are_scoped_by_key(gw):
    new_run(gw, "same")
    assert gw.post("/v1/runs", json={"run_id": "same", "task": "b's"}, headers=B).status_code == 201
    assert gw.post("/v1/runs", json={"run_id": "same", "task": "again"}, headers=A).status_code == 409
    assert gw.get("/v1/runs/same", headers=B).json()["task"] == "b's"
    assert gw.get("/v1/runs/same", headers=A).json()["task"] == "t"


def test_bad_key_floods_are_rate_limited_per_address(tmp_path):
    c_ = cfg(tmp_path, limits=LimitsConfig(auth_failures_per_s=0.01, auth_failure_burst=5))
    with TestClient(build_app(GatewayService(c_))) as c:
        codes = [c.get("/v1/runs/x", headers={"Authorization": "Bearer wrong"}).status_code for _ in range(8)]
        assert codes == [401] * 5 + [429] * 3, codes
        assert c.get("/v1/runs/x", headers=A).status_code == 404         # a valid key still gets through


def test_a_legacy_unscoped_run_stays_readable_by_its_owner(tmp_path):
    """A run created before ids were scoped (stored under its bare id) is still its owner's."""
    svc = GatewayService(cfg(tmp_path))
    from aftraj.events import make_event
    with svc.ledger.engine.begin() as conn:
        conn.execute(svc.runs_table.insert().values(run_id="old", owner="a", record=orjson.dumps(
            {"task": "t", "agents": [], "category": None})))
        svc.ledger._store(conn, [make_event(event_id="old/run_started", run_id="old", kind="message", agent="gateway",
                                            payload={"content": "t"}, seq=0, meta={"aftraj_synthetic": True})])
    with TestClient(build_app(svc)) as c:
        assert c.get("/v1/runs/old", headers=A).status_code == 200
        assert c.get("/v1/runs/old", headers=B).status_code == 404
        assert post(c, "old", [ev("old", 1)]).json()["t"] == 0


# --------------------------------------------------------------------------- 10. the serve CLI

def _cli(args, capsys):
    from aftraj.cli import main
    rc = main(args)
    err = capsys.readouterr().err
    return rc, err


def _write_cfg(tmp_path, **kw):
    import yaml
    raw = {"kind": "gateway", "ledger_url": f"sqlite:///{tmp_path / 'l.db'}",
           "api_keys": [{"name": "t", "sha256": hash_key("k")}], **kw}
    p = tmp_path / "gw.yaml"
    p.write_text(yaml.safe_dump(raw))
    return str(p)


@pytest.mark.parametrize("case", ["port-negative", "port-70000", "url-scheme", "pg-unreachable", "shared-sha",
                                  "limits-list", "port-in-use"])
def test_serve_gateway_bad_input_is_one_line(tmp_path, capsys, case):
    extra, port = {}, None
    if case == "url-scheme":
        extra = {"ledger_url": "nosuchdb://x/y"}
    elif case == "pg-unreachable":
        extra = {"ledger_url": "postgresql+psycopg://u:secretpw@127.0.0.1:1/x"}
    elif case == "shared-sha":
        extra = {"api_keys": [{"name": "a", "sha256": hash_key("k")}, {"name": "b", "sha256": hash_key("k")}]}
    elif case == "limits-list":
        extra = {"limits": []}
    held = None
    if case == "port-in-use":
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
    elif case == "port-negative":
        port = -1
    elif case == "port-70000":
        port = 70000
    args = ["serve", "gateway", "--config", _write_cfg(tmp_path, **extra)]
    if port is not None:
        args += ["--port", str(port)]
    if case in ("url-scheme", "pg-unreachable", "shared-sha", "limits-list"):
        args += ["--port", "0"] if port is None else []
    try:
        rc, err = _cli(args, capsys)
    finally:
        if held:
            held.close()
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (rc, err)
    assert "secretpw" not in err


@pytest.mark.parametrize("name", ["", "two words", "a\nb", "x" * 65, "a/b"])
def test_serve_key_refuses_a_name_the_gateway_would_reject(capsys, name):
    rc, err = _cli(["serve", "key", "--name", name], capsys)
    assert rc == 2 and "Traceback" not in err and "--name" in err, (rc, err)
