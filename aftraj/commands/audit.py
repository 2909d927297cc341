"""`aftraj audit --auditor NAME[:ARG] --data PATH [--from FORMAT] --out DIR`: score your own traces,
no gold labels needed ("score my traces", as Phoenix and Langfuse evaluators run on unlabeled
traces).

The auditor's strict online walk (the one walk, eval/walker.py, through `eval.run.audit`) over
every run of PATH: our JSONL or a corpus folder, Who&When, AFTraj parquet, or with `--from` an
agent framework's export (autogen, smolagents, openai-agents, otel, … as `aftraj convert` reads
them; imported runs carry no label, and none is needed here). DIR gets verdicts.jsonl (per run:
ALARM at prefix `alarm_at` blaming `step` and `agent` with the reason, or CONTINUE; and every
prefix's verdict under `prefixes`), audit.json (counts, alarms by agent, provenance), audit.md
(the same for a person: one row per ALARM) and
calls.jsonl (every auditor answer, so `--resume` after a kill asks only for the rest). `--emit
otel,langfuse` also sends every prefix's verdict where you already look. The flags are `aftraj
eval`'s, less those that need labels (protocol, sample, bootstrap, AUC).

    aftraj audit --auditor rules --data runs/my-agent.jsonl --out runs/audit-rules
    aftraj audit --auditor rules --from otel --data traces.json --out runs/audit-otel
    aftraj audit --auditor hf --model builtin:smollm2-135m --data runs/my-agent.jsonl --out runs/audit-hf --all-prefixes
"""

from __future__ import annotations

import sys


def register(sub) -> None:
    from aftraj.adapters import ADAPTERS

    from aftraj.commands.eval import add_walk_args

    p = sub.add_parser("audit", help="score unlabeled runs (your own traces): the auditor's strict online "
                                     "walk, verdicts per run and per prefix, no gold labels needed")
    p.add_argument("--from", dest="data_format", choices=tuple(ADAPTERS), metavar="FORMAT",
                   help=f"read --data as an agent framework's export ({', '.join(ADAPTERS)}; aftraj/adapters); "
                        f"default: our JSONL, a corpus folder, Who&When or AFTraj parquet")
    add_walk_args(p, audit=True)
    p.set_defaults(func=run, _parser=p)


def run(args) -> int:
    from aftraj.commands.eval import walk_config
    from eval.run import EvalFailed, audit

    cfg = walk_config(args, "aftraj audit")
    if cfg is None:
        return 0

    def say(msg: str) -> None:
        print(f"aftraj audit: {msg}", file=sys.stderr)

    try:
        res = audit(cfg, say=say)
    except EvalFailed as e:
        print(f"aftraj audit: {e}", file=sys.stderr)
        return 3
    s = res.summary
    print(f"{s['auditor']}: {s['n_alarm']} of {s['n_runs']} runs ALARM, {s['n_continue']} CONTINUE "
          f"({s['calls']} calls, {s['cached_calls']} from the cache, {s['parse_failures']} parse failures, "
          f"{s['errors']} errors)")
    for v in res.verdicts[:50]:
        if v["verdict"] == "ALARM":
            print(f"  {v['id']}: ALARM at prefix {v['alarm_at']}, blames step {v['step']} "
                  f"(agent {v['agent']}): {v['reason'] or '(no reason)'}")
        else:
            print(f"  {v['id']}: CONTINUE ({v['calls']} prefixes audited)")
    if len(res.verdicts) > 50:
        print(f"  … {len(res.verdicts) - 50} more in {res.out}/verdicts.jsonl")
    if res.emitted:
        print(f"emitted {res.emitted['emitted']} verdicts to {res.emitted['to']} ({res.emitted['failures']} failures)")
    print(f"verdicts: {res.out}/verdicts.jsonl audit.json audit.md")
    if s["calls"] and s["errors"] == s["calls"]:
        print(f"aftraj audit: every one of the {s['calls']} auditor calls failed", file=sys.stderr)
        return 3
    return 0
