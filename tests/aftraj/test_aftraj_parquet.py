"""The released AFTraj-2K parquet layout both ways: read exactly as released (any shard names,
classes from mistake_step, thought/action/tools/domain/conv_id kept), and `aftraj export --to
aftraj-parquet` writes rows equal to the ones read.

The released schema is the one the release's loader reads (github.com/ZBox1005/AgentForesight,
inference/data.py and prompts.py): turns list<{role, thought, action, content}>, tools
list<{name, description}>, mistake_step -1 on safe rows, splits_test.json {test_safe, test_unsafe}.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aftraj.readers import detect_format, load_trajectories
from aftraj.released import aftraj_schema, iter_aftraj_parquet
from aftraj.schema import SchemaError

TURN = pa.struct([("role", pa.string()), ("thought", pa.string()), ("action", pa.string()),
                  ("content", pa.string())])
TOOL = pa.struct([("name", pa.string()), ("description", pa.string())])
# Built here by hand, column by column, not imported from the code under test.
RELEASED = pa.schema([("conv_id", pa.string()), ("domain", pa.string()), ("task", pa.string()),
                      ("gold_answer", pa.string()), ("num_turns", pa.int64()),
                      ("turns", pa.list_(TURN)), ("tools", pa.list_(TOOL)),
                      ("mistake_step", pa.int64()), ("mistake_agent", pa.string()),
                      ("mistake_reason", pa.string()), ("unsafe_source", pa.string())])


def _t(role, content, action=None, thought=None):
    return {"role": role, "thought": thought, "action": action, "content": content}


CALL = json.dumps([{"name": "python", "arguments": json.dumps({"code": "print(6*7)"})}])
TOOLS = [{"name": "python", "description": "run Python code"},
         {"name": "web_search", "description": None}]


def released_rows() -> list[dict]:
    turns = [_t("user", "What is 6*7?"),
             _t("MathSolver", "Let me compute.", CALL, "I should use the tool."),
             _t("environment", "42"),
             _t("Verifier", None, "FINAL ANSWER: 42", "")]   # null content, free-text action
    bad = [dict(x) for x in turns]
    bad[3] = _t("Verifier", "The answer is 41.", None, "Reading the result.")
    return [
        {"conv_id": "math_0001", "domain": "math", "task": "What is 6*7?", "gold_answer": "42",
         "num_turns": 4, "turns": turns, "tools": TOOLS, "mistake_step": -1,
         "mistake_agent": "", "mistake_reason": "", "unsafe_source": ""},
        {"conv_id": "gaia_17", "domain": "gaia", "task": "t", "gold_answer": None,
         "num_turns": 4, "turns": turns, "tools": [], "mistake_step": -1,
         "mistake_agent": None, "mistake_reason": None, "unsafe_source": None},
        {"conv_id": "code_0042", "domain": "coding", "task": "What is 6*7?", "gold_answer": "42",
         "num_turns": 4, "turns": bad, "tools": TOOLS, "mistake_step": 3,
         "mistake_agent": "Verifier", "mistake_reason": "misreads the tool result",
         "unsafe_source": "natural"},
        {"conv_id": "hotpot_9", "domain": "hotpotqa", "task": "q", "gold_answer": "x",
         "num_turns": 4, "turns": turns, "tools": None, "mistake_step": 1,
         "mistake_agent": "MathSolver", "mistake_reason": "r", "unsafe_source": "injected"},
    ]


def write_released(root, rows=None, *, shards=None):
    """The release's two files (or `shards`: {file name: rows}) plus splits_test.json."""
    rows = released_rows() if rows is None else rows
    root.mkdir(parents=True, exist_ok=True)
    if shards is None:
        shards = {"aftraj_safe.parquet": [r for r in rows if r["mistake_step"] == -1],
                  "aftraj_unsafe.parquet": [r for r in rows if r["mistake_step"] != -1]}
    for name, rs in shards.items():
        pq.write_table(pa.Table.from_pylist(rs, schema=RELEASED), root / name)
    (root / "splits_test.json").write_text(json.dumps({"test_safe": ["gaia_17"],
                                                      "test_unsafe": ["code_0042"]}))
    return root


def _rows(folder) -> dict[str, dict]:
    out = {}
    for p in sorted(folder.glob("*.parquet")):
        for r in pq.read_table(p).to_pylist():
            out[r["conv_id"]] = r
    return out


def test_read_released_layout_keeps_every_value(tmp_path):
    root = write_released(tmp_path / "rel")
    assert detect_format(root) == "aftraj-parquet"
    trajs = {t.id: t for t in load_trajectories(root)}
    assert set(trajs) == {"math_0001", "gaia_17", "code_0042", "hotpot_9"}   # no prefix
    s, g, c, h = trajs["math_0001"], trajs["gaia_17"], trajs["code_0042"], trajs["hotpot_9"]
    assert s.label.verdict == g.label.verdict == "SAFE"
    assert c.label.decisive_step == 3 and c.label.decisive_agent == "Verifier"
    assert c.label.provenance["unsafe_source"] == "natural" and c.label.label_source == "diagnosed"
    assert h.label.label_source == "injected"
    assert (s.domain, g.domain, c.domain, h.domain) == ("math", "agentic", "coding", "agentic")
    assert g.meta["aftraj"]["domain"] == "gaia" and h.meta["aftraj"]["domain"] == "hotpotqa"
    step = s.steps[1]
    assert step.thought == "I should use the tool." and step.content == "Let me compute."
    assert step.tool == "python" and step.arguments == {"code": "print(6*7)"}
    assert step.meta["action"] == CALL and s.steps[2].kind == "tool_result"
    assert s.meta["aftraj"]["tools"] == TOOLS
    assert (g.meta["split"], c.meta["split"], s.meta["split"]) == ("test", "test", "train")
    assert [t.id for t in iter_aftraj_parquet(root, test_only=True)] == ["gaia_17", "code_0042"]


