"""Issue 45 item 5, re-measured: a legitimate request while other clients hold thousands of
half-sent request bodies. The gateway is a real `aftraj serve gateway` process (default limits,
auditor off) on a temporary SQLite ledger; each attacker is a separate process that binds its
own loopback address (127.0.0.2, 127.0.0.3, …: Linux routes all of 127/8 to lo) and opens
`--per-attacker` connections, each sending the headers of a POST with `Content-Length: 1000` and
4 bytes of body, then nothing (half to the unauthenticated `/v1/runs`, half to `/ui/login`,
which reads its body before any key is checked), and holds them. Meanwhile a client on
127.0.0.1 times `POST /v1/runs` with a valid key, once every 0.25 s, during the flood and while
the connections are held.

    python benchmarks/half_open.py                                  # 2 attackers x 10,000 = 20,000
    python benchmarks/half_open.py --attackers 20 --per-attacker 1000   # 20 addresses x 1,000
    python benchmarks/half_open.py --rev 757a086                    # the gateway of another revision

Each attacker process needs a file per connection: the machine's open-file limit
(`ulimit -n`) bounds `--per-attacker` (the script raises the soft limit to the hard
one and says when it had to open fewer). Figure lines: `held attempted=… open_at_client=…`
(connections the attackers still hold open, i.e. that the gateway did not close), `legit
n=… p50_ms=… max_ms=… failures=…` (target: max <= 1,000 ms, no failure), the gateway's open
files (`/proc/PID/fd`) at the peak.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
KEY = "bench-key"


def attacker(addr: str, port: int, n: int, hold_s: float, out) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    reqs = [b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"ta",
            b"POST /ui/login HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
            b"Content-Length: 1000\r\n\r\nkey="]
    socks, failed = [], 0
    for i in range(n):
        try:
            s = socket.socket()
            s.setblocking(True)
            s.bind((addr, 0))
            s.settimeout(2)
            s.connect(("127.0.0.1", port))
            s.sendall(reqs[i % 2])
            socks.append(s)
        except OSError:
            failed += 1
            try:
                s.close()
            except OSError:
                pass
    out.put(("opened", addr, len(socks), failed))
    time.sleep(hold_s)
    alive = 0
    for s in socks:
        s.setblocking(False)
        try:
            data = s.recv(1)
            alive += data != b"" and False            # an answer (401/429/408) then close: not held
        except BlockingIOError:
            alive += 1                                # nothing to read and not closed: still held open
        except OSError:
            pass
    out.put(("held", addr, alive, len(socks)))
    for s in socks:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attackers", type=int, default=2)
    ap.add_argument("--per-attacker", type=int, default=10_000)
    ap.add_argument("--hold", type=float, default=8.0, help="seconds the attackers hold after opening")
    ap.add_argument("--rev", help="run the gateway of this git revision (git archive)")
    args = ap.parse_args()
    import httpx

    from _gateway import Gateway, code_at
    from serve.config import hash_key
    tmp = Path(tempfile.mkdtemp(prefix="aftraj-half-open-"))
    gw = Gateway(tmp, {"ledger_url": f"sqlite:///{tmp / 'ledger.db'}",
                       "api_keys": [{"name": "t", "sha256": hash_key(KEY)}], "auditor": {"backend": "none"}},
                 code=code_at(args.rev, tmp / "code"))
    port, base = gw.port, gw.url
    try:
        gw.start()
        proc = gw.proc
        lat, fails, peak_fd = [], [], [0]
        stop = threading.Event()

        def legit():
            i = 0
            while not stop.is_set():
                i += 1
                t = time.perf_counter()
                try:
                    with httpx.Client(timeout=30) as c:          # a new connection each time, as a new client
                        r = c.post(f"{base}/v1/runs", json={"task": f"legit {i}"},
                                   headers={"Authorization": f"Bearer {KEY}"})
                    ok = r.status_code == 201
                except httpx.HTTPError as e:
                    ok, r = False, e
                ms = 1000 * (time.perf_counter() - t)
                lat.append((t, ms))
                if not ok:
                    fails.append(str(getattr(r, "status_code", r))[:80])
                try:
                    peak_fd[0] = max(peak_fd[0], len(os.listdir(f"/proc/{proc.pid}/fd")))
                except OSError:
                    pass
                stop.wait(0.25)

        q = mp.Queue()
        procs = [mp.Process(target=attacker, args=(f"127.0.0.{2 + i}", port, args.per_attacker, args.hold, q))
                 for i in range(args.attackers)]
        th = threading.Thread(target=legit, daemon=True)
        th.start()
        t_flood = time.perf_counter()
        for p in procs:
            p.start()
        msgs = [q.get(timeout=600) for _ in range(args.attackers)]
        t_held = time.perf_counter()                     # every attacker holds what it opened
        msgs += [q.get(timeout=600) for _ in range(args.attackers)]
        for p in procs:
            p.join(60)
        stop.set()
        th.join(60)
        opened = sum(m[2] for m in msgs if m[0] == "opened")
        failed = sum(m[3] for m in msgs if m[0] == "opened")
        held = sum(m[2] for m in msgs if m[0] == "held")
        print(f"held attempted={args.attackers * args.per_attacker} connected={opened} refused_at_connect={failed} "
              f"open_at_client_after_{args.hold:g}s={held} gateway_peak_open_files={peak_fd[0]} "
              f"flood_and_hold_s={time.perf_counter() - t_flood:.1f} rev={args.rev or 'working tree'}", flush=True)
        for name, xs in (("during the flood", [ms for t, ms in lat if t < t_held]),
                         ("while held", [ms for t, ms in lat if t >= t_held])):
            xs = sorted(xs) or [float("nan")]
            print(f"legit {name}: n={len(xs)} p50_ms={xs[len(xs) // 2]:.1f} max_ms={xs[-1]:.1f}", flush=True)
        print(f"legit failures={len(fails)} {fails[:3] if fails else ''} (target while held: max <= 1000 ms, "
              f"no failure) flood_s={t_held - t_flood:.1f} load={os.getloadavg()[0]:.1f}", flush=True)
    finally:
        gw.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
