"""`aftraj inspect FILE.jsonl [--id ID] [--prompt T] [--budget N] [--layout ours|reference] [--json]`

A readable trajectory, or with `--prompt T` the exact messages the auditor gets for prefix T."""

from __future__ import annotations

import json
import textwrap

from aftraj.prompt import render_prompt
from aftraj.readers import iter_trajectories
from aftraj.schema import SchemaError


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show a trajectory, or the auditor prompt for one prefix")
    p.add_argument("path", help="JSONL file (or a Who&When / AFTraj parquet folder)")
    p.add_argument("--id", help="trajectory id (default: the first)")
    p.add_argument("--prompt", type=int, metavar="T", help="print the messages for prefix T")
    p.add_argument("--budget", type=int, help="token budget for --prompt (bounded view when over)")
    p.add_argument("--reference-answer", action="store_true", help="show the ground truth in the prompt")
    p.add_argument("--layout", choices=("ours", "reference"), default="ours",
                   help="prompt layout for --prompt: ours (default) or the released evaluation's")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args) -> int:
    traj = None
    for t in iter_trajectories(args.path):
        if args.id is None or t.id == args.id:
            traj = t
            break
    if traj is None:
        raise SchemaError(f"no trajectory with id {args.id!r}", field="id", source=args.path)
    if args.prompt is not None:
        r = render_prompt(traj, args.prompt, args.budget, reference_answer=args.reference_answer,
                          layout=args.layout)
        if args.json:
            print(json.dumps({"id": traj.id, "t": args.prompt, "messages": r.messages,
                              "coverage": r.coverage}, ensure_ascii=False, indent=2))
        else:
            for m in r.messages:
                print(f"===== {m['role']} =====\n{m['content']}\n")
        return 0
    if args.json:
        print(json.dumps(traj.to_dict(), ensure_ascii=False, indent=2))
        return 0
    from aftraj.labels import label_text

    lb = traj.label
    print(f"{traj.id}  [{traj.domain} / {traj.source}]  {len(traj.steps)} steps, "
          f"outcome={traj.outcome}, termination={traj.termination}")
    print(f"label: {label_text(traj)}")
    if lb.reason:
        print(f"reason: {lb.reason}")
    print(f"task: {textwrap.shorten(traj.task, 300)}\n")
    for s in traj.steps:
        mark = ">>" if lb.unsafe and s.index == lb.decisive_step else "  "
        tool = f" {s.tool}({json.dumps(s.arguments, ensure_ascii=False)})" if s.tool else ""
        print(f"{mark}[{s.index}] {s.agent} <{s.kind}>{tool}")
        print(textwrap.indent(textwrap.shorten(s.content, 400) or "(empty)", "      "))
    return 0
