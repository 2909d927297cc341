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

from aftraj.schema import Label, ReadReport, SchemaError, Step, Trajectory, iter_jsonl

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


def read_who_and_when_file(path: Path, subset: str) -> Trajectory:
    src = str(path)
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SchemaError(f"not a JSON file: {e}", source=src, line=1) from None
    try:
        for key in ("history", "question", "mistake_step", "mistake_agent"):
            if key not in raw:
                raise SchemaError("is missing", field=key)
        steps = []
        for i, h in enumerate(raw["history"]):
            if not isinstance(h, dict) or "content" not in h:
                raise SchemaError("must be an object with 'content'", field=f"history[{i}]")
            if subset == "Hand-Crafted":
                role = h.get("role")
                agent, meta = normalise_agent(str(role)), {"raw_role": role}
            else:
                agent = h.get("name") or h.get("role")
                meta = {"raw_role": h.get("role")}
            if not isinstance(agent, str) or not agent.strip():
                raise SchemaError("has no agent name", field=f"history[{i}]")
            content = h["content"] if isinstance(h["content"], str) else json.dumps(h["content"])
            steps.append(Step(index=i, agent=agent.strip(), kind="message", content=content, meta=meta))
        ms = raw["mistake_step"]
        try:
            k = int(str(ms).strip())
        except ValueError:
            raise SchemaError(f"must be an integer step index, got {ms!r}", field="mistake_step") from None
        agents = list(dict.fromkeys(s.agent for s in steps))
        agent = _match_agent(str(raw["mistake_agent"]), agents, src)
        extra = {k2: raw[k2] for k2 in ("level", "is_correct", "is_corrected", "mistake_type", "labels")
                 if k2 in raw}
        qid = str(raw.get("question_ID") or f"{subset}/{path.stem}")
        return Trajectory(
            id=f"whoandwhen/{subset}/{path.stem}", family_id=f"whoandwhen/{qid}", domain="external",
            source=f"who_and_when/{subset}", task=str(raw["question"]), steps=steps,
            final_answer=None, termination="completed", outcome="failure",
            reference_answer=None if raw.get("ground_truth") is None else str(raw["ground_truth"]),
            label=Label(verdict="UNSAFE", label_source="external", decisive_step=k,
                        decisive_agent=agent, reason=raw.get("mistake_reason"),
                        provenance={"mistake_agent_raw": raw["mistake_agent"],
                                    "mistake_step_raw": ms}),
            meta={"subset": subset, "file": path.name, "question_id": qid,
                  "question": raw["question"], "ground_truth": raw.get("ground_truth"), **extra},
        )
    except SchemaError as e:
        raise e.located(src, 1) from None


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
            except SchemaError as e:
                if not skip_invalid:
                    raise
                report.n_skipped += 1
                report.errors.append(e)
                continue
            report.n_read += 1
            yield traj
    if not found:
        raise SchemaError(f"no Who&When subset folder ({', '.join(subsets)}) under {root}",
                          field="<folder>", source=str(root))


# --------------------------------------------------------------------------- AFTraj-2K parquet

AFTRAJ_COLUMNS = ("conv_id", "domain", "task", "gold_answer", "turns", "tools", "mistake_step",
                  "mistake_agent", "mistake_reason", "unsafe_source")
_UNSAFE_SOURCE = {"injected": "injected", "injection": "injected", "constructive": "injected",
                  "diagnosed": "diagnosed", "diagnostic": "diagnosed", "natural": "diagnosed"}
_AFTRAJ_DOMAINS = {"math": "math", "code": "coding", "coding": "coding", "agentic": "agentic"}


