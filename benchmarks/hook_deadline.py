"""What a misbehaving gateway costs an agent's step (issue 45 items 2 and 3), measured with the
issue's own shapes: a gateway that drips its answer (one byte every 1.5 s), one that hangs, one
answering 300 MB (streamed, and with a declared Content-Length), and one answering JSON of the
wrong shape, a 3xx or a 204, against a `_GatewayRun` with the hooks' defaults (2 s deadline) and
the breaker off (so that every step pays), then with the breaker on (the default: 3 failures,
30 s cool-down) for a 6-step run. The gateway is tests/adapters/bad_gateway.py on 127.0.0.1.

    python benchmarks/hook_deadline.py                  # every mode, 6 steps each
    python benchmarks/hook_deadline.py --modes drip --steps 3

Last lines, per mode: `mode=… steps=… max_step_s=… mean_step_s=… raised=… breaker_run_s=…
rss_growth_mb=…` (max_step_s must stay <= deadline + 0.5 s; raised must be 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bad_gateway", ROOT / "tests" / "adapters" / "bad_gateway.py")
bad = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bad)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(mode: str, steps: int, **kw) -> tuple[list[float], int, object]:
    from aftraj.adapters.base import RunBuilder
    from aftraj.adapters.hooks import _GatewayRun
    with bad.BadGateway(mode, drip_s=1.5, huge_mb=300) as url:
        rb = RunBuilder(f"bench-{mode}", source="bench")
        r = _GatewayRun(url, api_key="k", run_id=f"bench-{mode}", **kw)
        times, raised = [], 0
        for i in range(steps):
            t0 = time.monotonic()
            try:
                r.post([rb.message("agent", f"step {i}")])
            except BaseException:
                raised += 1
            times.append(time.monotonic() - t0)
        r.close(timeout=0.0)
    return times, raised, r


def main() -> None:
    import logging
    logging.getLogger("aftraj.hooks").setLevel(logging.ERROR)     # one warning a failed step otherwise
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="drip,hang,huge,declared,malformed,redirect")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    from aftraj.adapters.hooks import DEADLINE_S
    for mode in args.modes.split(","):
        rss0 = rss_mb()
        times, raised, r = run(mode, args.steps, max_failures=10**6)
        growth = rss_mb() - rss0
        t0 = time.monotonic()
        btimes, braised, br = run(mode, args.steps)          # the defaults: the breaker opens after 3
        breaker_s = time.monotonic() - t0
        print(f"mode={mode} deadline_s={DEADLINE_S:g} steps={args.steps} max_step_s={max(times):.2f} "
              f"mean_step_s={sum(times) / len(times):.2f} raised={raised + braised} "
              f"breaker_run_s={breaker_s:.2f} breaker_calls={br.failed_posts} "
              f"rss_growth_mb={growth:.1f} first_failure={r.failures[0][:60]!r} "
              f"load1={os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
