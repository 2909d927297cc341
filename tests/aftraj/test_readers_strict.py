"""Readers never guess (issue 14, item 5): a null or wrongly typed field is an error naming the
file and the field; labels are integers; duplicate ids are refused; in folder layouts
--skip-invalid skips the bad file and keeps the rest; no DST.tmp is left behind; lines and
files are read with a size bound before parsing. Each case failed on the code before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import aftraj.schema as schema
from aftraj.fields import label_int
from aftraj.readers import iter_who_and_when, load_trajectories, read_who_and_when_file
from aftraj.schema import ReadReport, SchemaError, Trajectory, iter_jsonl, write_jsonl

GOOD = {"history": [{"content": "hi", "role": "human"}, {"content": "ok", "role": "WebSurfer"}],
        "question": "q", "mistake_step": "1", "mistake_agent": "WebSurfer", "ground_truth": "x"}


def _ww(tmp_path, raw, subset="Hand-Crafted", name="1.json"):
    d = tmp_path / subset
    d.mkdir(parents=True, exist_ok=True)
    f = d / name
    f.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return f


def _bad(**kw):
    raw = json.loads(json.dumps(GOOD))
    for k, v in kw.items():
        if k.startswith("h0_"):
            if v is KeyError:
                del raw["history"][0][k[3:]]
            else:
                raw["history"][0][k[3:]] = v
        else:
            raw[k] = v
    return raw


@pytest.mark.parametrize("raw,field", [
    (_bad(question=None), "question"),                       # was the task "None"
    (_bad(question=7), "question"),
    (_bad(h0_role=KeyError), "history[0].role"),             # was agent "None"
    (_bad(h0_role=None), "history[0].role"),
    (_bad(h0_content=None), "history[0].content"),           # was the content "null"
    (_bad(h0_content={"a": 1}), "history[0].content"),
    (_bad(mistake_step="1_0"), "mistake_step"),              # int("1_0") == 10
    (_bad(mistake_step=1.7), "mistake_step"),                # int(1.7) == 1
    (_bad(mistake_step=True), "mistake_step"),               # int(True) == 1
    (_bad(mistake_step=" 1"), "mistake_step"),
    (_bad(mistake_step=None), "mistake_step"),
    (_bad(mistake_agent=None), "mistake_agent"),
    (_bad(ground_truth=3), "ground_truth"),                  # was "3"
    (_bad(history={"0": 1}), "history"),                     # was a TypeError
    ([GOOD], "<record>"),                                    # was an AttributeError
])
def test_who_and_when_field_errors_name_file_and_field(tmp_path, raw, field):
    f = _ww(tmp_path, raw)
    with pytest.raises(SchemaError) as e:
        read_who_and_when_file(f, "Hand-Crafted")
    assert e.value.field == field and e.value.source == str(f)


def test_algorithm_generated_name_must_be_a_string(tmp_path):
    raw = {**GOOD, "history": [{"content": "hi", "name": None, "role": "user"}], "mistake_step": 0,
           "mistake_agent": "user"}
    f = _ww(tmp_path, raw, subset="Algorithm-Generated")
    with pytest.raises(SchemaError) as e:
        read_who_and_when_file(f, "Algorithm-Generated")
    assert e.value.field == "history[0].name"


@pytest.mark.parametrize("v,ok", [(0, 0), (3, 3), ("3", 3), ("12", 12), (-1, None), ("-1", None),
                                  (True, None), (False, None), (1.0, None), (1.7, None),
                                  ("1_0", None), ("1e3", None), ("", None), ("３", None),
                                  ("9" * 12, None), (None, None), ([1], None)])
def test_label_int_accepts_only_integers(v, ok):
    if ok is None:
        with pytest.raises(SchemaError):
            label_int(v, "mistake_step")
    else:
        assert label_int(v, "mistake_step") == ok
    assert label_int(-1, "mistake_step", minimum=-1) == -1


def test_who_and_when_folder_skip_invalid_keeps_the_rest(tmp_path):
    _ww(tmp_path, GOOD, name="1.json")
    _ww(tmp_path, "[1, 2", name="2.json")                   # not JSON
    _ww(tmp_path, [GOOD], name="3.json")                     # a list: crashed the reader
    _ww(tmp_path, _bad(history=None), name="4.json")         # crashed the reader
    (tmp_path / "Hand-Crafted" / "5.json").mkdir()           # a folder named like a file
    _ww(tmp_path, GOOD, name="6.json")
    with pytest.raises(SchemaError):
        list(iter_who_and_when(tmp_path))
    rep = ReadReport()
    kept = list(iter_who_and_when(tmp_path, skip_invalid=True, report=rep))
    assert [t.meta["file"] for t in kept] == ["1.json", "6.json"]
    assert rep.n_skipped == 4 and all(e.source.endswith(".json") for e in rep.errors)


def test_convert_skip_invalid_folder_and_no_tmp_left(tmp_path):
    src = tmp_path / "ww"
    _ww(src, GOOD, name="1.json")
    _ww(src, [GOOD], name="2.json")
    out = tmp_path / "o" / "ww.jsonl"
    out.parent.mkdir()        # convert refuses --out into a missing folder (issue 23)
    cmd = [sys.executable, "-m", "aftraj.cli", "convert", "--from", "whoandwhen", str(src), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2 and "2.json" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists() and not out.with_name("ww.jsonl.tmp").exists()
    r = subprocess.run(cmd + ["--skip-invalid"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "converted 1 trajectories" in r.stdout and "skipped 1 invalid" in r.stdout


def test_write_jsonl_leaves_no_tmp_on_failure(tmp_path):
    def boom():
        raise SchemaError("bad", field="x")
        yield
    dst = tmp_path / "d.jsonl"
    with pytest.raises(SchemaError):
        write_jsonl(boom(), dst)
    assert list(tmp_path.iterdir()) == []


def _traj(i="a"):
    from aftraj.schema import Label, Step
    return Trajectory(id=i, family_id=i, domain="math", source="s", task="t",
                      steps=[Step(0, "A", "message", "x")], label=Label("SAFE", "verified_safe"))


def test_jsonl_line_is_bounded_before_parsing(tmp_path, monkeypatch):
    f = tmp_path / "c.jsonl"
    good = schema.dumps(_traj("a")) + b"\n"
    f.write_bytes(good + b'{"id": "' + b"x" * 5000 + b'"}\n' + schema.dumps(_traj("b")) + b"\n")
    monkeypatch.setattr(schema, "MAX_RECORD_BYTES", len(good) + 10)
    with pytest.raises(SchemaError) as e:
        list(iter_jsonl(f))
    assert e.value.line == 2 and "longer than" in str(e.value)
    rep = ReadReport()
    assert [t.id for t in iter_jsonl(f, skip_invalid=True, report=rep)] == ["a", "b"]
    assert rep.n_skipped == 1


def test_who_and_when_file_is_bounded_before_parsing(tmp_path, monkeypatch):
    f = _ww(tmp_path, {**GOOD, "pad": "x" * 5000})
    monkeypatch.setattr(schema, "MAX_RECORD_BYTES", 1000)
    with pytest.raises(SchemaError) as e:
        read_who_and_when_file(f, "Hand-Crafted")
    assert "larger than 1000 bytes" in str(e.value) and e.value.source == str(f)


def test_duplicate_ids_refused_in_jsonl(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_bytes(schema.dumps(_traj("a")) + b"\n" + schema.dumps(_traj("a")) + b"\n")
    with pytest.raises(SchemaError) as e:
        load_trajectories(f)
    assert e.value.field == "id" and e.value.line == 2
