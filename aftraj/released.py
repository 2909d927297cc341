"""The released AFTraj-2K parquet layout, both ways: the one place that knows its columns, its
files and how its values map onto our schema.

The layout (github.com/ZBox1005/AgentForesight, inference/data.py; the Hub dataset
ZBox008003/AFTraj): `aftraj_safe.parquet`, `aftraj_unsafe.parquet` and `splits_test.json`
({"test_safe": [conv_id…], "test_unsafe": […]}). Columns (`AFTRAJ_COLUMNS`): conv_id, domain
(math, coding, hotpotqa, gaia, toolsafety, expert_team), task, gold_answer, num_turns, turns (list
of {role, thought, action, content}), tools (list of {name, description}), mistake_step (-1 on
safe rows), mistake_agent, mistake_reason, unsafe_source. The Hub's converted shards
(`train-00000-of-00001.parquet`) hold the same columns, so the reader takes any number of
*.parquet files of any name and tells the classes apart by mistake_step, never by file name.

Reading (`iter_aftraj_parquet`, `aftraj_row_to_trajectory`) keeps every value the release holds
(id, domain spelling, thought, action, tools, nulls) in `meta["aftraj"]` and `Step.meta["action"]`,
so writing (`write_aftraj_parquet`, `aftraj_row`) gives the same rows back; a run of ours is
written as the release spells one (`release_action`, `UNSAFE_SOURCE`), with splits.json and
families.json beside the release's files so our reader gets the splits and families back.

    aftraj convert --from aftraj-parquet AFTraj/ --out aftraj.jsonl
    aftraj export --to aftraj-parquet corpus.jsonl --out released/
    from aftraj.released import iter_aftraj_parquet, write_aftraj_parquet
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aftraj.fields import label_int, need_str, skip_or_raise
from aftraj.schema import Label, ReadReport, SchemaError, Step, Trajectory, read_bounded

AFTRAJ_COLUMNS = ("conv_id", "domain", "task", "gold_answer", "num_turns", "turns", "tools",
                  "mistake_step", "mistake_agent", "mistake_reason", "unsafe_source")
AFTRAJ_REQUIRED = ("conv_id", "domain", "task", "turns", "mistake_step")
# The release's unsafe_source -> our label_source; any other value reads as "external" (the raw
# value is kept in the label's provenance, so a run read from the release writes its own back).
LABEL_SOURCE = {"injected": "injected", "injection": "injected", "constructive": "injected",
                "diagnosed": "diagnosed", "diagnostic": "diagnosed", "natural": "diagnosed"}
# Our label_source -> the release's spelling, for a run not read from the release: the sources the
# release knows are spelt as ours; any other (external, …) is written as it is.
UNSAFE_SOURCE = {ours: ours for ours in sorted(set(LABEL_SOURCE.values()))}
SAFE_FILE, UNSAFE_FILE = "aftraj_safe.parquet", "aftraj_unsafe.parquet"
# Our domain for the release's fine-grained one (the release's own macro buckets).
AFTRAJ_DOMAINS = {"math": "math", "coding": "coding", "code": "coding", "agentic": "agentic",
                  "hotpotqa": "agentic", "gaia": "agentic", "toolsafety": "agentic",
                  "expert_team": "agentic"}
_SHARD_SPLIT = re.compile(r"^(train|validation|val|test)[-_.]")


def _py(v: Any) -> Any:
    """numpy/pyarrow scalars and arrays to plain Python (pandas-written files)."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and v != v:  # NaN from pandas' missing values
        return None
    return v


def _aftraj_action(action: str | None) -> tuple[str | None, dict | None]:
    """Actions are JSON-encoded tool-call lists: '[{"name": "compute", "arguments": "…"}]'. The
    raw string is kept on the step; this only reads which tool was called with what."""
    if action is None or not action.strip():
        return None, None
    try:
        calls = json.loads(action)
    except (json.JSONDecodeError, RecursionError):
        return None, None   # free-text actions exist: kept verbatim in meta, no tool inferred
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls or not isinstance(calls[0], dict):
        return None, None
    name, args = calls[0].get("name"), calls[0].get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            args = {"_raw": args}
    if args is not None and not isinstance(args, dict):
        args = {"_value": args}
    return (name if isinstance(name, str) else None), args


def _aftraj_tools(v: Any) -> list[dict] | None:
    if v is None:
        return None
    if isinstance(v, str):   # some exports JSON-encode the list
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise SchemaError("must be a list of {name, description}", field="tools") from None
    if not isinstance(v, list):
        raise SchemaError(f"must be a list of {{name, description}}, got {type(v).__name__}", field="tools")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise SchemaError("must be an object with a string 'name'", field=f"tools[{i}]")
        out.append({"name": t["name"], "description": need_str(t.get("description"),
                                                                f"tools[{i}].description", optional=True)})
    return out


