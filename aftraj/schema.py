"""The one trajectory schema (DESIGN §2): Step, Label, Trajectory, validated, plus streaming
JSON Lines I/O and Hugging Face `datasets` export/import.

Every validation failure is a `SchemaError` naming the file, the line and the field
(`steps[3].agent`). Reading streams line by line: a 1 GB file is never loaded whole.

    from aftraj.schema import iter_jsonl, write_jsonl
    for traj in iter_jsonl("corpus.jsonl"): ...
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from aftraj.errors import UsageError

STEP_KINDS = ("message", "tool_call", "tool_result", "final_answer", "system")
DOMAINS = ("math", "coding", "agentic", "external")
TERMINATIONS = ("completed", "step_limit", "cancelled", "tool_error")
OUTCOMES = ("success", "failure", "unknown")
VERDICTS = ("SAFE", "UNSAFE")
LABEL_SOURCES = ("verified_safe", "injected", "diagnosed", "external")

# Longest string accepted in any one field. Who&When's longest step is ~90k characters; a
# 10 MB field is a corrupt or hostile record, and is rejected with its field named.
MAX_FIELD_CHARS = 1_000_000
# Longest JSON Lines record (and longest single JSON file a reader parses), checked BEFORE
# parsing, so a hostile line cannot make the reader allocate without bound.
MAX_RECORD_BYTES = 64 * 1024 * 1024

SCHEMA_VERSION = 1


class SchemaError(UsageError):
    """A record that does not fit the schema. Names the source file, the line and the field."""

    def __init__(self, message: str, *, field: str = "<record>", source: str | None = None,
                 line: int | None = None):
        self.message, self.field, self.source, self.line = message, field, source, line
        super().__init__(str(self))

    def located(self, source: str | None, line: int | None) -> SchemaError:
        return SchemaError(self.message, field=self.field, source=source, line=line)

    def __str__(self) -> str:
        where = f"{self.source or '<memory>'}:{self.line if self.line is not None else '-'}"
        return f"{where}: field '{self.field}': {self.message}"


# --------------------------------------------------------------------------- field checks

def _fail(path: str, msg: str) -> None:
    raise SchemaError(msg, field=path)


def _str(v: Any, path: str, *, optional: bool = False, nonempty: bool = False) -> str | None:
    if v is None:
        if optional:
            return None
        _fail(path, "is required (got null)")
    if not isinstance(v, str):
        _fail(path, f"must be a string, got {type(v).__name__}")
    if len(v) > MAX_FIELD_CHARS:
        _fail(path, f"is {len(v)} characters, over the limit of {MAX_FIELD_CHARS}")
    if nonempty and not v.strip():
        _fail(path, "must be a non-empty string")
    return v


def _int(v: Any, path: str, *, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        _fail(path, f"must be an integer, got {type(v).__name__}")
    return v


def _choice(v: Any, path: str, choices: tuple[str, ...]) -> str:
    _str(v, path)
    if v not in choices:
        _fail(path, f"must be one of {', '.join(choices)}; got {v!r}")
    return v


def _dict(v: Any, path: str, *, optional: bool = False) -> dict | None:
    if v is None and optional:
        return None
    if not isinstance(v, dict):
        _fail(path, f"must be an object, got {type(v).__name__}")
    _check_json_value(v, path)
    return v


def _check_json_value(v: Any, path: str, depth: int = 0) -> None:
    """Free-form fields (arguments, meta, provenance) must be plain JSON with bounded strings."""
    if depth > 32:
        _fail(path, "is nested deeper than 32 levels")
    if isinstance(v, str):
        if len(v) > MAX_FIELD_CHARS:
            _fail(path, f"is {len(v)} characters, over the limit of {MAX_FIELD_CHARS}")
    elif isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                _fail(path, f"has a non-string key {k!r}")
            _check_json_value(x, f"{path}.{k}", depth + 1)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_json_value(x, f"{path}[{i}]", depth + 1)
    elif isinstance(v, float):
        if not math.isfinite(v):
            _fail(path, "must be a finite number")
    elif v is not None and not isinstance(v, (bool, int)):
        _fail(path, f"holds a {type(v).__name__}, which is not JSON")


def _or_empty(v: Any) -> Any:
    return {} if v is None else v


def _keys(d: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
    if not isinstance(d, dict):
        _fail(path or "<record>", f"must be an object, got {type(d).__name__}")
    for k in required:
        if k not in d:
            _fail(f"{path}.{k}" if path else k, "is missing")
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        _fail(f"{path}.{unknown[0]}" if path else unknown[0],
              f"is not a field of the schema (allowed: {', '.join(required + optional)})")
    return d


# --------------------------------------------------------------------------- the schema

@dataclass(frozen=True, slots=True)
class Step:
    """One entry of a trajectory. `result_ids`: None = unknown, () = observed empty."""

    index: int
    agent: str
    kind: str
    content: str
    tool: str | None = None
    arguments: dict | None = None
    result_ids: tuple[str, ...] | None = None
    error: str | None = None
    event_id: str | None = None
    meta: dict = field(default_factory=dict)
    thought: str | None = None   # the agent's reasoning, where the source keeps it apart (AFTraj)

    def __post_init__(self) -> None:
        if isinstance(self.result_ids, list):
            object.__setattr__(self, "result_ids", tuple(self.result_ids))
        _validate_step(self, "step")

    def to_dict(self) -> dict:
        return {
            "index": self.index, "agent": self.agent, "kind": self.kind, "content": self.content,
            "thought": self.thought, "tool": self.tool, "arguments": self.arguments,
            "result_ids": None if self.result_ids is None else list(self.result_ids),
            "error": self.error, "event_id": self.event_id, "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: Any, path: str = "step") -> Step:
        _keys(d, path, ("index", "agent", "kind", "content"),
              ("thought", "tool", "arguments", "result_ids", "error", "event_id", "meta"))
        rids = d.get("result_ids")
        if rids is not None:
            if not isinstance(rids, list):
                _fail(f"{path}.result_ids", f"must be a list of strings or null, got {type(rids).__name__}")
            rids = tuple(rids)
        try:
            return cls(index=d["index"], agent=d["agent"], kind=d["kind"], content=d["content"],
                       tool=d.get("tool"), arguments=d.get("arguments"), result_ids=rids,
                       error=d.get("error"), event_id=d.get("event_id"), meta=_or_empty(d.get("meta")),
                       thought=d.get("thought"))
        except SchemaError as e:
            raise SchemaError(e.message, field=e.field.replace("step", path, 1)) from None


def _validate_step(s: Step, p: str) -> None:
    _int(s.index, f"{p}.index")
    if s.index < 0:
        _fail(f"{p}.index", f"must be >= 0, got {s.index}")
    _str(s.agent, f"{p}.agent", nonempty=True)
    _choice(s.kind, f"{p}.kind", STEP_KINDS)
    _str(s.content, f"{p}.content")
    _str(s.thought, f"{p}.thought", optional=True)
    _str(s.tool, f"{p}.tool", optional=True)
    _dict(s.arguments, f"{p}.arguments", optional=True)
    if s.result_ids is not None:
        for i, r in enumerate(s.result_ids):
            _str(r, f"{p}.result_ids[{i}]")
    _str(s.error, f"{p}.error", optional=True)
    _str(s.event_id, f"{p}.event_id", optional=True)
    _dict(s.meta, f"{p}.meta")


@dataclass(frozen=True, slots=True)
class Label:
    """SAFE, or UNSAFE with the decisive step k* and agent a*; plus where the label came from."""

    verdict: str
    label_source: str
    decisive_step: int | None = None
    decisive_agent: str | None = None
    reason: str | None = None
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate_label(self, "label")

    @property
    def unsafe(self) -> bool:
        return self.verdict == "UNSAFE"

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "decisive_step": self.decisive_step,
                "decisive_agent": self.decisive_agent, "reason": self.reason,
                "label_source": self.label_source, "provenance": self.provenance}

    @classmethod
    def from_dict(cls, d: Any, path: str = "label") -> Label:
        _keys(d, path, ("verdict", "label_source"),
              ("decisive_step", "decisive_agent", "reason", "provenance"))
        try:
            return cls(verdict=d["verdict"], label_source=d["label_source"],
                       decisive_step=d.get("decisive_step"), decisive_agent=d.get("decisive_agent"),
                       reason=d.get("reason"), provenance=_or_empty(d.get("provenance")))
        except SchemaError as e:
            raise SchemaError(e.message, field=e.field.replace("label", path, 1)) from None


def _validate_label(lb: Label, p: str) -> None:
    _choice(lb.verdict, f"{p}.verdict", VERDICTS)
    _choice(lb.label_source, f"{p}.label_source", LABEL_SOURCES)
    _str(lb.reason, f"{p}.reason", optional=True)
    _dict(lb.provenance, f"{p}.provenance")
    if lb.verdict == "UNSAFE":
        if lb.decisive_step is None:
            _fail(f"{p}.decisive_step", "is required when verdict is UNSAFE")
        _int(lb.decisive_step, f"{p}.decisive_step")
        if lb.decisive_step < 0:
            _fail(f"{p}.decisive_step", f"must be >= 0, got {lb.decisive_step}")
        _str(lb.decisive_agent, f"{p}.decisive_agent", nonempty=True)
    else:
        if lb.decisive_step is not None:
            _fail(f"{p}.decisive_step", "must be null when verdict is SAFE")
        if lb.decisive_agent is not None:
            _fail(f"{p}.decisive_agent", "must be null when verdict is SAFE")


@dataclass(frozen=True, slots=True)
class Trajectory:
    id: str
    family_id: str
    domain: str
    source: str
    task: str
    steps: tuple[Step, ...]
    label: Label
    final_answer: str | None = None
    termination: str = "completed"
    outcome: str = "unknown"
    reference_answer: str | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.steps, list):
            object.__setattr__(self, "steps", tuple(self.steps))
        _validate_trajectory(self)

    @property
    def agents(self) -> list[str]:
        """Agents in order of first appearance."""
        return list(dict.fromkeys(s.agent for s in self.steps))

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION, "id": self.id, "family_id": self.family_id,
            "domain": self.domain, "source": self.source, "task": self.task,
            "steps": [s.to_dict() for s in self.steps], "final_answer": self.final_answer,
            "termination": self.termination, "outcome": self.outcome,
            "reference_answer": self.reference_answer, "label": self.label.to_dict(),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: Any) -> Trajectory:
        _keys(d, "", ("id", "family_id", "domain", "source", "task", "steps", "label"),
              ("schema_version", "final_answer", "termination", "outcome", "reference_answer", "meta"))
        sv = d.get("schema_version", SCHEMA_VERSION)
        if sv != SCHEMA_VERSION:
            _fail("schema_version", f"this reader knows version {SCHEMA_VERSION}, got {sv!r}")
        steps = d["steps"]
        if not isinstance(steps, list):
            _fail("steps", f"must be a list, got {type(steps).__name__}")
        parsed = tuple(Step.from_dict(s, f"steps[{i}]") for i, s in enumerate(steps))
        return cls(id=d["id"], family_id=d["family_id"], domain=d["domain"], source=d["source"],
                   task=d["task"], steps=parsed, label=Label.from_dict(d["label"]),
                   final_answer=d.get("final_answer"), termination=d.get("termination", "completed"),
                   outcome=d.get("outcome", "unknown"), reference_answer=d.get("reference_answer"),
                   meta=_or_empty(d.get("meta")))


def _validate_trajectory(t: Trajectory) -> None:
    _str(t.id, "id", nonempty=True)
    _str(t.family_id, "family_id", nonempty=True)
    _choice(t.domain, "domain", DOMAINS)
    _str(t.source, "source", nonempty=True)
    _str(t.task, "task")
    _str(t.final_answer, "final_answer", optional=True)
    _choice(t.termination, "termination", TERMINATIONS)
    _choice(t.outcome, "outcome", OUTCOMES)
    _str(t.reference_answer, "reference_answer", optional=True)
    _dict(t.meta, "meta")
    if not isinstance(t.label, Label):
        _fail("label", f"must be a Label, got {type(t.label).__name__}")
    if not t.steps:
        _fail("steps", "must hold at least one step")
    for i, s in enumerate(t.steps):
        if not isinstance(s, Step):
            _fail(f"steps[{i}]", f"must be a Step, got {type(s).__name__}")
        if s.index != i:
            _fail(f"steps[{i}].index", f"must be {i} (indices are 0-based and contiguous), got {s.index}")
    lb = t.label
    if lb.unsafe:
        if lb.decisive_step >= len(t.steps):
            _fail("label.decisive_step",
                  f"is {lb.decisive_step}, out of range for {len(t.steps)} steps (0..{len(t.steps) - 1})")
        if lb.decisive_agent not in {s.agent for s in t.steps}:
            _fail("label.decisive_agent",
                  f"{lb.decisive_agent!r} is not an agent of this trajectory ({', '.join(t.agents)})")


# --------------------------------------------------------------------------- JSON Lines

@dataclass
class ReadReport:
    """What a read accepted and what it rejected (with `skip_invalid`)."""

    source: str = ""
    n_read: int = 0
    n_skipped: int = 0
    errors: list[SchemaError] = field(default_factory=list)


def _find_bad_string(v: Any, path: str) -> str | None:
    if isinstance(v, str):
        return path if any(0xDC80 <= ord(c) <= 0xDCFF for c in v) else None
    if isinstance(v, dict):
        for k, x in v.items():
            hit = _find_bad_string(k, path) or _find_bad_string(x, f"{path}.{k}" if path else k)
            if hit:
                return hit
    if isinstance(v, list):
        for i, x in enumerate(v):
            hit = _find_bad_string(x, f"{path}[{i}]")
            if hit:
                return hit
    return None


def parse_record(raw: bytes) -> dict:
    """Decode one JSON Lines record; errors name the field where that can be known."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as ue:
            # Find which field holds the bad bytes, so the message can name it.
            try:
                where = _find_bad_string(json.loads(raw.decode("utf-8", "surrogateescape")), "")
            except ValueError:
                where = None
            raise SchemaError(f"invalid UTF-8 at byte {ue.start}", field=where or "<record>") from None
        if raw.lstrip().startswith(b"["):
            raise SchemaError("a JSON array is not JSON Lines: write one trajectory object per line",
                              field="<record>") from None
        raise SchemaError(f"invalid JSON: {e}", field="<record>") from None
    if isinstance(obj, list):
        raise SchemaError("a JSON array is not JSON Lines: write one trajectory object per line",
                          field="<record>")
    if not isinstance(obj, dict):
        raise SchemaError(f"must be a JSON object, got {type(obj).__name__}", field="<record>")
    return obj


