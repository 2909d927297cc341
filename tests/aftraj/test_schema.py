"""Schema: round trips, streaming, and malformed records that must name file, line and field."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from aftraj.schema import (Label, ReadReport, SchemaError, Step, Trajectory, from_hf_dataset,
                           iter_jsonl, read_jsonl, to_hf_dataset, write_jsonl)


def good_record(i: int = 0, unsafe: bool = True) -> dict:
    steps = [
        {"index": 0, "agent": "user", "kind": "message", "content": "What is 6*7?"},
        {"index": 1, "agent": "MathSolver", "kind": "tool_call", "content": "compute it",
         "tool": "compute", "arguments": {"expr": "6*7"}, "event_id": "e1"},
        {"index": 2, "agent": "tool", "kind": "tool_result", "content": "41", "result_ids": [],
         "error": None, "meta": {"latency_ms": 3}},
        {"index": 3, "agent": "Verifier", "kind": "final_answer", "content": "41",
         "result_ids": None},
    ]
    label = ({"verdict": "UNSAFE", "decisive_step": 2, "decisive_agent": "tool",
              "reason": "wrong product", "label_source": "injected",
              "provenance": {"injection": "computation_slip"}}
             if unsafe else {"verdict": "SAFE", "label_source": "verified_safe"})
    return {"id": f"t{i}", "family_id": f"f{i // 2}", "domain": "math", "source": "unit",
            "task": "What is 6*7?", "steps": steps, "final_answer": "41",
            "termination": "completed", "outcome": "failure" if unsafe else "success",
            "reference_answer": "42", "label": label, "meta": {"seed": i}}


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_round_trip_jsonl(tmp_path):
    trajs = [Trajectory.from_dict(good_record(i, unsafe=i % 2 == 0)) for i in range(6)]
    out = tmp_path / "c.jsonl"
    assert write_jsonl(trajs, out) == 6
    back = read_jsonl(out)
    assert back == trajs
    # result_ids keep the unknown/empty distinction
    assert back[0].steps[2].result_ids == () and back[0].steps[3].result_ids is None
    # writing again is byte-identical
    out2 = tmp_path / "d.jsonl"
    write_jsonl(back, out2)
    assert out.read_bytes() == out2.read_bytes()


def test_round_trip_hf_datasets():
    trajs = [Trajectory.from_dict(good_record(i, unsafe=i % 2 == 0)) for i in range(4)]
    ds = to_hf_dataset(trajs)
    assert len(ds) == 4
    assert from_hf_dataset(ds) == trajs


def test_streaming_yields_before_reading_the_rest(tmp_path):
    """The reader is a generator: the first record arrives before a later bad one is read."""
    p = write_lines(tmp_path / "s.jsonl", [orjson.dumps(good_record(0)), b"{not json"])
    it = iter_jsonl(p)
    first = next(it)
    assert first.id == "t0"
    with pytest.raises(SchemaError) as e:
        next(it)
    assert e.value.line == 2


def _mutate(fn):
    rec = copy.deepcopy(good_record(0))
    fn(rec)
    return orjson.dumps(rec)


def _del(path):
    def f(r):
        obj = r
        for k in path[:-1]:
            obj = obj[k]
        del obj[path[-1]]
    return f


def _set(path, value):
    def f(r):
        obj = r
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return f


# (case name, raw line, expected field)
MALFORMED = [
    ("missing id", _mutate(_del(["id"])), "id"),
    ("missing steps", _mutate(_del(["steps"])), "steps"),
    ("missing label", _mutate(_del(["label"])), "label"),
    ("missing step agent", _mutate(_del(["steps", 1, "agent"])), "steps[1].agent"),
    ("missing step content", _mutate(_del(["steps", 2, "content"])), "steps[2].content"),
    ("id wrong type", _mutate(_set(["id"], 7)), "id"),
    ("steps not a list", _mutate(_set(["steps"], {"0": 1})), "steps"),
    ("step index is a string", _mutate(_set(["steps", 1, "index"], "1")), "steps[1].index"),
    ("step index is a bool", _mutate(_set(["steps", 0, "index"], False)), "steps[0].index"),
    ("step index gap", _mutate(_set(["steps", 2, "index"], 5)), "steps[2].index"),
    ("empty agent", _mutate(_set(["steps", 1, "agent"], "  ")), "steps[1].agent"),
    ("unknown step kind", _mutate(_set(["steps", 1, "kind"], "shout")), "steps[1].kind"),
    ("content wrong type", _mutate(_set(["steps", 0, "content"], ["a"])), "steps[0].content"),
    ("arguments not an object", _mutate(_set(["steps", 1, "arguments"], "x=1")), "steps[1].arguments"),
    ("result_ids not a list", _mutate(_set(["steps", 2, "result_ids"], "r1")), "steps[2].result_ids"),
    ("result id not a string", _mutate(_set(["steps", 2, "result_ids"], [1])), "steps[2].result_ids[0]"),
    ("unknown domain", _mutate(_set(["domain"], "poetry")), "domain"),
    ("unknown termination", _mutate(_set(["termination"], "exploded")), "termination"),
    ("unknown outcome", _mutate(_set(["outcome"], "meh")), "outcome"),
    ("unknown verdict", _mutate(_set(["label", "verdict"], "MAYBE")), "label.verdict"),
    ("unknown label source", _mutate(_set(["label", "label_source"], "vibes")), "label.label_source"),
    ("unsafe without decisive step", _mutate(_del(["label", "decisive_step"])), "label.decisive_step"),
    ("decisive step out of range", _mutate(_set(["label", "decisive_step"], 4)), "label.decisive_step"),
    ("negative decisive step", _mutate(_set(["label", "decisive_step"], -1)), "label.decisive_step"),
    ("agent not in the trajectory", _mutate(_set(["label", "decisive_agent"], "Ghost")),
     "label.decisive_agent"),
    ("safe with a decisive step", _mutate(lambda r: r.update(label={
        "verdict": "SAFE", "label_source": "verified_safe", "decisive_step": 1})), "label.decisive_step"),
    ("unknown top-level field", _mutate(_set(["colour"], "red")), "colour"),
    ("unknown step field", _mutate(_set(["steps", 0, "mood"], "ok")), "steps[0].mood"),
    ("meta not an object", _mutate(_set(["meta"], [1, 2])), "meta"),
    ("final_answer wrong type", _mutate(_set(["final_answer"], 42)), "final_answer"),
    ("no steps", _mutate(_set(["steps"], [])), "steps"),
    ("10 MB content field", _mutate(_set(["steps", 0, "content"], "x" * (10 * 1024 * 1024))),
     "steps[0].content"),
    ("invalid UTF-8 in a field", _mutate(_set(["task"], "PLACEHOLDER")).replace(b"PLACEHOLDER", b"caf\xe9"),
     "task"),
    ("invalid JSON", b'{"id": "t0", "steps": [', "<record>"),
    ("a JSON array instead of lines", orjson.dumps([good_record(0), good_record(1)]), "<record>"),
    ("a bare string", b'"hello"', "<record>"),
    ("wrong schema version", _mutate(_set(["schema_version"], 99)), "schema_version"),
]


@pytest.mark.parametrize("name,raw,field", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_record_names_file_line_and_field(tmp_path, name, raw, field):
    p = write_lines(tmp_path / "bad.jsonl", [orjson.dumps(good_record(0)), raw])
    with pytest.raises(SchemaError) as e:
        read_jsonl(p)
    err = e.value
    assert err.source == str(p) and err.line == 2 and err.field == field, str(err)
    assert str(p) in str(err) and ":2:" in str(err) and field in str(err)


def test_at_least_twenty_malformed_cases():
    assert len(MALFORMED) >= 20


def test_empty_file(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_bytes(b"")
    with pytest.raises(SchemaError) as e:
        read_jsonl(p)
    assert e.value.source == str(p) and e.value.field == "<file>" and "no records" in str(e.value)


def test_pretty_printed_array_file(tmp_path):
    p = tmp_path / "array.json"
    p.write_text(json.dumps([good_record(0)], indent=2))
    with pytest.raises(SchemaError) as e:
        read_jsonl(p)
    assert e.value.line == 1 and "JSON Lines" in str(e.value)


def test_duplicate_ids(tmp_path):
    p = write_lines(tmp_path / "dup.jsonl", [orjson.dumps(good_record(0))] * 2)
    with pytest.raises(SchemaError) as e:
        read_jsonl(p)
    assert (e.value.line, e.value.field) == (2, "id")


def test_skip_invalid_keeps_every_valid_record(tmp_path):
    lines, good_ids = [], []
    for i, (_, raw, _) in enumerate(MALFORMED):
        rec = good_record(100 + i)
        lines.append(orjson.dumps(rec))
        good_ids.append(rec["id"])
        lines.append(raw.replace(b'"t0"', f'"bad{i}"'.encode()))
    p = write_lines(tmp_path / "mixed.jsonl", lines)
    report = ReadReport()
    got = read_jsonl(p, skip_invalid=True, report=report)
    assert [t.id for t in got] == good_ids
    assert report.n_read == len(good_ids) and report.n_skipped == len(MALFORMED)
    assert [e.line for e in report.errors] == list(range(2, 2 * len(MALFORMED) + 1, 2))


def test_cli_convert_skip_invalid_reports_counts(tmp_path):
    lines = [orjson.dumps(good_record(i)) for i in range(3)] + [b"{broken", MALFORMED[3][1]]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "aftraj.cli", "convert", "--from", "jsonl", str(src), "--out", str(out)]
    strict = subprocess.run(cmd, capture_output=True, text=True)
    assert strict.returncode == 2 and f"{src}:4: field '<record>'" in strict.stderr
    r = subprocess.run(cmd + ["--skip-invalid"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "converted 3 trajectories" in r.stdout and "skipped 2 invalid" in r.stdout
    assert len(read_jsonl(out)) == 3


def test_constructors_validate():
    with pytest.raises(SchemaError) as e:
        Step(index=0, agent="", kind="message", content="x")
    assert e.value.field == "step.agent"
    with pytest.raises(SchemaError):
        Label(verdict="UNSAFE", label_source="injected")
    lb = Label(verdict="UNSAFE", label_source="injected", decisive_step=0, decisive_agent="a")
    with pytest.raises(SchemaError) as e:
        Trajectory(id="x", family_id="f", domain="math", source="s", task="t",
                   steps=[Step(index=0, agent="b", kind="message", content="")], label=lb)
    assert e.value.field == "label.decisive_agent"
