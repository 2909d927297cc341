"""smolagents agent memory -> our events/steps: `TaskStep` (the task), `PlanningStep` (a
thinking event), `ActionStep` (the model's text, each tool call with its id, the observation as
the result of the call, the step's error), `FinalAnswerStep` (final answer, termination).

    aftraj convert --from smolagents memory.json --out runs.jsonl

The file is `agent.memory.get_full_steps()` (or `RunResult.steps`) written as JSON: a list of
step dicts, or {"agent": NAME, "run_id": ID, "steps": [...]}, or JSON Lines of such objects.
In Python, `from_memory(agent.memory.steps, agent=agent.name)` takes the objects themselves.
Memory does not name its agent: the file's "agent" (else `agent`) names every step.
A call to a managed agent (a tool named after it) is a handoff. A tool error's advice to the model
("Please try again or use another tool") stays in the step's content, not in its error. `AgentMaxStepsError` ends the
run with `step_limit`, "Agent interrupted" with `cancelled`; a final answer with `completed`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from aftraj.adapters.base import AdapterError, RunBuilder, fail, load_json, strip_boilerplate, text_of
from aftraj.events import Event
from aftraj.schema import Trajectory


def _as_dict(step: Any, field: str, origin: str | None) -> dict:
    if isinstance(step, dict):
        return step
    if dataclasses.is_dataclass(step) and hasattr(step, "dict"):
        d = step.dict() if type(step).__name__ != "FinalAnswerStep" else {"output": step.output}
        if type(step).__name__ == "ActionStep" and step.error is not None:
            d["error"] = {"type": type(step.error).__name__, "message": str(step.error)}
        return d
    fail(field, f"is not a smolagents memory step (got {type(step).__name__})", origin)


def _kind(d: dict) -> str | None:
    if "step_number" in d:
        return "action"
    if "plan" in d:
        return "planning"
    if "task" in d:
        return "task"
    if "output" in d and len(d) <= 2:
        return "final"
    if "system_prompt" in d:
        return "system"
    return None


def add_step(rb: RunBuilder, step: Any, agent: str, *, field: str = "steps[0]",
             managed_agents: tuple[str, ...] = ()) -> list[Event]:
    """Append one memory step's events to `rb`; returns the events added (the live hook posts them)."""
    start = len(rb.events)
    d = _as_dict(step, field, rb.origin)
    kind = _kind(d)
    timing = d.get("timing")
    rb.ts = timing.get("start_time") if isinstance(timing, dict) and isinstance(timing.get("start_time"), (int, float)) else None
    if kind is None:
        fail(field, f"is not a smolagents memory step (keys: {', '.join(sorted(d)) or 'none'})", rb.origin)
    if kind == "task":
        rb.task = d.get("task")
    elif kind == "planning":
        rb.thinking(agent, d.get("plan"), field=field, usage=_usage(d.get("token_usage")))
    elif kind == "action":
        _action(rb, d, agent, field, managed_agents)
    elif kind == "final":
        if rb.final_answer is None:
            rb.final(agent, d.get("output"), field=field)
        if rb.termination is None:
            rb.terminate("completed")
    return rb.events[start:]


def _usage(u: Any) -> dict | None:
    if not isinstance(u, dict):
        return None
    out = {"input_tokens": u.get("input_tokens"), "output_tokens": u.get("output_tokens")}
    return {k: v for k, v in out.items() if isinstance(v, int)} or None