def iter_jsonl(path: str | Path, *, skip_invalid: bool = False,
               report: ReadReport | None = None) -> Iterator[Trajectory]:
    """Stream trajectories from a JSON Lines file.

    Without `skip_invalid` the first bad record raises (what was yielded before stays yours);
    with it, bad records are counted in `report` and every valid one is yielded. Blank lines
    are not records. An empty file, or a duplicate id, is an error.
    """
    src = str(path)
    report = report if report is not None else ReadReport()
    report.source = src
    seen: set[str] = set()
    n_lines = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(_bounded_lines(f), start=1):
            n_lines = lineno
            if raw is not None and not raw.strip():
                continue
            try:
                if raw is None:
                    raise SchemaError(f"the line is longer than {MAX_RECORD_BYTES} bytes",
                                      field="<record>")
                traj = Trajectory.from_dict(parse_record(raw))
                if traj.id in seen:
                    raise SchemaError(f"duplicate trajectory id {traj.id!r}", field="id")
            except SchemaError as e:
                err = e.located(src, lineno)
                if not skip_invalid:
                    raise err from None
                report.n_skipped += 1
                report.errors.append(err)
                continue
            seen.add(traj.id)
            report.n_read += 1
            yield traj
    if report.n_read == 0 and report.n_skipped == 0:
        raise SchemaError("the file holds no records", field="<file>", source=src, line=n_lines)