def test_one_mixed_shard_of_any_name(tmp_path):
    """The Hub's converted shard: both classes in one file, classes from mistake_step."""
    rows = released_rows()
    root = write_released(tmp_path / "hub", rows, shards={"train-00000-of-00001.parquet": rows})
    trajs = {t.id: t for t in load_trajectories(root)}
    assert {k: t.label.verdict for k, t in trajs.items()} == {
        "math_0001": "SAFE", "gaia_17": "SAFE", "code_0042": "UNSAFE", "hotpot_9": "UNSAFE"}
    (tmp_path / "many" / "data").mkdir(parents=True)
    many = write_released(tmp_path / "many", rows, shards={
        "data/train-00000-of-00002.parquet": rows[:1], "data/train-00001-of-00002.parquet": rows[1:]})
    assert [t.id for t in load_trajectories(many)] == [r["conv_id"] for r in rows]


def test_round_trip_gives_back_equal_rows(tmp_path):
    src = write_released(tmp_path / "rel")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "export", "--to", "aftraj-parquet",
                        str(src), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "exported 4 trajectories" in r.stdout and "(2 safe, 2 unsafe)" in r.stdout
    assert pq.read_schema(out / "aftraj_unsafe.parquet").equals(RELEASED)
    assert aftraj_schema().equals(RELEASED)
    assert _rows(out) == _rows(src)
    assert {p.name for p in out.glob("*.parquet")} == {"aftraj_safe.parquet", "aftraj_unsafe.parquet"}
    assert json.loads((out / "splits_test.json").read_text()) == {
        "test_safe": ["gaia_17"], "test_unsafe": ["code_0042"]}
    # and again through our JSONL: nothing is lost on the way
    jl = tmp_path / "x.jsonl"
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "convert", "--from", "aftraj-parquet",
                        str(src), "--out", str(jl)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out2 = tmp_path / "out2"
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "export", "--to", "aftraj-parquet",
                        str(jl), "--out", str(out2)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _rows(out2) == _rows(src)
    assert [t.meta["split"] for t in load_trajectories(out2)] == \
        [t.meta["split"] for t in load_trajectories(src)]


def test_release_loader_reads_our_export(tmp_path):
    """What the release's own loader (inference/data.py) does with the files, by hand."""
    out = tmp_path / "out"
    from aftraj.released import write_aftraj_parquet

    write_aftraj_parquet(load_trajectories(write_released(tmp_path / "rel")), None, out)
    safe = pq.read_table(out / "aftraj_safe.parquet").to_pylist()
    assert all(int(r["mistake_step"]) == -1 for r in safe)
    sj = json.loads((out / "splits_test.json").read_text())
    assert set(sj) == {"test_safe", "test_unsafe"}
    for r in pq.read_table(out / "aftraj_unsafe.parquet").to_pylist():
        assert [dict(t) for t in r["turns"]][0]["role"] == "user"
        assert int(r["num_turns"]) == len(r["turns"])


@pytest.mark.parametrize("field,value,named", [
    ("mistake_step", None, "mistake_step"),
    ("domain", "biology", "domain"),
    ("conv_id", None, "conv_id"),
    ("task", None, "task"),
    ("num_turns", 5, "num_turns"),
    ("mistake_agent", None, "mistake_agent"),
])
def test_bad_released_row_is_named(tmp_path, field, value, named):
    rows = released_rows()
    rows[2][field] = value
    root = write_released(tmp_path / "rel", rows)
    with pytest.raises(SchemaError) as e:
        load_trajectories(root)
    assert e.value.field == named and "aftraj_unsafe.parquet" in str(e.value)


def test_duplicate_conv_id_refused(tmp_path):
    rows = released_rows()
    rows[3]["conv_id"] = "code_0042"
    root = write_released(tmp_path / "rel", rows)
    with pytest.raises(SchemaError) as e:
        load_trajectories(root)
    assert e.value.field == "conv_id" and "duplicate conv_id 'code_0042'" in str(e.value)
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "convert", "--from", "aftraj-parquet",
                        str(root), "--out", str(tmp_path / "x.jsonl")], capture_output=True, text=True)
    assert r.returncode == 2 and "duplicate conv_id" in r.stderr
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x.jsonl.tmp").exists()


def test_skip_invalid_skips_a_bad_shard_and_keeps_the_rest(tmp_path):
    rows = released_rows()
    root = write_released(tmp_path / "hub", rows, shards={"train-00000-of-00002.parquet": rows[:2],
                                                          "train-00001-of-00002.parquet": rows[2:]})
    (root / "train-00002-of-00002.parquet").write_bytes(b"not parquet at all")
    bad = [dict(r) for r in rows[2:]]
    bad[0]["mistake_step"] = 99   # out of range: this row only
    pq.write_table(pa.Table.from_pylist(bad, schema=RELEASED), root / "train-00001-of-00002.parquet")
    with pytest.raises(SchemaError):
        load_trajectories(root)
    from aftraj.schema import ReadReport

    rep = ReadReport()
    kept = load_trajectories(root, skip_invalid=True, report=rep)
    assert [t.id for t in kept] == ["math_0001", "gaia_17", "hotpot_9"]
    assert rep.n_skipped == 2 and {e.field for e in rep.errors} == {"<file>", "label.decisive_step"}