def aftraj_row_to_trajectory(row: dict, *, split: str | None = None,
                             family_id: str | None = None) -> Trajectory:
    """One released AFTraj-2K row. Turn i becomes step i, so mistake_step keeps its meaning;
    the class comes from mistake_step (-1: safe)."""
    row = {k: _py(v) for k, v in row.items()}
    for c in AFTRAJ_REQUIRED:
        if c not in row:
            raise SchemaError("is missing", field=c)
    conv_id = need_str(row["conv_id"], "conv_id")
    if not conv_id.strip():
        raise SchemaError("must be a non-empty string", field="conv_id")
    raw_domain = need_str(row["domain"], "domain")
    domain = AFTRAJ_DOMAINS.get(raw_domain)
    if domain is None:
        raise SchemaError(f"unknown domain {raw_domain!r} (known: {', '.join(AFTRAJ_DOMAINS)})",
                          field="domain")
    task = need_str(row["task"], "task")
    turns = row["turns"]
    if not isinstance(turns, list) or not turns:
        raise SchemaError("must be a non-empty list of {role, thought, action, content}", field="turns")
    steps, nulls = [], []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SchemaError("must be an object {role, thought, action, content}", field=f"turns[{i}]")
        turn = {k: _py(v) for k, v in turn.items()}
        role = need_str(turn.get("role"), f"turns[{i}].role")
        if not role.strip():
            raise SchemaError("must be a non-empty string", field=f"turns[{i}].role")
        thought = need_str(turn.get("thought"), f"turns[{i}].thought", optional=True)
        action = need_str(turn.get("action"), f"turns[{i}].action", optional=True)
        content = need_str(turn.get("content"), f"turns[{i}].content", optional=True)
        if content is None:
            nulls.append(i)   # a turn with only an action: content '' here, null again on export
        tool, args = _aftraj_action(action)
        kind = "tool_result" if role == "environment" else ("tool_call" if tool is not None else "message")
        meta = {} if action is None else {"action": action}
        steps.append(Step(index=i, agent=role, kind=kind, content=content or "", tool=tool,
                          arguments=args, meta=meta, thought=thought))
    num_turns = row.get("num_turns")
    if num_turns is not None and label_int(num_turns, "num_turns") != len(turns):
        raise SchemaError(f"is {num_turns}, but the row has {len(turns)} turns", field="num_turns")
    k = label_int(row["mistake_step"], "mistake_step", minimum=-1)
    agent = need_str(row.get("mistake_agent"), "mistake_agent", optional=True)
    reason = need_str(row.get("mistake_reason"), "mistake_reason", optional=True)
    source = need_str(row.get("unsafe_source"), "unsafe_source", optional=True)
    gold = need_str(row.get("gold_answer"), "gold_answer", optional=True)
    tools = _aftraj_tools(row.get("tools"))
    released = {"domain": raw_domain, "num_turns": num_turns, "tools": tools, "null_content": nulls}
    if k == -1:
        label = Label(verdict="SAFE", label_source="verified_safe")
        # what a safe row carries in the label columns ('' or null), so export writes it back
        released.update(mistake_agent=agent, mistake_reason=reason, unsafe_source=source)
    else:
        if agent is None or not agent.strip():
            raise SchemaError("must name the agent of an unsafe row", field="mistake_agent")
        label = Label(verdict="UNSAFE", label_source=LABEL_SOURCE.get(source or "", "external"),
                      decisive_step=k, decisive_agent=agent, reason=reason,
                      provenance={"unsafe_source": source})
    extra = {c: row[c] for c in row if c not in AFTRAJ_COLUMNS and c not in ("split", "family_id")}
    if extra:
        released["extra_columns"] = extra
    return Trajectory(
        id=conv_id, family_id=family_id or need_str(row.get("family_id"), "family_id", optional=True) or conv_id,
        domain=domain, source="aftraj-2k", task=task, steps=steps,
        outcome="success" if k == -1 else "failure",
        reference_answer=gold, label=label,
        meta={"split": split, "aftraj": released})


