"""How long a deep trace takes to convert, for each span reader (issue 45 item 8): a chain of
`--depth` nested spans (each span the child of the one before, every one a model call with one
output message: as many steps as spans) in the three span formats, written to a temporary file
and read with `aftraj.adapters.<format>.read`. The target: a 30k-deep trace in <= 5 s.

    python benchmarks/reader_depth.py                    # depth 30,000, every format
    python benchmarks/reader_depth.py --depth 10000 --formats otel

Last lines: `format=… depth=… spans=… steps=… read_s=… cpu_s=…` per format (wall and CPU: on a
shared machine the wall time includes the neighbours' share).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def _kv(k, v):
    return {"key": k, "value": {"stringValue": v} if isinstance(v, str) else {"intValue": v}}


def otlp(spans: list[dict]) -> dict:
    return {"resourceSpans": [{"resource": {}, "scopeSpans": [{"scope": {"name": "bench"}, "spans": spans}]}]}


def _sid(i: int) -> str:
    return f"{i + 1:016x}"


def otel_chain(n: int) -> dict:
    tid = "ab" * 16
    spans = [{"traceId": tid, "spanId": _sid(0), "name": "invoke_agent planner", "startTimeUnixNano": "1",
              "attributes": [_kv("gen_ai.operation.name", "invoke_agent"), _kv("gen_ai.agent.name", "planner")]}]
    for i in range(1, n):
        out = json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": f"thought {i}"}]}])
        spans.append({"traceId": tid, "spanId": _sid(i), "parentSpanId": _sid(i - 1), "name": "chat",
                      "startTimeUnixNano": str(1 + i),
                      "attributes": [_kv("gen_ai.operation.name", "chat"), _kv("gen_ai.output.messages", out)]})
    return otlp(spans)


def openinference_chain(n: int) -> dict:
    tid = "cd" * 16
    spans = [{"traceId": tid, "spanId": _sid(0), "name": "planner.run", "startTimeUnixNano": "1",
              "attributes": [_kv("openinference.span.kind", "AGENT"), _kv("input.value", "plan a trip")]}]
    for i in range(1, n):
        spans.append({"traceId": tid, "spanId": _sid(i), "parentSpanId": _sid(i - 1), "name": "llm",
                      "startTimeUnixNano": str(1 + i),
                      "attributes": [_kv("openinference.span.kind", "LLM"),
                                     _kv("llm.output_messages.0.message.role", "assistant"),
                                     _kv("llm.output_messages.0.message.content", f"thought {i}")]})
    return otlp(spans)


def langfuse_chain(n: int) -> dict:
    obs = [{"id": _sid(0), "type": "AGENT", "name": "planner", "startTime": "2026-01-01T00:00:00.000000Z"}]
    for i in range(1, n):
        obs.append({"id": _sid(i), "type": "GENERATION", "name": "llm", "parentObservationId": _sid(i - 1),
                    "startTime": f"2026-01-01T00:00:00.{i:06d}Z", "output": f"thought {i}"})
    return {"id": "ef" * 16, "name": "bench", "input": "plan a trip", "observations": obs}


MAKERS = {"otel": otel_chain, "openinference": openinference_chain, "langfuse": langfuse_chain}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, default=30_000)
    ap.add_argument("--formats", default="otel,openinference,langfuse")
    args = ap.parse_args()
    import importlib
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            p = Path(tmp) / f"{fmt}.json"
            p.write_text(json.dumps(MAKERS[fmt](args.depth)))
            reader = importlib.import_module(f"aftraj.adapters.{fmt}")
            t0, c0 = time.perf_counter(), time.process_time()
            (traj,) = reader.read(p)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            print(f"format={fmt} depth={args.depth} spans={args.depth} steps={len(traj.steps)} "
                  f"file_mb={p.stat().st_size / 2**20:.1f} read_s={dt:.2f} cpu_s={cpu:.2f} load1={os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
