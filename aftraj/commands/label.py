"""`aftraj label FILE.jsonl (--id ID (--safe | --step K --agent A) [--reason TEXT] | --csv LABELS.csv)
[--out OUT.jsonl]` and `aftraj label FILE.jsonl --to-csv LABELS.csv`

Set gold labels (k*, a*, reason) on runs of a JSONL file by id, from the command line or a CSV,
so runs imported by an adapter become evaluation data (aftraj/labels.py has the rules and the CSV
layout). Without --out the file is rewritten in place (atomically). `--to-csv` writes the file's
labels as that CSV (unlabeled runs with an empty verdict: a template to fill in).

    aftraj convert --from autogen runs/ --out mine.jsonl
    aftraj label mine.jsonl --to-csv labels.csv          # fill in verdict, step, agent, reason
    aftraj label mine.jsonl --csv labels.csv --out mine-labelled.jsonl
    aftraj label mine-labelled.jsonl --id run-7 --step 4 --agent Coder --reason "called the wrong tool"
    aftraj eval --auditor rules --data mine-labelled.jsonl --out runs/eval-mine
"""

from __future__ import annotations

from aftraj.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser("label", help="set gold labels (k*, a*, reason) on runs of a JSONL file, by id or from a CSV")
    p.add_argument("path", help="JSONL file of trajectories (e.g. written by `aftraj convert`)")
    p.add_argument("--id", help="the trajectory to label")
    p.add_argument("--safe", action="store_true", help="label it SAFE")
    p.add_argument("--step", type=int, metavar="K", help="UNSAFE: the decisive step k*")
    p.add_argument("--agent", help="UNSAFE: the responsible agent a* (an agent of the run)")
    p.add_argument("--reason", help="why (optional)")
    p.add_argument("--csv", metavar="LABELS.csv",
                   help="labels to set, one row per run: id,verdict,decisive_step,decisive_agent,reason")
    p.add_argument("--to-csv", metavar="LABELS.csv", help="write the file's labels as that CSV and stop")
    p.add_argument("--out", help="output JSONL (default: rewrite PATH in place)")
    p.set_defaults(func=run)


def run(args) -> int:
    from aftraj.labels import LabelSpec, label_trajectories, read_label_csv, write_label_csv
    from aftraj.readers import load_trajectories
    from aftraj.schema import write_jsonl

    trajs = load_trajectories(args.path, "jsonl")
    if args.to_csv:
        if args.id or args.csv or args.safe or args.step is not None or args.agent or args.reason:
            raise UsageError("--to-csv writes the labels of PATH; it takes no label to set")
        n = write_label_csv(trajs, args.to_csv)
        print(f"wrote the labels of {n} runs to {args.to_csv}")
        return 0
    if args.csv:
        if args.id or args.safe or args.step is not None or args.agent or args.reason:
            raise UsageError("--csv gives every label; --id/--safe/--step/--agent/--reason are for one run")
        specs = read_label_csv(args.csv)
    elif args.id:
        if args.safe == (args.step is not None):
            raise UsageError(f"--id {args.id}: give --safe, or --step K with --agent A")
        if args.step is not None and not args.agent:
            raise UsageError(f"--id {args.id} --step {args.step}: an UNSAFE label needs --agent (the responsible agent)")
        if args.safe and args.agent:
            raise UsageError(f"--id {args.id} --safe: a SAFE label names no agent")
        specs = [LabelSpec(args.id, "SAFE" if args.safe else "UNSAFE", args.step, args.agent, args.reason)]
    else:
        raise UsageError("give --id ID with --safe or --step/--agent, or --csv LABELS.csv (or --to-csv to export)")
    labelled, n = label_trajectories(trajs, specs)
    out = args.out or args.path
    write_jsonl(labelled, out)
    print(f"labelled {n} of {len(trajs)} runs; wrote {out}")
    return 0
