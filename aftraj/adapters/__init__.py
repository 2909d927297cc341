"""Framework adapters: agent runs in AutoGen/AG2, smolagents, OpenAI Agents SDK, OpenTelemetry
GenAI, OpenInference (Phoenix) or Langfuse shapes -> our events and trajectories (one module per
source), plus live hooks that post each step to the gateway and stop the run on ALARM
(aftraj/adapters/hooks.py), and verdicts the other way, as OTel spans and Langfuse scores
(aftraj/adapters/emit.py).

    aftraj convert --from {autogen,smolagents,openai-agents,otel,openinference,langfuse} SRC --out DST.jsonl
    from aftraj.adapters import read_runs; trajs = read_runs("trace.jsonl", "openai-agents")

Each adapter module exposes `read(path) -> list[Trajectory]`; ADAPTERS names them. The framework
packages are needed only by the live hooks and the tests (the `adapters` extra), never to read a file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from aftraj.adapters import autogen, langfuse, openai_agents, openinference, otel, smolagents
from aftraj.adapters.base import AdapterError
from aftraj.schema import Trajectory

ADAPTERS: dict[str, Callable[[str | Path], list[Trajectory]]] = {
    "autogen": autogen.read,
    "smolagents": smolagents.read,
    "openai-agents": openai_agents.read,
    "otel": otel.read,
    "openinference": openinference.read,
    "langfuse": langfuse.read,
}


def read_runs(path: str | Path, source: str) -> list[Trajectory]:
    """The runs in `path`, read by the `source` adapter; AdapterError names file and field."""
    if source not in ADAPTERS:
        raise AdapterError(f"unknown source {source!r} (known: {', '.join(ADAPTERS)})", field="--from",
                           source=str(path))
    return ADAPTERS[source](path)


__all__ = ["ADAPTERS", "AdapterError", "read_runs"]