def _bounded_lines(f, limit: int | None = None) -> Iterator[bytes | None]:
    """The lines of a binary file, each read with a size bound: a line over `limit` bytes is
    consumed in bounded chunks and yielded as None (never held whole)."""
    limit = MAX_RECORD_BYTES if limit is None else limit
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        if len(raw) > limit and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(1 << 20)
            yield None
            continue
        yield raw


def read_bounded(path: str | Path, limit: int | None = None) -> bytes:
    """A whole file, refused (SchemaError naming it) when over `limit` bytes, before reading it."""
    limit = MAX_RECORD_BYTES if limit is None else limit
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise SchemaError(f"cannot be read: {e.strerror or e}", field="<file>", source=str(path)) from None
    if len(data) > limit:
        raise SchemaError(f"is larger than {limit} bytes", field="<file>", source=str(path))
    return data


def read_jsonl(path: str | Path, *, skip_invalid: bool = False,
               report: ReadReport | None = None) -> list[Trajectory]:
    return list(iter_jsonl(path, skip_invalid=skip_invalid, report=report))


def dumps(traj: Trajectory) -> bytes:
    """One JSON Lines record (no newline). Key order is fixed, so output is byte-stable."""
    return orjson.dumps(traj.to_dict())


def write_jsonl(trajs: Iterable[Trajectory], path: str | Path) -> int:
    """Write trajectories one per line (streaming; atomic via a temporary file). Returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    try:
        with open(tmp, "wb") as f:
            for t in trajs:
                f.write(dumps(t))
                f.write(b"\n")
                n += 1
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)   # a failed write leaves neither a partial DST nor DST.tmp
        raise
    return n


# --------------------------------------------------------------------------- Hugging Face datasets

_JSON_COLUMNS = ("meta",)


def to_hf_rows(trajs: Iterable[Trajectory]) -> Iterator[dict]:
    """Rows with a fixed Arrow-friendly layout: free-form objects become JSON strings."""
    for t in trajs:
        d = t.to_dict()
        d["meta"] = orjson.dumps(d["meta"]).decode()
        d["label"]["provenance"] = orjson.dumps(d["label"]["provenance"]).decode()
        for s in d["steps"]:
            s["arguments"] = None if s["arguments"] is None else orjson.dumps(s["arguments"]).decode()
            s["meta"] = orjson.dumps(s["meta"]).decode()
        yield d


def to_hf_dataset(trajs: Iterable[Trajectory]):
    """A `datasets.Dataset`, one row per trajectory (`.save_to_disk`, `.push_to_hub`, …)."""
    import datasets

    return datasets.Dataset.from_list(list(to_hf_rows(trajs)))


def from_hf_rows(rows: Iterable[dict]) -> Iterator[Trajectory]:
    for i, row in enumerate(rows):
        d = dict(row)
        try:
            d["meta"] = orjson.loads(d["meta"]) if d.get("meta") else {}
            lb = dict(d["label"])
            lb["provenance"] = orjson.loads(lb["provenance"]) if lb.get("provenance") else {}
            d["label"] = lb
            steps = []
            for s in d["steps"]:
                s = dict(s)
                s["arguments"] = None if s.get("arguments") is None else orjson.loads(s["arguments"])
                s["meta"] = orjson.loads(s["meta"]) if s.get("meta") else {}
                steps.append(s)
            d["steps"] = steps
            yield Trajectory.from_dict(d)
        except SchemaError as e:
            raise e.located("<datasets>", i) from None


def from_hf_dataset(ds) -> list[Trajectory]:
    return list(from_hf_rows(ds))
