"""Issue 45 items 4 and 7, re-measured: tenant A starves tenant B through the web view, and a
long run's reads. The gateway is a real `aftraj serve gateway` process (auditor off) on a
temporary SQLite ledger holding tenant A's run `big` (`--events`, 100k by default, posted in
batches of 1,000 through the service) with `--verdicts` verdicts (the batches' own, then rows
copied from one of them up to the count: the verdicts a one-event-a-post run of that length
would hold) and tenant B's run `b-run`.

    python benchmarks/web_attack.py                           # the working tree
    python benchmarks/web_attack.py --rev 757a086             # the gateway of another revision, same shapes

Phases: (1) quiet: B alternates `GET /ui` and a one-event `POST /v1/runs/b-run/events`,
latency per request; (2) attack: the same while A keeps `--abandon` (20) fragment requests for
`big` in flight (from a process of its own), each client closing its connection `--leave-after`
s after sending (0.2 s) and opening the next at once; the gateway's CPU seconds over the phase
are read from /proc. On a 2-core machine A's client process (20 Python threads reconnecting) takes
a core from the gateway and B's client; `--attacker-nice 10` runs it at a lower priority (as
clients on another machine would be) and `--path /healthz` gives the same attack's HTTP floor. Quiet and attack alternate `--rounds` times (`--samples` of each kind per
phase in all), so the shared machine's drift falls on both. (3) long run: `GET /v1/runs/big` (status and time, three times: the first
loads and folds the run) and one complete fragment request. Figure lines:
`quiet ui_p50_ms=… ui_p99_ms=… post_p50_ms=… post_p99_ms=…`, `attack …` the same plus
`abandoned=N gateway_cpu_s=…`, `ratio ui_p99=… post_p99=…` (target <= 2), `long get_run=…`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
KEY_A, KEY_B = "bench-key-a", "bench-key-b"


def build(tmp: Path, n_events: int, n_verdicts: int) -> str:
    """The ledger: A's `big` run and B's `b-run` (through the service, auditor off)."""
    import orjson
    import sqlalchemy as sa

    from serve.config import ApiKey, GatewayConfig, LimitsConfig, hash_key
    from serve.protocol import RunCreate
    from serve.service import GatewayService

    url = f"sqlite:///{tmp / 'ledger.db'}"
    svc = GatewayService(GatewayConfig(ledger_url=url, api_keys=(ApiKey("a", hash_key(KEY_A)),
                                                                   ApiKey("b", hash_key(KEY_B))),
                                       limits=LimitsConfig(ledger_timeout_s=60)))
    svc.create_run("a", RunCreate(run_id="big", task="a long run", agents=["planner", "coder", "tester"]))
    svc.create_run("b", RunCreate(run_id="b-run", task="tenant B's run", agents=["solo"]))

    async def fill():
        for lo in range(1, n_events + 1, 1000):
            await svc.ingest("a", "big", [
                {"event_id": f"big/{i}", "seq": i, "kind": "message", "agent": ("planner", "coder", "tester")[i % 3],
                 "payload": {"content": f"step {i}: " + "lorem ipsum " * 20}}
                for i in range(lo, min(n_events, lo + 999) + 1)])
    asyncio.run(fill())
    t = svc.verdicts_table
    with svc.ledger.write() as conn:
        have = {s for (s,) in conn.execute(sa.select(t.c.seq).where(t.c.run_id == "a/big"))}
        sample = orjson.loads(conn.execute(sa.select(t.c.record).where(t.c.run_id == "a/big")).first()[0])
        rows, seq = [], 0
        while len(have) + len(rows) < n_verdicts:
            seq += 1
            if seq in have:
                continue
            rows.append({"run_id": "a/big", "seq": seq, "record": orjson.dumps({**sample, "seq": seq, "t": seq - 1})})
            if len(rows) == 20_000:
                conn.execute(t.insert(), rows)
                have.update(r["seq"] for r in rows)
                rows = []
        if rows:
            conn.execute(t.insert(), rows)
    asyncio.run(svc.aclose())
    return url


def start_gateway(tmp: Path, url: str, code: Path, limits: dict | None = None):
    """The gateway on `url` (auditor off, both tenants' keys, rate limits out of the way)."""
    from _gateway import Gateway
    from serve.config import hash_key
    return Gateway(tmp, {
        "ledger_url": url,
        "api_keys": [{"name": "a", "sha256": hash_key(KEY_A)}, {"name": "b", "sha256": hash_key(KEY_B)}],
        "auditor": {"backend": "none"}, "limits": {"rate_per_s": 100000, "burst": 100000, **(limits or {})}},
        code=code).start()


def measure_b(base: str, samples: int, seq0: int) -> tuple[list[float], list[float], list[int]]:
    import httpx
    ui, post, codes = [], [], []
    h = {"Authorization": f"Bearer {KEY_B}"}
    with httpx.Client(base_url=base, headers=h, timeout=120) as c:
        for i in range(samples):
            t0 = time.perf_counter()
            r = c.get("/ui")
            ui.append(1000 * (time.perf_counter() - t0))
            codes.append(r.status_code)
            t0 = time.perf_counter()
            r = c.post("/v1/runs/b-run/events", json={"events": [
                {"event_id": f"b-run/{seq0 + i}", "seq": seq0 + i, "kind": "message", "agent": "solo",
                 "payload": {"content": f"step {seq0 + i}"}}]})
            post.append(1000 * (time.perf_counter() - t0))
            codes.append(r.status_code)
            time.sleep(0.02)
    return ui, post, codes


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def attackers(port: int, n: int, leave_after: float, stop, total, path: str = "/ui/runs/big/fragment",
              nice: int = 0) -> None:
    """A's clients, in a process of their own (their threads never share B's interpreter lock),
    at `nice` (A's clients run elsewhere in a real attack: on this 2-core machine their own CPU,
    ~20 Python threads reconnecting, took the cores from the gateway and from B's client)."""
    if nice:
        os.nice(nice)
    count = [0]
    threads = [threading.Thread(target=abandon_loop, args=(port, leave_after, stop, count, path), daemon=True)
               for _ in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    total.value = count[0]


def abandon_loop(port: int, leave_after: float, stop, count: list, path: str) -> None:
    req = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY_A}\r\n\r\n").encode()
    while not stop.is_set():
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(req)
            stop.wait(leave_after)
            s.close()
            count[0] += 1
        except OSError:
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--verdicts", type=int, default=202_000)
    ap.add_argument("--samples", type=int, default=300, help="of each kind, per phase (quiet, attack)")
    ap.add_argument("--rounds", type=int, default=3, help="quiet and attack phases alternate this many times")
    ap.add_argument("--abandon", type=int, default=20)
    ap.add_argument("--leave-after", type=float, default=0.2)
    ap.add_argument("--rev", help="run the gateway of this git revision (git archive) on the same ledger")
    ap.add_argument("--path", default="/ui/runs/big/fragment",
                    help="what A's clients ask for (a cheap path such as /healthz gives the HTTP floor)")
    ap.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE",
                    help="a `limits:` value of the gateway's config (repeatable), e.g. web_cpu_per_s=0.05")
    ap.add_argument("--ledger", help="a ledger this script built before (sqlite:///…/ledger.db; copied, not changed)")
    ap.add_argument("--attacker-nice", type=int, default=0,
                    help="A's client process at this niceness (10: A's clients take only the CPU the gateway and B "
                         "leave, as clients on another machine would; the attack's request count is printed)")
    args = ap.parse_args()
    from _gateway import code_at
    tmp = Path(tempfile.mkdtemp(prefix="aftraj-web-attack-"))
    gws = []
    try:
        t0 = time.time()
        if args.ledger:
            shutil.copy(args.ledger.removeprefix("sqlite:///"), tmp / "ledger.db")
            url = f"sqlite:///{tmp / 'ledger.db'}"
        else:
            url = build(tmp, args.events, args.verdicts)
            print(f"built events={args.events} verdicts={args.verdicts} in {time.time() - t0:.1f} s", flush=True)
        code = code_at(args.rev, tmp / "code")
        import yaml
        limits = {k: yaml.safe_load(v) for k, v in (x.split("=", 1) for x in args.limit)}
        gw = start_gateway(tmp, url, code, limits)
        gws.append(gw)
        port, base = gw.port, gw.url
        import multiprocessing as mp
        quiet: dict = {"ui": [], "post": [], "codes": []}
        attack: dict = {"ui": [], "post": [], "codes": []}
        abandoned, cpu, seq, load0 = 0, 0.0, 1, os.getloadavg()[0]
        per = max(1, args.samples // args.rounds)
        for _ in range(args.rounds):            # quiet and attack interleaved: the machine's drift hits both
            ui, post, codes = measure_b(base, per, seq)
            seq += per
            quiet["ui"] += ui
            quiet["post"] += post
            quiet["codes"] += codes
            stop, total = mp.Event(), mp.Value("i", 0)
            att = mp.Process(target=attackers, args=(port, args.abandon, args.leave_after, stop, total, args.path,
                                                     args.attacker_nice))
            c0 = gw.cpu_s()
            att.start()
            time.sleep(1.0)
            ui, post, codes = measure_b(base, per, seq)
            seq += per
            stop.set()
            att.join(30)
            cpu += gw.cpu_s() - c0
            abandoned += total.value
            attack["ui"] += ui
            attack["post"] += post
            attack["codes"] += codes
        for name, d, extra in (("quiet", quiet, f"load={load0:.1f}"),
                               ("attack", attack, f"abandoned={abandoned} attacker_nice={args.attacker_nice} gateway_cpu_s={cpu:.1f} "
                                                  f"load={os.getloadavg()[0]:.1f}")):
            print(f"{name} ui_p50_ms={pct(d['ui'], .5):.1f} ui_p99_ms={pct(d['ui'], .99):.1f} "
                  f"post_p50_ms={pct(d['post'], .5):.1f} post_p99_ms={pct(d['post'], .99):.1f} "
                  f"non_2xx={sum(c >= 300 for c in d['codes'])} {extra}", flush=True)
        print(f"ratio ui_p99={pct(attack['ui'], .99) / pct(quiet['ui'], .99):.2f} "
              f"post_p99={pct(attack['post'], .99) / pct(quiet['post'], .99):.2f} (target <= 2) "
              f"ui_p50={pct(attack['ui'], .5) / pct(quiet['ui'], .5):.2f} "
              f"post_p50={pct(attack['post'], .5) / pct(quiet['post'], .5):.2f}", flush=True)
        time.sleep(2.0)
        c2 = gw.cpu_s()
        time.sleep(3.0)
        print(f"after the attack: gateway_cpu_s over 3 s = {gw.cpu_s() - c2:.2f} (work left behind)", flush=True)
        import httpx
        h = {"Authorization": f"Bearer {KEY_A}"}
        outs = []
        for _ in range(3):
            t0 = time.perf_counter()
            r = httpx.get(f"{base}/v1/runs/big", headers=h, timeout=120)
            outs.append(f"{r.status_code}/{time.perf_counter() - t0:.2f}s/"
                        f"{len(r.json().get('verdicts', [])) if r.status_code == 200 else 0}")
            if r.status_code == 503:
                time.sleep(1)
        t0 = time.perf_counter()
        r = httpx.get(f"{base}/ui/runs/big/fragment", headers=h, timeout=120)
        frag = f"{r.status_code}/{time.perf_counter() - t0:.2f}s/{len(r.content) // 1024}KB"
        print(f"long get_run={' '.join(outs)} fragment={frag} gateway_peak_rss_mb={gw.peak_rss_mb():.0f}", flush=True)
    finally:
        for gw in gws:
            gw.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
