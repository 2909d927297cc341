"""Per-request cost of the gateway against the run's length (issue 23, item 3): one run posted
one event a request up to step ~400, an `openai` auditor that answers at once (httpx's mock
transport: no model, no network) with the default budget (8,160 tokens, counted by
`approx_tokens`; `--tokenizer PATH`: the served model's tokenizer), the service in this process on a temporary SQLite ledger. Each step is ~200
tokens, so from step ~40 on the prompt is the bounded view (older steps summarised).

    python benchmarks/gateway_prompt_cost.py                 # steps 41-60 vs 391-410
    python benchmarks/gateway_prompt_cost.py --steps 410 --window 20

For a window of requests around step 50 and around step 400 of the SAME run it prints the CPU
time per request (the process's, all threads: parsing, ledger, fold, render, reply) and the
rendering's own time (`GatewayService._render`), and their ratio 400/50; then the same for the
uncached path (`render_prompt` without the run's PrefixCache: it renders and counts the whole
run before choosing the view), measured in the same process on a second run. Last line:
`cached_ratio=… uncached_ratio=…` (request CPU at ~400 over ~50; 1.0 = independent of length).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aftraj.prompt import render_prompt  # noqa: E402
from serve.config import ApiKey, AuditorConfig, GatewayConfig, hash_key  # noqa: E402
from serve.service import GatewayService  # noqa: E402
from serve.protocol import RunCreate  # noqa: E402

REPLY = {"choices": [{"message": {"role": "assistant", "content":
                                  '<think>fine</think><answer>{"answer": "SAFE", "agent": null, "reason": null}</answer>'},
                      "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 100, "completion_tokens": 8}}


def _events(run: str, i: int) -> bytes:
    kind = ("message", "tool_call", "tool_result")[i % 3]
    payload = ({"content": f"calling search {i} " + "because the plan says so " * 20, "tool": "search",
                "arguments": {"q": f"x{i}"}} if kind == "tool_call" else
               {"content": f"result {i}: " + "a found document line " * 25, "tool": "search", "result_ids": [f"d{i}"]}
               if kind == "tool_result" else {"content": f"message {i}: " + "thinking about the task " * 25})
    return orjson.dumps({"events": [{"event_id": f"{run}/{i}", "seq": i, "kind": kind, "agent": "abc"[i % 3],
                                     "payload": payload}]})


async def _one_run(svc: GatewayService, run: str, steps: int, windows: list[range]) -> dict:
    svc.create_run("bench", RunCreate(run_id=run, task="find the answer", agents=["a", "b", "c"]))
    render_s = [0.0]
    real = svc._render

    def timed(r, t):
        t0 = time.perf_counter()
        try:
            return real(r, t)
        finally:
            render_s[0] += time.perf_counter() - t0
    svc._render = timed
    out = {}
    try:
        for i in range(1, steps + 1):
            w = next((k for k, win in enumerate(windows) if i == win.start), None)
            if w is not None:
                cpu0, render_s[0] = time.process_time(), 0.0
            v = await svc.ingest("bench", run, _events(run, i))
            assert v["auditor"] == "ok", v
            w = next((k for k, win in enumerate(windows) if i == win.stop - 1), None)
            if w is not None:
                n = len(windows[w])
                out[w] = (1000 * (time.process_time() - cpu0) / n, 1000 * render_s[0] / n,
                          v.get("prompt_tokens"), v["t"])
    finally:
        del svc._render
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=410)
    ap.add_argument("--window", type=int, default=20, help="requests averaged around each point")
    ap.add_argument("--tokenizer", default="approx",
                    help="the auditor's counter: approx (default) or a tokenizer folder (the served model's)")
    args = ap.parse_args()
    lo, hi = 50, args.steps - 10
    windows = [range(lo - args.window // 2 + 1, lo + args.window // 2 + 1),
               range(hi - args.window // 2 + 1, hi + args.window // 2 + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GatewayConfig(ledger_url=f"sqlite:///{Path(tmp) / 'ledger.db'}",
                            api_keys=(ApiKey("bench", hash_key("bench-key")),),
                            auditor=AuditorConfig(backend="openai", base_url="http://auditor.test/v1",
                                                  model="auditor", deadline_s=60.0, tokenizer=args.tokenizer))
        svc = GatewayService(cfg, transport=httpx.MockTransport(lambda req: httpx.Response(200, json=REPLY)))
        rendered: dict = {}

        async def both():
            rendered["cached"] = await _one_run(svc, "cached", args.steps, windows)
            # the uncached path: render_prompt without the run's PrefixCache (the code before it)
            a = svc.cfg.auditor
            svc._render = lambda r, t: render_prompt(svc.trajectory(r), t, a.budget, count_tokens=svc.count_tokens)
            rendered["uncached"] = await _one_run(svc, "uncached", args.steps, windows)   # restores _render
            await svc.aclose()
        asyncio.run(both())
    print(f"one run, {args.steps} steps, 1 event a request, budget {cfg.auditor.budget} (counted by {args.tokenizer}), "
          f"windows of {args.window} requests; cores={os.cpu_count()} load_avg={os.getloadavg()[0]:.2f}")
    ratios = {}
    for name, res in rendered.items():
        (c0, r0, _, t0), (c1, r1, _, t1) = res[0], res[1]
        ratios[name] = c1 / c0
        print(f"{name:8s} step~{t0 + 1 - args.window // 2}: cpu_ms/request={c0:.2f} render_ms={r0:.2f}   "
              f"step~{t1 + 1 - args.window // 2}: cpu_ms/request={c1:.2f} render_ms={r1:.2f}   "
              f"ratio cpu={c1 / c0:.2f} render={r1 / r0:.2f}")
    print(f"cached_ratio={ratios['cached']:.2f} uncached_ratio={ratios['uncached']:.2f}")


if __name__ == "__main__":
    main()
