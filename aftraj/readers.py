"""Readers that map external layouts onto the one schema: Who&When (here), the released AFTraj-2K
parquet files (`aftraj.released`, which also writes them), and our own JSON Lines
(`aftraj.schema.iter_jsonl`); `iter_trajectories` tells them apart.

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

from aftraj.fields import label_int, need_str, skip_or_raise
from aftraj.released import aftraj_parquet_files, iter_aftraj_parquet
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
        question = need_str(raw["question"], "question")
        steps = []
        for i, h in enumerate(raw["history"]):
            if not isinstance(h, dict) or "content" not in h:
                raise SchemaError("must be an object with 'content'", field=f"history[{i}]")
            content = need_str(h["content"], f"history[{i}].content")
            role = need_str(h.get("role"), f"history[{i}].role",
                             optional=subset != "Hand-Crafted" and "name" in h)
            if subset == "Hand-Crafted":
                agent = normalise_agent(role)
            else:
                agent = need_str(h["name"], f"history[{i}].name") if "name" in h else role
            if not agent.strip():
                raise SchemaError("has no agent name", field=f"history[{i}]")
            steps.append(Step(index=i, agent=agent.strip(), kind="message", content=content,
                              meta={"raw_role": role}))
        ms = raw["mistake_step"]
        k = label_int(ms, "mistake_step")
        agents = list(dict.fromkeys(s.agent for s in steps))
        agent = _match_agent(need_str(raw["mistake_agent"], "mistake_agent"), agents, src)
        gt = need_str(raw.get("ground_truth"), "ground_truth", optional=True)
        reason = need_str(raw.get("mistake_reason"), "mistake_reason", optional=True)
        extra = {k2: raw[k2] for k2 in ("level", "is_correct", "is_corrected", "mistake_type", "labels")
                 if k2 in raw}
        qid = raw.get("question_ID")
        qid = f"{subset}/{path.stem}" if qid is None else need_str(qid, "question_ID")
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
                skip_or_raise(e, skip_invalid, report)
                continue
            report.n_read += 1
            yield traj
    if not found:
        raise SchemaError(f"no Who&When subset folder ({', '.join(subsets)}) under {root}",
                          field="<folder>", source=str(root))


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