def _aftraj_splits(root: Path) -> dict[str, str]:
    """conv_id -> split from `splits.json` (ours: train/val/test) or the release's
    `splits_test.json` ({"test_safe": […], "test_unsafe": […]}, or a plain list): test ids are
    'test', every other row 'train'."""
    out: dict[str, str] = {}
    sj = root / "splits.json"
    if sj.is_file():
        raw = json.loads(read_bounded(sj))
        if not isinstance(raw, dict):
            raise SchemaError("must be an object {split: [conv_id, …]}", field="<file>", source=str(sj))
        for split, ids in raw.items():
            if not isinstance(ids, list):
                raise SchemaError("must be a list of conv_ids", field=split, source=str(sj))
            out.update({str(i): split for i in ids})
        return out
    sp = root / "splits_test.json"
    if sp.is_file():
        raw = json.loads(read_bounded(sp))
        ids = raw if isinstance(raw, list) else [x for v in raw.values() for x in (v if isinstance(v, list) else [v])]
        out.update({str(i): "test" for i in ids})
    return out


def aftraj_parquet_files(root: Path) -> list[Path]:
    """The release's two files when `root` holds them (a built corpus also holds the Hub's
    data/*.parquet in our schema, which is not AFTraj's); else every *.parquet under `root`
    (a file, or a folder searched recursively), in name order."""
    if root.is_file():
        return [root]
    released = [root / n for n in (SAFE_FILE, UNSAFE_FILE) if (root / n).is_file()]
    if released:
        return released
    return sorted(p for p in root.rglob("*.parquet") if p.is_file())