def _action(rb: RunBuilder, d: dict, agent: str, field: str, managed: tuple[str, ...]) -> None:
    usage = _usage(d.get("token_usage"))
    text = d.get("model_output")
    if isinstance(text, list):
        text = text_of(text)
    calls = d.get("tool_calls") or []
    if not calls and isinstance(d.get("model_output_message"), dict):
        # a call that failed before it ran is only in the model's message
        calls = d["model_output_message"].get("tool_calls") or []
    if not isinstance(calls, list):
        fail(f"{field}.tool_calls", f"must be a list, got {type(calls).__name__}", rb.origin)
    if text and text.strip():
        rb.message(agent, text, field=f"{field}.model_output", usage=usage)
        usage = None
    last_call = None
    for j, tc in enumerate(calls):
        f = f"{field}.tool_calls[{j}]"
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict):
            fail(f"{f}.function", "is missing (a tool call is {id, type, function: {name, arguments}})", rb.origin)
        name, args, cid = fn.get("name"), fn.get("arguments"), tc.get("id")
        if name == "final_answer":
            answer = args.get("answer", args) if isinstance(args, dict) else args
            rb.final(agent, answer if d.get("action_output") is None else d.get("action_output"),
                     field=f, usage=usage)
        elif name in managed:
            task = args.get("task", args) if isinstance(args, dict) else args
            rb.handoff(agent, name, task, field=f, usage=usage)
        else:
            rb.tool_call(agent, name, args, call_id=cid, field=f, usage=usage)
            last_call = (cid, name)
        usage = None
    err = d.get("error")
    obs = d.get("observations")
    if obs is not None and last_call is not None:
        one = len([c for c in calls if (c.get("function") or {}).get("name") not in ("final_answer", *managed)]) == 1
        rb.tool_result(agent, obs, tool=last_call[1] if one else None, call_id=last_call[0] if one else None,
                       field=f"{field}.observations")
    elif obs is not None and str(obs).strip() and not d.get("is_final_answer"):
        rb.message(agent, obs, field=f"{field}.observations", meta={"smolagents": "observations"})
    if err:
        etype = err.get("type") if isinstance(err, dict) else None
        msg = err.get("message") if isinstance(err, dict) else str(err)
        # the error without smolagents' "Please try again or use another tool" (kept in the content)
        rb.error(agent, strip_boilerplate(f"{etype}: {msg}" if etype else str(msg)), content=str(msg or ""),
                 tool=last_call[1] if last_call else None, call_id=last_call[0] if last_call else None,
                 field=f"{field}.error")
        if etype == "AgentMaxStepsError" or (msg and "max steps" in str(msg).lower()):
            if d.get("action_output") is not None:    # the answer smolagents asks for at the limit
                rb.final(agent, d["action_output"], field=f"{field}.action_output")
            rb.terminate("step_limit")
        elif msg and "interrupted" in str(msg).lower():
            rb.terminate("cancelled")


def from_memory(steps, *, agent: str = "agent", run_id: str = "smolagents-run", task: str | None = None,
                managed_agents=(), origin: str | None = None) -> Trajectory:
    """A trajectory from memory steps (objects or their `.dict()`s)."""
    rb = new_builder(run_id, origin)
    if not isinstance(steps, (list, tuple)):
        fail("steps", f"must be a list of memory steps, got {type(steps).__name__}", origin)
    for i, s in enumerate(steps):
        add_step(rb, s, agent, field=f"steps[{i}]", managed_agents=tuple(managed_agents))
    return rb.trajectory(task if task is not None else rb.task)


def new_builder(run_id: str, origin: str | None = None) -> RunBuilder:
    rb = RunBuilder(run_id, source="smolagents", origin=origin)
    rb.task = None
    return rb


def read(path: str | Path) -> list[Trajectory]:
    doc = load_json(path)
    src = str(path)
    runs = doc if isinstance(doc, list) and doc and isinstance(doc[0], dict) and "steps" in doc[0] else [doc]
    out = []
    for n, run in enumerate(runs):
        if isinstance(run, list):
            run = {"steps": run}
        if not isinstance(run, dict) or not isinstance(run.get("steps"), list):
            fail(f"[{n}].steps" if len(runs) > 1 else "steps",
                 "is missing: expected a list of memory step dicts (agent.memory.get_full_steps())", src)
        try:
            out.append(from_memory(run["steps"], agent=run.get("agent") or "agent",
                                   run_id=run.get("run_id") or f"{Path(src).stem}-{n}", task=run.get("task"),
                                   managed_agents=run.get("managed_agents") or (), origin=src))
        except AdapterError as e:
            raise AdapterError(e.message, field=f"runs[{n}].{e.field}" if len(runs) > 1 else e.field,
                               source=src) from None
    return out
