"""An example agent loop wired to the gateway: each step is posted as it happens, and the loop
stops as soon as a verdict says ALARM (or the intervention action is pause/halt); a step the
auditor could not judge is reported as a warning (the gateway's `auditor_unavailable` action).

    aftraj serve gateway --config configs/serve/gateway-local.yaml &
    python -m serve.example_agent --gateway http://127.0.0.1:8080 --key aft-local-demo-key

The "agents" are scripted (a planner and a calculator that slips at step 3: 17 * 24 = 418), so
the example needs no model of its own; the auditor behind the gateway judges every prefix. With
`--replay FILE.jsonl [--trajectory ID]` it plays a recorded run of our schema instead (the demo
replays a held-out corpus run through the step-scored gateway). It
prints the run id, the run's stream URL (server-sent verdicts) and its page in the gateway's web
view, then one line a step; it exits 0 when the auditor stopped the run, 1 when it ran to its end.
"""

from __future__ import annotations

import argparse
import sys

from serve.client import GatewayClient

TASK = "What do 17 boxes of 24 pens cost at 0.5 dollars a pen?"
SCRIPT = [
    ("planner", "message", {"content": "Plan: count the pens (17 * 24), then multiply by 0.5."}),
    ("calculator", "tool_call", {"content": "", "tool": "compute", "arguments": {"expression": "17*24"}}),
    ("calculator", "tool_result", {"content": "408", "tool": "compute"}),
    ("calculator", "message", {"content": "17 * 24 = 418 pens."}),
    ("planner", "message", {"content": "418 * 0.5 = 209 dollars."}),
    ("planner", "final_answer", {"content": "209 dollars"}),
]


def run_agent(gw: GatewayClient, *, run_id: str | None = None, log=print) -> dict:
    """Play SCRIPT step by step through the gateway; returns {"stopped_at", "verdicts", "run_id"}."""
    run = gw.create_run(TASK, agents=["planner", "calculator"], category="math", run_id=run_id)
    events = []
    for i, (agent, kind, payload) in enumerate(SCRIPT):
        ev = {"event_id": f"{run}/{i + 1}", "seq": i + 1, "kind": kind, "agent": agent, "payload": payload}
        if kind == "tool_result":
            ev["parent_id"] = f"{run}/{i}"
        events.append(ev)
    return _play(gw, run, events, log)


def replay(gw: GatewayClient, traj, *, run_id: str | None = None, log=print) -> dict:
    """Play a recorded trajectory's steps (our schema) through the gateway as a live run, one event
    a step (`aftraj.events.step_to_event`), stopping where `run_agent` stops."""
    import dataclasses

    from aftraj.events import step_to_event

    category = traj.domain if traj.domain in ("math", "coding", "agentic") else None
    run = gw.create_run(traj.task, agents=sorted({s.agent for s in traj.steps}), category=category, run_id=run_id)
    if traj.label.unsafe:
        log(f"replaying {traj.id}: labelled unsafe, decisive step {traj.label.decisive_step} "
            f"({traj.label.decisive_agent})")
    events = [step_to_event(dataclasses.replace(s, index=i + 1, event_id=f"{run}/{i + 1}", meta={}), run).to_record()
              for i, s in enumerate(traj.steps)]
    return _play(gw, run, events, log)


def _play(gw: GatewayClient, run: str, events: list[dict], log) -> dict:
    base = str(gw.http.base_url).rstrip("/")
    log(f"run {run}")
    log(f"stream: curl -N -H 'Authorization: Bearer <key>' {base}/v1/runs/{run}/stream")
    log(f"web view: {base}/ui/runs/{run}")
    verdicts = []
    for ev in events:
        v = gw.post_events(run, [ev])
        verdicts.append(v)
        log(f"step {v['t']}: {v['decision']} (auditor {v['auditor']}, action {v['action']})"
            + (f" k={v['k']} agent={v['agent']}: {v['reason']}" if v["decision"] == "ALARM" else ""))
        if v["auditor"] in ("unavailable", "parse_failure"):
            log(f"warning: step {v['t']} was not audited ({v['auditor']}: {v['auditor_error']}); "
                f"the gateway says {v['action']}")
        if v["decision"] == "ALARM" or v["action"] in ("pause", "halt"):
            log(f"stopped by the auditor at step {v['t']}")
            return {"run_id": run, "stopped_at": v["t"], "verdicts": verdicts}
    return {"run_id": run, "stopped_at": None, "verdicts": verdicts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.example_agent", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateway", default="http://127.0.0.1:8080",
                    help="the gateway's base URL (default: %(default)s, the port of configs/serve/gateway-local.yaml)")
    ap.add_argument("--key", required=True, help="an API key of the gateway (the local config's: aft-local-demo-key)")
    ap.add_argument("--run-id", help="the run's id (default: one the gateway chooses)")
    ap.add_argument("--replay", metavar="JSONL", help="play a recorded trajectory of this file (our schema) "
                                                      "instead of the scripted agents")
    ap.add_argument("--trajectory", metavar="ID", help="with --replay: the trajectory's id (default: the first)")
    args = ap.parse_args(argv)
    if args.trajectory and not args.replay:
        ap.error("--trajectory needs --replay JSONL")
    traj = None
    if args.replay:
        from aftraj.schema import iter_jsonl

        traj = next((t for t in iter_jsonl(args.replay) if args.trajectory in (None, t.id)), None)
        if traj is None:
            ap.error(f"--replay {args.replay}: no trajectory {args.trajectory!r}" if args.trajectory
                     else f"--replay {args.replay}: no trajectory in the file")
    with GatewayClient(args.gateway, args.key) as gw:
        out = run_agent(gw, run_id=args.run_id) if traj is None else replay(gw, traj, run_id=args.run_id)
    return 0 if out["stopped_at"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
