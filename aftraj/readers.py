"""Readers that map external layouts onto the one schema: Who&When, the released AFTraj-2K
parquet files, and our own JSON Lines (`aftraj.schema.iter_jsonl`).

    aftraj convert --from whoandwhen who_and_when --out ww.jsonl     # the built-in copy
    from aftraj.readers import load_trajectories
    trajs = load_trajectories("who_and_when")      # built-in name, or any path; format detected

Built-in data sets (`BUILTIN_DATA`) ship inside the repository and the package
(`eval/data/`), so a fresh clone needs nothing beside itself: a path that does not exist but
names one of them resolves to it (`resolve_data_path`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aftraj.schema import Label, ReadReport, SchemaError, Step, Trajectory, iter_jsonl, read_bounded

FORMATS = ("whoandwhen", "aftraj-parquet", "jsonl")
WHO_AND_WHEN_SUBSETS = ("Algorithm-Generated", "Hand-Crafted")

# Data sets shipped with the package (evaluation only: see eval/data/who_and_when/README.md).
DATA_DIR = Path(__file__).resolve().parents[1] / "eval" / "data"
WHO_AND_WHEN_DIR = DATA_DIR / "who_and_when"
BUILTIN_DATA = {"who_and_when": WHO_AND_WHEN_DIR, "whoandwhen": WHO_AND_WHEN_DIR}


def resolve_data_path(path: str | Path) -> Path:
    """`path` as given when it exists; else a built-in data set's folder when `path` is one of
    its names (`who_and_when`); else `path` unchanged (the reader then names what is missing)."""
    p = Path(path)
    if not p.exists() and str(path) in BUILTIN_DATA:
        return BUILTIN_DATA[str(path)]
    return p

# --------------------------------------------------------------------------- Who&When

_ROLE_SUFFIX = re.compile(r"\s*\((?:thought|termination condition|->\s*[^)]*)\)\s*$")


def normalise_agent(raw: str) -> str:
    """'Orchestrator (thought)' / 'Orchestrator (-> WebSurfer)' -> 'Orchestrator'."""
    return _ROLE_SUFFIX.sub("", raw).strip()


def _numeric_key(p: Path) -> tuple:
    return (int(p.stem), "") if p.stem.isdigit() else (1 << 30, p.stem)


def _match_agent(raw: str, agents: list[str], path: str) -> str:
    """Map an annotated agent onto the trajectory's spelling ('Websurfer' -> 'WebSurfer')."""
    name = normalise_agent(raw)
    if name in agents:
        return name
    folded = [a for a in agents if a.casefold() == name.casefold()]
    if len(folded) == 1:
        return folded[0]
    raise SchemaError(f"{raw!r} matches no agent of the trajectory ({', '.join(agents)})",
                      field="mistake_agent", source=path)


def label_int(v: Any, field: str, *, minimum: int = 0) -> int:
    """A step label as an integer, never a guess: an int, or a string of decimal digits (Who&When
    writes "3"); `True`, `1.7`, `"1_0"` (which `int()` reads as 10), `" 3"` are errors."""
    if isinstance(v, bool) or v is None:
        raise SchemaError(f"must be an integer step index, got {v!r}", field=field)
    if isinstance(v, int):
        k = v
    elif isinstance(v, str) and re.fullmatch(r"-?[0-9]{1,9}", v):
        k = int(v)
    else:
        raise SchemaError(f"must be an integer step index, got {v!r}", field=field)
    if k < minimum:
        raise SchemaError(f"must be >= {minimum}, got {k}", field=field)
    return k


