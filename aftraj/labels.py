"""Set gold labels on runs of a JSONL file by id, so a user's own runs (imported by an adapter:
`aftraj convert`, the gateway's export) become evaluation data. `aftraj label` is the command.

A label is SAFE, or UNSAFE at decisive step k* blaming agent a* (an agent of the run), with an
optional reason. It replaces the adapter's placeholder (`aftraj.adapters.base.UNLABELED`, shown as
"unlabeled" by `inspect` and `summary`) with `label_source: external` and a provenance saying
who set it (`{"labelled_by": "aftraj label", "from": "command line" | "FILE.csv:LINE"}`);
`meta.unlabeled` is dropped. Every label is validated by the schema (k* inside the run, a* among
its agents); an error names the CSV file, line and field, or the id.

CSV (header required; `aftraj label FILE --to-csv` writes this layout, so it round-trips; a row
with an empty verdict is skipped, so that file is a template to fill in):

    id,verdict,decisive_step,decisive_agent,reason
    run-1,UNSAFE,3,Coder,wrong argument to the search tool
    run-2,SAFE,,,

    aftraj label runs.jsonl --id run-1 --step 3 --agent Coder --reason "wrong argument" --out labelled.jsonl
    aftraj label runs.jsonl --csv labels.csv --out labelled.jsonl
    aftraj label labelled.jsonl --to-csv labels.csv
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from pathlib import Path

from aftraj.errors import UsageError
from aftraj.schema import Label, SchemaError, Trajectory

CSV_COLUMNS = ("id", "verdict", "decisive_step", "decisive_agent", "reason")


@dataclass(frozen=True)
class LabelSpec:
    """One requested label, and where it came from (for error messages and provenance)."""

    id: str
    verdict: str                 # "SAFE" | "UNSAFE"
    step: int | None = None
    agent: str | None = None
    reason: str | None = None
    origin: str = "command line"


def apply_label(traj: Trajectory, spec: LabelSpec) -> Trajectory:
    """`traj` with the label of `spec` (validated against the run's steps and agents)."""
    prov = {"labelled_by": "aftraj label", "from": spec.origin}
    try:
        if spec.verdict == "SAFE":
            if spec.step is not None or spec.agent:
                raise SchemaError("a SAFE label has no decisive step or agent", field="label.decisive_step")
            label = Label("SAFE", "external", reason=spec.reason or None, provenance=prov)
        elif spec.verdict == "UNSAFE":
            label = Label("UNSAFE", "external", decisive_step=spec.step, decisive_agent=spec.agent,
                          reason=spec.reason or None, provenance=prov)
        else:
            raise SchemaError(f"must be SAFE or UNSAFE, got {spec.verdict!r}", field="label.verdict")
        meta = {k: v for k, v in traj.meta.items() if k != "unlabeled"}
        return replace(traj, label=label, meta=meta)
    except SchemaError as e:
        raise UsageError(f"{spec.origin}: trajectory {spec.id!r}: field {e.field!r}: {e.message}") from None


def read_label_csv(path: str | Path) -> list[LabelSpec]:
    path = Path(path)
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None or [h.strip() for h in header][:2] != ["id", "verdict"]:
            raise UsageError(f"{path}:1: the header must start with id,verdict (columns: {','.join(CSV_COLUMNS)})")
        header = [h.strip() for h in header]
        unknown = set(header) - set(CSV_COLUMNS)
        if unknown:
            raise UsageError(f"{path}:1: unknown column(s) {sorted(unknown)} (columns: {','.join(CSV_COLUMNS)})")
        specs, seen = [], {}
        for row in rows:
            line = rows.line_num
            if not any(c.strip() for c in row):
                continue
            if len(row) > len(header):
                raise UsageError(f"{path}:{line}: {len(row)} fields, the header has {len(header)}")
            d = dict(zip(header, [c.strip() for c in row] + [""] * (len(header) - len(row)), strict=True))
            where = f"{path}:{line}"
            if not d["id"]:
                raise UsageError(f"{where}: field 'id' is empty")
            if d["id"] in seen:
                raise UsageError(f"{where}: id {d['id']!r} is labelled twice (also on line {seen[d['id']]})")
            seen[d["id"]] = line
            verdict = d["verdict"].upper()
            if not verdict:      # a row of `--to-csv`'s template not filled in yet: left as it is
                continue
            step = None
            if d.get("decisive_step"):
                try:
                    step = int(d["decisive_step"])
                except ValueError:
                    raise UsageError(f"{where}: field 'decisive_step': not an integer: {d['decisive_step']!r}") from None
            specs.append(LabelSpec(d["id"], verdict, step, d.get("decisive_agent") or None,
                                   d.get("reason") or None, origin=where))
    return specs


def label_trajectories(trajs: list[Trajectory], specs: list[LabelSpec]) -> tuple[list[Trajectory], int]:
    """Apply `specs` by id; returns (all trajectories, in order, and how many were labelled).
    An id that is not in `trajs`, or that `trajs` holds twice, is an error."""
    index: dict[str, int] = {}
    dups = set()
    for i, t in enumerate(trajs):
        if t.id in index:
            dups.add(t.id)
        index[t.id] = i
    out = list(trajs)
    for s in specs:
        if s.id not in index:
            raise UsageError(f"{s.origin}: no trajectory with id {s.id!r} in the file")
        if s.id in dups:
            raise UsageError(f"{s.origin}: id {s.id!r} appears more than once in the file; labels go by id")
        out[index[s.id]] = apply_label(out[index[s.id]], s)
    return out, len(specs)


def write_label_csv(trajs: list[Trajectory], path: str | Path) -> int:
    """The labels of `trajs` in the CSV layout `read_label_csv` reads (unlabeled runs: verdict empty)."""
    from aftraj.boundary import is_unlabeled

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for t in trajs:
            lb = t.label
            w.writerow([t.id, "" if is_unlabeled(t) else lb.verdict,
                        "" if lb.decisive_step is None else lb.decisive_step, lb.decisive_agent or "",
                        lb.reason or ""])
    return len(trajs)


def label_text(traj: Trajectory) -> str:
    """How `inspect` and `summary` name a run's label: "unlabeled" for an adapter's placeholder."""
    from aftraj.boundary import is_unlabeled

    lb = traj.label
    if is_unlabeled(traj):
        return "unlabeled (imported from an agent framework; set one with `aftraj label`)"
    if lb.unsafe:
        return f"UNSAFE at step {lb.decisive_step} by {lb.decisive_agent} ({lb.label_source})"
    return f"SAFE ({lb.label_source})"