def _py(v: Any) -> Any:
    """numpy/pyarrow scalars and arrays to plain Python."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and v != v:  # NaN from pandas' missing values
        return None
    return v


def _aftraj_action(action: Any) -> tuple[str | None, dict | None]:
    """Actions are JSON-encoded tool-call lists: '[{"name": "compute", "arguments": "…"}]'."""
    if action is None or (isinstance(action, str) and not action.strip()):
        return None, None
    calls = json.loads(action) if isinstance(action, str) else action
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls or not isinstance(calls[0], dict):
        return None, None
    name, args = calls[0].get("name"), calls[0].get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = {"_raw": args}
    if args is not None and not isinstance(args, dict):
        args = {"_value": args}
    return (name if isinstance(name, str) else None), args


def aftraj_row_to_trajectory(row: dict, *, safe: bool, split: str | None = None) -> Trajectory:
    """One released AFTraj-2K row. Turn i becomes step i, so mistake_step keeps its meaning."""
    turns = _py(row.get("turns"))
    if isinstance(turns, str):
        turns = json.loads(turns)
    if not isinstance(turns, list) or not turns:
        raise SchemaError("must be a non-empty list of {role, thought, action, content}", field="turns")
    steps = []
    for i, turn in enumerate(turns):
        turn = {k: _py(v) for k, v in dict(turn).items()}
        role = str(turn.get("role") or "").strip() or "unknown"
        thought, content = turn.get("thought") or "", turn.get("content") or ""
        try:
            tool, args = _aftraj_action(turn.get("action"))
        except json.JSONDecodeError as e:
            raise SchemaError(f"action is not JSON: {e}", field=f"turns[{i}].action") from None
        if role == "environment":
            kind = "tool_result"
        elif tool is not None:
            kind = "tool_call"
        else:
            kind = "message"
        text = f"{thought}\n{content}" if thought and content else (thought or content)
        meta = {k: turn[k] for k in ("thought", "action") if turn.get(k)}
        steps.append(Step(index=i, agent=role, kind=kind, content=str(text), tool=tool,
                          arguments=args, meta=meta))
    domain = _AFTRAJ_DOMAINS.get(str(_py(row.get("domain")) or "").lower())
    if domain is None:
        raise SchemaError(f"unknown domain {row.get('domain')!r}", field="domain")
    conv_id = str(_py(row.get("conv_id")))
    if safe:
        label = Label(verdict="SAFE", label_source="verified_safe")
    else:
        ms = _py(row.get("mistake_step"))
        try:
            k = int(ms)
        except (TypeError, ValueError):
            raise SchemaError(f"must be an integer step, got {ms!r}", field="mistake_step") from None
        src = str(_py(row.get("unsafe_source")) or "").lower()
        label = Label(verdict="UNSAFE", label_source=_UNSAFE_SOURCE.get(src, "diagnosed"),
                      decisive_step=k, decisive_agent=str(_py(row.get("mistake_agent"))),
                      reason=_py(row.get("mistake_reason")),
                      provenance={"unsafe_source": _py(row.get("unsafe_source"))})
    tools = _py(row.get("tools"))
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            pass
    gold = _py(row.get("gold_answer"))
    return Trajectory(
        id=f"aftraj/{conv_id}", family_id=f"aftraj/{row.get('family_id') or conv_id}",
        domain=domain, source="aftraj-2k", task=str(_py(row.get("task")) or ""), steps=steps,
        outcome="success" if safe else "failure",
        reference_answer=None if gold is None else str(gold), label=label,
        meta={"conv_id": conv_id, "tools": tools, "split": split,
              "num_turns": _py(row.get("num_turns"))})


def iter_aftraj_parquet(root: str | Path, *, skip_invalid: bool = False,
                        report: ReadReport | None = None,
                        test_only: bool = False) -> Iterator[Trajectory]:
    """Read `aftraj_safe.parquet` and `aftraj_unsafe.parquet` (and `splits_test.json`) as released."""
    import pyarrow.parquet as pq

    root = Path(root)
    report = report if report is not None else ReadReport()
    report.source = str(root)
    test_ids: set[str] | None = None
    sp = root / "splits_test.json"
    if sp.exists():
        raw = json.loads(sp.read_text())
        ids = raw if isinstance(raw, list) else [x for v in raw.values() for x in (v if isinstance(v, list) else [v])]
        test_ids = {str(x) for x in ids}
    files = [(root / "aftraj_safe.parquet", True), (root / "aftraj_unsafe.parquet", False)]
    if not any(p.exists() for p, _ in files):
        raise SchemaError("neither aftraj_safe.parquet nor aftraj_unsafe.parquet is here",
                          field="<folder>", source=str(root))
    for path, safe in files:
        if not path.exists():
            continue
        pf = pq.ParquetFile(path)
        missing = [c for c in ("conv_id", "domain", "task", "turns") if c not in pf.schema_arrow.names]
        if missing:
            raise SchemaError("required column is missing", field=missing[0], source=str(path))
        rowno = 0
        for batch in pf.iter_batches(batch_size=256):
            for row in batch.to_pylist():
                rowno += 1
                split = None if test_ids is None else ("test" if str(row.get("conv_id")) in test_ids else "train")
                if test_only and split != "test":
                    continue
                try:
                    traj = aftraj_row_to_trajectory(row, safe=safe, split=split)
                except SchemaError as e:
                    err = e.located(f"{path} (row)", rowno)
                    if not skip_invalid:
                        raise err from None
                    report.n_skipped += 1
                    report.errors.append(err)
                    continue
                report.n_read += 1
                yield traj


# --------------------------------------------------------------------------- any of them

def detect_format(path: str | Path) -> str:
    p = resolve_data_path(path)
    if p.is_dir():
        if any((p / s).is_dir() for s in WHO_AND_WHEN_SUBSETS):
            return "whoandwhen"
        if (p / "corpus.jsonl").exists():  # a built corpus holds both: its lossless JSONL wins
            return "jsonl"
        if (p / "aftraj_safe.parquet").exists() or (p / "aftraj_unsafe.parquet").exists():
            return "aftraj-parquet"
        raise SchemaError("cannot tell the format of this folder (Who&When subsets, AFTraj "
                          "parquet files or corpus.jsonl expected)", field="<folder>", source=str(p))
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