def iter_aftraj_parquet(root: str | Path, *, skip_invalid: bool = False,
                        report: ReadReport | None = None,
                        test_only: bool = False) -> Iterator[Trajectory]:
    """Read the released AFTraj-2K layout: one or many parquet shards of any name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    report = report if report is not None else ReadReport()
    report.source = str(root)
    files = aftraj_parquet_files(root)
    if not files:
        raise SchemaError("no .parquet file here", field="<folder>", source=str(root))
    folder = root if root.is_dir() else root.parent
    split_of = _aftraj_splits(folder)
    seen: dict[str, str] = {}   # conv_id -> where it was first read: duplicates are refused
    families: dict[str, str] = {}
    fj = folder / "families.json"
    if fj.is_file():
        families = {str(k): str(v) for k, v in json.loads(read_bounded(fj)).items()}
    for path in files:
        try:
            pf = pq.ParquetFile(path)
            names = pf.schema_arrow.names
        except (OSError, pa.ArrowException) as e:
            skip_or_raise(SchemaError(f"not a readable parquet file: {e}", field="<file>",
                                       source=str(path)), skip_invalid, report)
            continue
        missing = [c for c in AFTRAJ_REQUIRED if c not in names]
        if missing:
            skip_or_raise(SchemaError("required column is missing", field=missing[0], source=str(path)),
                           skip_invalid, report)
            continue
        shard = _SHARD_SPLIT.match(path.name)
        shard_split = None if shard is None else {"validation": "val"}.get(shard.group(1), shard.group(1))
        rowno = 0
        try:
            batches = pf.iter_batches(batch_size=16)   # rows can be large: few at a time
            for batch in batches:
                for row in batch.to_pylist():
                    rowno += 1
                    cid = row.get("conv_id")
                    split = (row.get("split") or split_of.get(str(cid)) or shard_split
                             or ("train" if split_of else None))
                    if test_only and split != "test":
                        continue
                    try:
                        traj = aftraj_row_to_trajectory(row, split=split,
                                                        family_id=families.get(str(cid)))
                        if traj.id in seen:
                            raise SchemaError(f"duplicate conv_id {traj.id!r} (first in {seen[traj.id]})",
                                              field="conv_id")
                        seen[traj.id] = f"{path.name} row {rowno}"
                    except SchemaError as e:
                        skip_or_raise(e.located(f"{path} (row)", rowno), skip_invalid, report)
                        continue
                    report.n_read += 1
                    yield traj
        except (OSError, pa.ArrowException) as e:
            skip_or_raise(SchemaError(f"unreadable after row {rowno}: {e}", field="<file>",
                                       source=str(path)), skip_invalid, report)


# --------------------------------------------------------------------------- writing

def release_action(step) -> str | None:
    """A step's `action` string in the released layout: the release's own string when the step
    was read from it, else our tool call as the release spells one."""
    if "action" in step.meta:           # read from the release: its string, byte for byte
        return step.meta["action"]
    if step.kind == "tool_call" and step.tool is not None:
        return json.dumps([{"name": step.tool, "arguments": json.dumps(step.arguments or {}, sort_keys=True)}],
                          sort_keys=True)
    if step.kind == "tool_result" and step.tool is not None:
        return json.dumps([{"name": step.tool}])   # which tool answered (the reader keeps it)
    return None


def _turn(step, null_content: bool) -> dict:
    role = "environment" if step.kind == "tool_result" else step.agent
    return {"role": role, "thought": step.thought, "action": release_action(step),
            "content": None if null_content else step.content}


def aftraj_row(t: Trajectory) -> dict:
    """One row in the released column layout (`AFTRAJ_COLUMNS`). A trajectory
    read from the release gives back its row unchanged: id, domain spelling, thought, action,
    tools, num_turns and the label columns of safe rows are kept in `meta['aftraj']`."""
    lb, rel = t.label, t.meta.get("aftraj") or {}
    nulls = set(rel.get("null_content") or ())
    if "tools" in rel:
        tools = rel["tools"]
    else:
        tools = [{"name": n, "description": None} for n in sorted({s.tool for s in t.steps if s.tool})]
    if lb.unsafe:
        source = lb.provenance.get("unsafe_source", UNSAFE_SOURCE.get(lb.label_source, lb.label_source))
        tail = (lb.decisive_step, lb.decisive_agent, lb.reason, source)
    else:
        tail = (-1, rel.get("mistake_agent"), rel.get("mistake_reason"), rel.get("unsafe_source"))
    return {
        "conv_id": t.id, "domain": rel.get("domain", t.domain), "task": t.task,
        "gold_answer": t.reference_answer,
        "num_turns": rel["num_turns"] if "num_turns" in rel else len(t.steps),
        "turns": [_turn(s, s.index in nulls) for s in t.steps], "tools": tools,
        "mistake_step": tail[0], "mistake_agent": tail[1], "mistake_reason": tail[2],
        "unsafe_source": tail[3],
    }


def aftraj_schema():
    """The released parquet schema (column order of `AFTRAJ_COLUMNS`)."""
    import pyarrow as pa

    turn = pa.struct([("role", pa.string()), ("thought", pa.string()), ("action", pa.string()),
                      ("content", pa.string())])
    tool = pa.struct([("name", pa.string()), ("description", pa.string())])
    return pa.schema([("conv_id", pa.string()), ("domain", pa.string()), ("task", pa.string()),
                      ("gold_answer", pa.string()), ("num_turns", pa.int64()),
                      ("turns", pa.list_(turn)), ("tools", pa.list_(tool)),
                      ("mistake_step", pa.int64()), ("mistake_agent", pa.string()),
                      ("mistake_reason", pa.string()), ("unsafe_source", pa.string())])


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_aftraj_parquet(trajs: list[Trajectory], split_of: dict[str, str] | None, out: Path) -> dict[str, int]:
    """The released layout in `out`: aftraj_safe.parquet, aftraj_unsafe.parquet and
    splits_test.json ({"test_safe": […], "test_unsafe": […]}), which the release's own loader
    reads; plus splits.json (every split by conv_id) and, where a family is not its id,
    families.json, so our reader gets the train/val/test families back. `split_of` maps
    family_id -> split (a corpus build); None takes each trajectory's meta['split'].
    Returns {file: rows}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    schema, counts = aftraj_schema(), {}
    for name, unsafe in ((SAFE_FILE, False), (UNSAFE_FILE, True)):
        rows = [aftraj_row(t) for t in trajs if t.label.unsafe == unsafe]
        table = pa.Table.from_pylist(rows, schema=schema)
        _write_atomic(out / name, lambda p, table=table: pq.write_table(
            table, p, compression="zstd", write_statistics=False))
        counts[name] = len(rows)
    split = {t.id: (split_of[t.family_id] if split_of is not None else t.meta.get("split")) for t in trajs}
    if any(v is not None for v in split.values()):
        test = {"test_safe": [t.id for t in trajs if split[t.id] == "test" and not t.label.unsafe],
                "test_unsafe": [t.id for t in trajs if split[t.id] == "test" and t.label.unsafe]}
        by_split: dict[str, list[str]] = {}
        for t in trajs:
            if split[t.id] is not None:
                by_split.setdefault(split[t.id], []).append(t.id)
        for name, obj in (("splits_test.json", test), ("splits.json", by_split)):
            _write_atomic(out / name, lambda p, obj=obj: p.write_text(json.dumps(obj, indent=1) + "\n"))
    families = {t.id: t.family_id for t in trajs if t.family_id != t.id}
    if families:
        _write_atomic(out / "families.json",
                      lambda p: p.write_text(json.dumps(families, indent=1, sort_keys=True) + "\n"))
    else:
        (out / "families.json").unlink(missing_ok=True)
    return counts
