"""Readers: Who&When (all 184), the released AFTraj-2K parquet layout, format detection."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aftraj.readers import (detect_format, iter_aftraj_parquet, load_trajectories,
                            normalise_agent, read_who_and_when_file)
from aftraj.schema import SchemaError, read_jsonl


def test_all_who_and_when_trajectories_load(ww_trajs):
    by_subset = {}
    for t in ww_trajs:
        by_subset.setdefault(t.meta["subset"], []).append(t)
    assert len(by_subset["Algorithm-Generated"]) == 126
    assert len(by_subset["Hand-Crafted"]) == 58
    assert len({t.id for t in ww_trajs}) == 184
    for t in ww_trajs:
        lb = t.label
        assert lb.verdict == "UNSAFE" and lb.label_source == "external"
        assert 0 <= lb.decisive_step < len(t.steps)
        assert lb.decisive_agent in t.agents
        assert t.outcome == "failure" and t.domain == "external"
        assert t.reference_answer is not None and t.task == t.meta["question"]


def test_who_and_when_fields_match_raw_files(ww_dir, ww_trajs):
    """Independent re-read of the raw JSON: step 0 is the first history entry, k is int(str)."""
    by_id = {t.id: t for t in ww_trajs}
    for subset in ("Algorithm-Generated", "Hand-Crafted"):
        for f in sorted((ww_dir / subset).glob("*.json"))[:15]:
            raw = json.loads(f.read_text())
            t = by_id[f"whoandwhen/{subset}/{f.stem}"]
            assert len(t.steps) == len(raw["history"])
            assert t.label.decisive_step == int(raw["mistake_step"])
            assert [s.content for s in t.steps] == [h["content"] for h in raw["history"]]
            assert t.reference_answer == str(raw["ground_truth"])
            assert [s.meta["raw_role"] for s in t.steps] == [h.get("role") for h in raw["history"]]
            if subset == "Algorithm-Generated":
                assert [s.agent for s in t.steps] == [h["name"] for h in raw["history"]]


@pytest.mark.parametrize("raw,expected", [
    ("Orchestrator (thought)", "Orchestrator"),
    ("Orchestrator (-> WebSurfer)", "Orchestrator"),
    ("Orchestrator (-> ComputerTerminal)", "Orchestrator"),
    ("Orchestrator (termination condition)", "Orchestrator"),
    ("WebSurfer", "WebSurfer"),
    ("human", "human"),
])
def test_hand_crafted_agent_normalisation(raw, expected):
    assert normalise_agent(raw) == expected


def test_hand_crafted_agents_are_normalised_and_raw_role_kept(ww_trajs):
    hc = [t for t in ww_trajs if t.meta["subset"] == "Hand-Crafted"]
    agents = {a for t in hc for a in t.agents}
    assert not any("(" in a for a in agents), agents
    assert {"Orchestrator", "WebSurfer", "human"} <= agents
    raw_roles = {s.meta["raw_role"] for t in hc for s in t.steps}
    assert "Orchestrator (thought)" in raw_roles and "Orchestrator (-> WebSurfer)" in raw_roles
    # 'Websurfer' in the annotation is mapped onto the trajectory's spelling; the raw value is kept.
    t13 = next(t for t in hc if t.id.endswith("/13"))
    assert t13.label.decisive_agent == "WebSurfer"
    assert t13.label.provenance["mistake_agent_raw"] == "Websurfer"


def test_who_and_when_bad_file_names_the_field(tmp_path):
    d = tmp_path / "Hand-Crafted"
    d.mkdir()
    f = d / "1.json"
    f.write_text(json.dumps({"history": [{"content": "hi", "role": "human"}], "question": "q",
                             "mistake_step": "3", "mistake_agent": "human", "ground_truth": "x"}))
    with pytest.raises(SchemaError) as e:
        read_who_and_when_file(f, "Hand-Crafted")
    assert e.value.field == "label.decisive_step" and e.value.source == str(f)
    f.write_text(json.dumps({"history": [{"content": "hi", "role": "human"}], "question": "q",
                             "mistake_step": "zero", "mistake_agent": "human"}))
    with pytest.raises(SchemaError) as e:
        read_who_and_when_file(f, "Hand-Crafted")
    assert e.value.field == "mistake_step"


# --------------------------------------------------------------------------- AFTraj parquet

def _turn(role, content, action=None, thought=None):
    return {"role": role, "thought": thought, "action": action, "content": content}


def _write_released_layout(root, *, with_splits=True):
    """A small parquet pair in the released column layout (turns as a list of structs)."""
    turn_t = pa.struct([("role", pa.string()), ("thought", pa.string()), ("action", pa.string()),
                        ("content", pa.string())])
    schema = pa.schema([("conv_id", pa.string()), ("domain", pa.string()), ("task", pa.string()),
                        ("gold_answer", pa.string()), ("num_turns", pa.int64()),
                        ("tools", pa.string()), ("turns", pa.list_(turn_t)),
                        ("mistake_step", pa.int64()), ("mistake_agent", pa.string()),
                        ("mistake_reason", pa.string()), ("unsafe_source", pa.string())])
    call = json.dumps([{"name": "compute", "arguments": json.dumps({"expr": "6*7"})}])
    turns = [_turn("user", "What is 6*7?"),
             _turn("MathSolver", "Let me compute.", call, "I should use the tool."),
             _turn("environment", "42"),
             _turn("Verifier", "The answer is 42.")]
    tools = json.dumps([{"name": "compute", "description": "evaluate arithmetic"}])
    safe = [{"conv_id": "s1", "domain": "math", "task": "What is 6*7?", "gold_answer": "42",
             "num_turns": 4, "tools": tools, "turns": turns, "mistake_step": None,
             "mistake_agent": None, "mistake_reason": None, "unsafe_source": None}]
    bad_turns = [dict(t) for t in turns]
    bad_turns[3] = _turn("Verifier", "The answer is 41.")
    unsafe = [{"conv_id": "u1", "domain": "code", "task": "What is 6*7?", "gold_answer": "42",
               "num_turns": 4, "tools": tools, "turns": bad_turns, "mistake_step": 3,
               "mistake_agent": "Verifier", "mistake_reason": "misreads the tool result",
               "unsafe_source": "injected"},
              {"conv_id": "u2", "domain": "agentic", "task": "t", "gold_answer": "x",
               "num_turns": 4, "tools": None, "turns": turns, "mistake_step": 1,
               "mistake_agent": "MathSolver", "mistake_reason": "r", "unsafe_source": "diagnosed"}]
    pq.write_table(pa.Table.from_pylist(safe, schema=schema), root / "aftraj_safe.parquet")
    pq.write_table(pa.Table.from_pylist(unsafe, schema=schema), root / "aftraj_unsafe.parquet")
    if with_splits:
        (root / "splits_test.json").write_text(json.dumps({"test": ["u1"]}))


def test_aftraj_parquet_released_layout(tmp_path):
    _write_released_layout(tmp_path)
    assert detect_format(tmp_path) == "aftraj-parquet"
    trajs = {t.id: t for t in load_trajectories(tmp_path)}
    assert set(trajs) == {"aftraj/s1", "aftraj/u1", "aftraj/u2"}
    s1, u1, u2 = trajs["aftraj/s1"], trajs["aftraj/u1"], trajs["aftraj/u2"]
    assert s1.label.verdict == "SAFE" and s1.outcome == "success"
    assert [s.kind for s in s1.steps] == ["message", "tool_call", "tool_result", "message"]
    assert s1.steps[1].tool == "compute" and s1.steps[1].arguments == {"expr": "6*7"}
    assert "I should use the tool." in s1.steps[1].content and s1.steps[1].meta["thought"]
    assert u1.label.decisive_step == 3 and u1.label.decisive_agent == "Verifier"
    assert u1.label.label_source == "injected" and u1.domain == "coding"
    assert u2.label.label_source == "diagnosed" and u2.domain == "agentic"
    assert u1.meta["split"] == "test" and u2.meta["split"] == "train"
    assert u1.reference_answer == "42" and s1.meta["tools"][0]["name"] == "compute"
    assert list(iter_aftraj_parquet(tmp_path, test_only=True))[0].id == "aftraj/u1"


def test_aftraj_parquet_bad_row_is_named(tmp_path):
    _write_released_layout(tmp_path, with_splits=False)
    table = pq.read_table(tmp_path / "aftraj_unsafe.parquet").to_pylist()
    table[1]["mistake_step"] = 9  # out of range for 4 turns
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(tmp_path / "aftraj_unsafe.parquet")),
                   tmp_path / "aftraj_unsafe.parquet")
    with pytest.raises(SchemaError) as e:
        load_trajectories(tmp_path)
    assert e.value.field == "label.decisive_step" and e.value.line == 2
    assert "aftraj_unsafe.parquet" in str(e.value)
    kept = load_trajectories(tmp_path, skip_invalid=True)
    assert [t.id for t in kept] == ["aftraj/s1", "aftraj/u1"]


def test_cli_convert_who_and_when_and_inspect(tmp_path, ww_dir):
    out = tmp_path / "ww.jsonl"
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "convert", "--from", "whoandwhen",
                        str(ww_dir), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "converted 184 trajectories" in r.stdout
    assert len(read_jsonl(out)) == 184
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "inspect", str(out), "--prompt", "3",
                        "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    msgs = json.loads(r.stdout)["messages"]
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert "steps 0 to 3" in msgs[1]["content"]
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "inspect", str(out), "--id",
                        "whoandwhen/Hand-Crafted/1"], capture_output=True, text=True)
    assert r.returncode == 0 and "UNSAFE at step 12 by WebSurfer" in r.stdout
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "inspect", str(out), "--id", "nope"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no trajectory with id 'nope'" in r.stderr
