"""Readers: Who&When (all 184), the released AFTraj-2K parquet layout, format detection."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aftraj.readers import normalise_agent, read_who_and_when_file
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


# AFTraj parquet: tests/aftraj/test_aftraj_parquet.py


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