def _need_str(v: Any, field: str, *, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise SchemaError(f"must be a string, got {'null' if v is None else type(v).__name__}",
                          field=field)
    return v


def read_who_and_when_file(path: Path, subset: str) -> Trajectory:
    src = str(path)
    try:
        raw = json.loads(read_bounded(path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SchemaError(f"not a JSON file: {e}", source=src, line=1) from None
    except SchemaError as e:
        raise e.located(src, None) from None
    try:
        if not isinstance(raw, dict):
            raise SchemaError(f"must be a JSON object, got {type(raw).__name__}", field="<record>")
        for key in ("history", "question", "mistake_step", "mistake_agent"):
            if key not in raw:
                raise SchemaError("is missing", field=key)
        if not isinstance(raw["history"], list):
            raise SchemaError(f"must be a list, got {type(raw['history']).__name__}", field="history")
        question = _need_str(raw["question"], "question")
        steps = []
        for i, h in enumerate(raw["history"]):
            if not isinstance(h, dict) or "content" not in h:
                raise SchemaError("must be an object with 'content'", field=f"history[{i}]")
            content = _need_str(h["content"], f"history[{i}].content")
            role = _need_str(h.get("role"), f"history[{i}].role",
                             optional=subset != "Hand-Crafted" and "name" in h)
            if subset == "Hand-Crafted":
                agent = normalise_agent(role)
            else:
                agent = _need_str(h["name"], f"history[{i}].name") if "name" in h else role
            if not agent.strip():
                raise SchemaError("has no agent name", field=f"history[{i}]")
            steps.append(Step(index=i, agent=agent.strip(), kind="message", content=content,
                              meta={"raw_role": role}))
        ms = raw["mistake_step"]
        k = label_int(ms, "mistake_step")
        agents = list(dict.fromkeys(s.agent for s in steps))
        agent = _match_agent(_need_str(raw["mistake_agent"], "mistake_agent"), agents, src)
        gt = _need_str(raw.get("ground_truth"), "ground_truth", optional=True)
        reason = _need_str(raw.get("mistake_reason"), "mistake_reason", optional=True)
        extra = {k2: raw[k2] for k2 in ("level", "is_correct", "is_corrected", "mistake_type", "labels")
                 if k2 in raw}
        qid = raw.get("question_ID")
        qid = f"{subset}/{path.stem}" if qid is None else _need_str(qid, "question_ID")
        return Trajectory(
            id=f"whoandwhen/{subset}/{path.stem}", family_id=f"whoandwhen/{qid}", domain="external",
            source=f"who_and_when/{subset}", task=question, steps=steps,
            final_answer=None, termination="completed", outcome="failure",
            reference_answer=gt,
            label=Label(verdict="UNSAFE", label_source="external", decisive_step=k,
                        decisive_agent=agent, reason=reason,
                        provenance={"mistake_agent_raw": raw["mistake_agent"],
                                    "mistake_step_raw": ms}),
            meta={"subset": subset, "file": path.name, "question_id": qid,
                  "question": question, "ground_truth": gt, **extra},
        )
    except SchemaError as e:
        raise e.located(src, 1) from None


def _skip_or_raise(err: SchemaError, skip_invalid: bool, report: ReadReport) -> None:
    if not skip_invalid:
        raise err
    report.n_skipped += 1
    report.errors.append(err)


def iter_who_and_when(root: str | Path, *, subsets: tuple[str, ...] = WHO_AND_WHEN_SUBSETS,
                      skip_invalid: bool = False, report: ReadReport | None = None) -> Iterator[Trajectory]:
    root = resolve_data_path(root)
    report = report if report is not None else ReadReport()
    report.source = str(root)
    found = False
    for subset in subsets:
        folder = root / subset
        if not folder.is_dir():
            continue
        found = True
        for f in sorted(folder.glob("*.json"), key=_numeric_key):
            try:
                traj = read_who_and_when_file(f, subset)
            except SchemaError as e:   # every bad file is a SchemaError: skip it, keep the rest
                _skip_or_raise(e, skip_invalid, report)
                continue
            report.n_read += 1
            yield traj
    if not found:
        raise SchemaError(f"no Who&When subset folder ({', '.join(subsets)}) under {root}",
                          field="<folder>", source=str(root))


# --------------------------------------------------------------------------- AFTraj-2K parquet
#
# The released layout (github.com/ZBox1005/AgentForesight, inference/data.py; the Hub dataset
# ZBox008003/AFTraj): `aftraj_safe.parquet`, `aftraj_unsafe.parquet` and `splits_test.json`
# ({"test_safe": [conv_id…], "test_unsafe": […]}). Columns: conv_id, domain (math, coding,
# hotpotqa, gaia, toolsafety, expert_team), task, gold_answer, num_turns, turns (list of
# {role, thought, action, content}), tools (list of {name, description}), mistake_step (-1 on
# safe rows), mistake_agent, mistake_reason, unsafe_source. The Hub's converted shards
# (`train-00000-of-00001.parquet`) hold the same columns, so this reader takes any number of
# *.parquet files of any name and tells the classes apart by mistake_step, never by file name.
# Every value the release holds is kept (id, domain spelling, thought, action, tools, nulls),
# so `aftraj.corpus.export.write_aftraj_parquet` writes the same rows back.

AFTRAJ_COLUMNS = ("conv_id", "domain", "task", "gold_answer", "num_turns", "turns", "tools",
                  "mistake_step", "mistake_agent", "mistake_reason", "unsafe_source")
AFTRAJ_REQUIRED = ("conv_id", "domain", "task", "turns", "mistake_step")
# Our label_source for the release's unsafe_source; the raw value is kept in the provenance.
_UNSAFE_SOURCE = {"injected": "injected", "injection": "injected", "constructive": "injected",
                  "diagnosed": "diagnosed", "diagnostic": "diagnosed", "natural": "diagnosed"}
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
        out.append({"name": t["name"], "description": _need_str(t.get("description"),
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
    conv_id = _need_str(row["conv_id"], "conv_id")
    if not conv_id.strip():
        raise SchemaError("must be a non-empty string", field="conv_id")
    raw_domain = _need_str(row["domain"], "domain")
    domain = AFTRAJ_DOMAINS.get(raw_domain)
    if domain is None:
        raise SchemaError(f"unknown domain {raw_domain!r} (known: {', '.join(AFTRAJ_DOMAINS)})",
                          field="domain")
    task = _need_str(row["task"], "task")
    turns = row["turns"]
    if not isinstance(turns, list) or not turns:
        raise SchemaError("must be a non-empty list of {role, thought, action, content}", field="turns")
    steps, nulls = [], []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SchemaError("must be an object {role, thought, action, content}", field=f"turns[{i}]")
        turn = {k: _py(v) for k, v in turn.items()}
        role = _need_str(turn.get("role"), f"turns[{i}].role")
        if not role.strip():
            raise SchemaError("must be a non-empty string", field=f"turns[{i}].role")
        thought = _need_str(turn.get("thought"), f"turns[{i}].thought", optional=True)
        action = _need_str(turn.get("action"), f"turns[{i}].action", optional=True)
        content = _need_str(turn.get("content"), f"turns[{i}].content", optional=True)
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
    agent = _need_str(row.get("mistake_agent"), "mistake_agent", optional=True)
    reason = _need_str(row.get("mistake_reason"), "mistake_reason", optional=True)
    source = _need_str(row.get("unsafe_source"), "unsafe_source", optional=True)
    gold = _need_str(row.get("gold_answer"), "gold_answer", optional=True)
    tools = _aftraj_tools(row.get("tools"))
    released = {"domain": raw_domain, "num_turns": num_turns, "tools": tools, "null_content": nulls}
    if k == -1:
        label = Label(verdict="SAFE", label_source="verified_safe")
        # what a safe row carries in the label columns ('' or null), so export writes it back
        released.update(mistake_agent=agent, mistake_reason=reason, unsafe_source=source)
    else:
        if agent is None or not agent.strip():
            raise SchemaError("must name the agent of an unsafe row", field="mistake_agent")
        label = Label(verdict="UNSAFE", label_source=_UNSAFE_SOURCE.get(source or "", "external"),
                      decisive_step=k, decisive_agent=agent, reason=reason,
                      provenance={"unsafe_source": source})
    extra = {c: row[c] for c in row if c not in AFTRAJ_COLUMNS and c not in ("split", "family_id")}
    if extra:
        released["extra_columns"] = extra
    return Trajectory(
        id=conv_id, family_id=family_id or _need_str(row.get("family_id"), "family_id", optional=True) or conv_id,
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
    released = [root / n for n in ("aftraj_safe.parquet", "aftraj_unsafe.parquet") if (root / n).is_file()]
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
            _skip_or_raise(SchemaError(f"not a readable parquet file: {e}", field="<file>",
                                       source=str(path)), skip_invalid, report)
            continue
        missing = [c for c in AFTRAJ_REQUIRED if c not in names]
        if missing:
            _skip_or_raise(SchemaError("required column is missing", field=missing[0], source=str(path)),
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
                        _skip_or_raise(e.located(f"{path} (row)", rowno), skip_invalid, report)
                        continue
                    report.n_read += 1
                    yield traj
        except (OSError, pa.ArrowException) as e:
            _skip_or_raise(SchemaError(f"unreadable after row {rowno}: {e}", field="<file>",
                                       source=str(path)), skip_invalid, report)


# --------------------------------------------------------------------------- any of them

def detect_format(path: str | Path) -> str:
    p = resolve_data_path(path)
    if p.is_dir():
        if any((p / s).is_dir() for s in WHO_AND_WHEN_SUBSETS):
            return "whoandwhen"
        if (p / "corpus.jsonl").exists():  # a built corpus holds both: its lossless JSONL wins
            return "jsonl"
        if aftraj_parquet_files(p):   # the release's two files, or Hub shards of any name
            return "aftraj-parquet"
        raise SchemaError("cannot tell the format of this folder (Who&When subsets, AFTraj "
                          "parquet files or corpus.jsonl expected)", field="<folder>", source=str(p))
    if p.suffix == ".parquet":
        return "aftraj-parquet"
    return "jsonl"


def iter_trajectories(path: str | Path, fmt: str = "auto", *, skip_invalid: bool = False,
                      report: ReadReport | None = None) -> Iterator[Trajectory]:
    path = resolve_data_path(path)
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "whoandwhen":
        return iter_who_and_when(path, skip_invalid=skip_invalid, report=report)
    if fmt == "aftraj-parquet":
        return iter_aftraj_parquet(path, skip_invalid=skip_invalid, report=report)
    if fmt == "jsonl":
        p = Path(path)
        if p.is_dir():
            p = p / "corpus.jsonl"
        return iter_jsonl(p, skip_invalid=skip_invalid, report=report)
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def load_trajectories(path: str | Path, fmt: str = "auto", **kw) -> list[Trajectory]:
    return list(iter_trajectories(path, fmt, **kw))
