"""Per-event cost in the gateway with the step-scored auditor in its process (issue 44 item 6):
a real `aftraj serve gateway` (`configs/serve/gateway-steps.yaml`, its model replaced by
`--model`, reason off) on a temporary SQLite ledger; `--repeats` long runs of `--events` steps
(`benchmarks/steps_walk.long_runs`: the test runs' steps one after another, periodic so that the
events around step 10 and the last ten hold the same steps) posted one event a request, in turn.
Figures: the request's wall time and the verdict's `model_latency_ms` around step 10 and around the
last step (p50, p99), their ratio (target p99 at step 200 <= 1.5x at step 10), and every verdict's
auditor status (all "ok": no deadline was missed).

    python benchmarks/gateway_steps.py --model runs/steps-smollm2/final --data runs/aftraj-2k/test.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
KEY = "aft-local-demo-key"          # the shipped config's demo key


def _pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a step-scored checkpoint folder (aftraj train steps' final/)")
    p.add_argument("--data", required=True, help="test runs (JSONL) whose steps make the long runs")
    p.add_argument("--events", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="OMP threads of the gateway process")
    a = p.parse_args()

    import yaml

    from aftraj.events import step_to_event
    from aftraj.schema import iter_jsonl
    from serve.client import GatewayClient
    from _gateway import Gateway
    from steps_walk import long_runs

    trajs = [t for t in iter_jsonl(a.data)][: a.repeats + 20]
    runs = long_runs(trajs, a.events, a.repeats)
    tmp = Path(tempfile.mkdtemp(prefix="gw-steps-"))
    cfg = yaml.safe_load((REPO / "configs/serve/gateway-steps.yaml").read_text())
    cfg["ledger_url"] = f"sqlite:///{tmp / 'ledger.db'}"
    cfg["auditor"]["options"] = {"model": str(Path(a.model).resolve()), "reason": "none"}
    cfg["auditor"]["deadline_s"] = 60.0
    gateway = Gateway(tmp, cfg, env={"OMP_NUM_THREADS": str(a.threads), "HF_HUB_OFFLINE": "1",
                                     "TRANSFORMERS_OFFLINE": "1"})
    try:
        gateway.start()
        gw = GatewayClient(gateway.url, KEY, timeout=120)
        wall: dict[int, list[float]] = {}
        model: dict[int, list[float]] = {}
        status: dict[str, int] = {}
        for r, run in enumerate(runs):
            rid = gw.create_run(run.task, agents=sorted({s.agent for s in run.steps}), category=run.domain,
                                run_id=f"long-{r}")
            for i, step in enumerate(run.steps):
                ev = step_to_event(dataclasses.replace(step, index=i + 1, event_id=f"{rid}/{i + 1}", meta={}),
                                   rid).to_record()
                t0 = time.perf_counter()
                v = gw.post_events(rid, [ev])
                wall.setdefault(i, []).append(time.perf_counter() - t0)
                model.setdefault(i, []).append((v.get("model_latency_ms") or 0) / 1000)
                status[v["auditor"]] = status.get(v["auditor"], 0) + 1

        def window(d, lo, hi):
            v = [x for t in range(lo, hi) for x in d.get(t, [])]
            return {"n": len(v), "p50_ms": round(1000 * _pct(v, 0.5), 1), "p99_ms": round(1000 * _pct(v, 0.99), 1)}

        out = {"events": a.events, "repeats": a.repeats, "auditor_status": status,
               "load_avg_1m": round(os.getloadavg()[0], 2)}
        for name, d in (("request", wall), ("model", model)):
            w10, wend = window(d, 5, 15), window(d, a.events - 10, a.events)
            out[name] = {"around_step_10": w10, f"around_step_{a.events}": wend,
                         "p99_ratio": round(wend["p99_ms"] / w10["p99_ms"], 3),
                         "p50_ratio": round(wend["p50_ms"] / w10["p50_ms"], 3)}
        print(json.dumps(out))
        return 0
    finally:
        gateway.stop()


if __name__ == "__main__":
    sys.exit(main())
