"""`aftraj fold FILE.jsonl [--run ID …] [--json] [--policy YAML] [--category C] [--offset N]`

Fold an event ledger (JSON Lines, one event a line) and print each run's state and the rule
detectors' findings with their evidence: every run of the file, or the runs `--run` names
(several ids after one --run, or --run repeated). FILE may also be a trajectory file or folder
(our JSONL corpus, Who&When, AFTraj parquet): each trajectory is converted to events first.
Bad records are reported (file, line, field) on stderr and never stop the others. To score
runs with any auditor (a model too), without gold labels: `aftraj audit`.

    aftraj fold runs/ledger.jsonl --run r1 r2
    aftraj fold who_and_when --run whoandwhen/Hand-Crafted/30 --json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from aftraj.detectors import default_policy, load_policy
from aftraj.fold import Folder, fold_trajectory
from aftraj.ledger import IngestReport
from aftraj.readers import iter_trajectories
from aftraj.schema import SchemaError
from aftraj.views import observer_view


def register(sub) -> None:
    p = sub.add_parser("fold", help="fold an event ledger: run state and rule findings with evidence")
    p.add_argument("path", help="event JSONL ledger (or a trajectory JSONL / Who&When / AFTraj folder)")
    p.add_argument("--run", nargs="+", action="extend", metavar="ID",
                   help="only these run ids (several after one --run, or --run repeated; default: every "
                        "run in the file)")
    p.add_argument("--json", action="store_true", help="machine-readable output (observer view)")
    p.add_argument("--policy", help="detector policy YAML (default: configs/policies/default.yaml values)")
    p.add_argument("--category", help="task category for the tool contract (default: from event meta "
                                      "'category', or the trajectory's domain)")
    p.add_argument("--offset", type=int, default=0, help="resume an event ledger from this byte offset")
    p.set_defaults(func=run)


def _is_trajectory_source(path: Path) -> bool:
    if path.is_dir():
        return True
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    d = json.loads(raw)
                except ValueError:
                    return False
                return isinstance(d, dict) and "steps" in d
    return False


def run(args) -> int:
    path = Path(args.path)
    if not path.exists():
        raise SchemaError("no such file or folder", field="<path>", source=str(path))
    policy = load_policy(args.policy) if args.policy else default_policy()
    states, report = [], IngestReport(source=str(path))
    wanted = None if args.run is None else list(dict.fromkeys(args.run))
    if _is_trajectory_source(path):
        for traj in iter_trajectories(path):
            if wanted is not None and traj.id not in wanted:
                continue
            tf = fold_trajectory(_with_domain(traj, args.category) if args.category else traj, policy)
            states.append(tf.state)
            report.n_records += len(tf.events)
            report.n_appended += len(tf.events)
    else:
        one = wanted[0] if wanted is not None and len(wanted) == 1 else None   # the fold skips the others
        folder = Folder(policy, category=args.category, run=one)
        report = folder.ingest_file(path, args.offset, first_line=_line_at(path, args.offset))
        states = [s for s in folder.states.values() if wanted is None or s.run_id in wanted]
    if wanted is not None:
        found = {s.run_id for s in states}
        missing = [r for r in wanted if r not in found]
        if missing:
            raise SchemaError(f"no run with id {', '.join(map(repr, missing))}"
                              + (f" ({len(found)} of the {len(wanted)} named were found)" if found else ""),
                              field="run_id", source=str(path))
        order = {r: i for i, r in enumerate(wanted)}
        states.sort(key=lambda s: order[s.run_id])
    for e in report.errors[:50]:
        print(f"rejected: {e}", file=sys.stderr)
    if report.n_rejected > 50:
        print(f"… and {report.n_rejected - 50} more rejected records", file=sys.stderr)
    if report.pending_bytes:
        print(f"not read: an unfinished last line ({report.pending_bytes} bytes, no newline) at line "
              f"{report.next_line}; resume with --offset {report.next_offset} once it is complete",
              file=sys.stderr)
    if args.json:
        print(json.dumps({"ingest": report.to_dict(), "runs": [observer_view(s) for s in states]},
                         ensure_ascii=False, indent=2))
        return 0
    print(f"{path}: {report.n_records} records, {report.n_appended} folded, "
          f"{report.n_duplicates} duplicates ignored, {report.n_rejected} rejected"
          + (f", {report.n_filtered} of other runs skipped" if report.n_filtered else ""))
    if not _is_trajectory_source(path):
        print(f"(resume this ledger with --offset {report.next_offset})")
    for s in states:
        _print_state(s)
    return 0


def _line_at(path: Path, offset: int) -> int:
    """The line number at byte `offset`, so errors after a resume name the file's real lines."""
    size = path.stat().st_size
    if not 0 <= offset <= size:
        raise SchemaError(f"offset {offset} is outside the file (0..{size} bytes)", field="--offset",
                          source=str(path))
    line, left = 1, offset
    with open(path, "rb") as f:
        while left:
            chunk = f.read(min(left, 1 << 20))
            line += chunk.count(b"\n")
            left -= len(chunk)
    return line


def _with_domain(traj, category: str):
    from dataclasses import replace

    return replace(traj, domain=category) if category in ("math", "coding", "agentic", "external") else traj


def _print_state(s) -> None:
    v = observer_view(s, max_tool_calls=0)
    print(f"\n== run {s.run_id}  ({s.n_events} events, category={s.category}, "
          f"policy {s.policy.name} r{s.policy.revision})")
    print(f"   termination: {s.termination or '(open)'}; final answer: "
          f"{'(none)' if not s.final_answer else json.dumps(s.final_answer[:80], ensure_ascii=False)}")
    agents = ", ".join(f"{a} {d['turns']} turns/{d['events']} events/{d['tool_calls']} calls"
                       for a, d in v["agents"].items())
    print(f"   agents: {agents or '(none)'}")
    tc = v["tool_calls"]
    print(f"   tool calls: {tc['total']} {tc['by_tool']}; outcomes {tc['outcomes']}; "
          f"open {len(tc['open'])}; orphan results {tc['orphan_results']}")
    u = v["usage"]
    print(f"   errors: {s.errors} (longest streak {s.max_error_streak}); handoffs: {len(s.handoffs)}; "
          f"tokens {u['input_tokens']} in / {u['output_tokens']} out, cost ${u['cost_usd']}"
          f" ({u['repeated_usage_records']} repeated usage records counted once)")
    n_alarm = sum(f.alarm for f in s.findings)
    print(f"   findings: {len(s.findings) or 'none'}" + (f" ({n_alarm} raise an alarm)" if n_alarm else ""))
    for f in s.findings:
        mark = "ALARM" if f.alarm else "note "
        print(f"   [{mark}] {f.kind} at positions {list(f.steps)} (policy r{f.policy_revision}): {f.reason}")
        print(f"           evidence: {', '.join(f.event_ids)}")
