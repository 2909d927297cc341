"""Runs imported by an adapter are "unlabeled" in `inspect` and `summary` (they used to show
"label: SAFE"), and `aftraj label` turns them into evaluation data, from the command line or a
CSV, round-tripping through `--to-csv` (aftraj/labels.py, issue 25)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from aftraj.boundary import UNLABELED, is_unlabeled
from aftraj.cli import main
from aftraj.readers import load_trajectories
from aftraj.schema import Label, Step, Trajectory, write_jsonl


def _run(i: int, n: int = 5) -> Trajectory:
    agents = ["user", "Coder", "Tester"]
    steps = [Step(j, agents[0] if j == 0 else agents[1 + j % 2], "message", f"step {j}") for j in range(n)]
    return Trajectory(id=f"run-{i}", family_id=f"run-{i}", domain="external", source="autogen", task="fix it",
                      steps=steps, label=UNLABELED, outcome="unknown", meta={"unlabeled": True})


@pytest.fixture
def imported(tmp_path):
    path = tmp_path / "mine.jsonl"
    write_jsonl([_run(0), _run(1), _run(2, 3)], path)
    return path


def test_inspect_and_summary_say_unlabeled(imported, capsys):
    assert main(["inspect", str(imported), "--id", "run-1"]) == 0
    out = capsys.readouterr().out
    assert "label: unlabeled" in out and "label: SAFE" not in out
    assert main(["summary", str(imported), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["all"]
    assert (s["safe"], s["unsafe"], s["unlabeled"]) == (0, 0, 3) and s["label_sources"] == {"unlabeled": 3}
    assert main(["summary", str(imported)]) == 0
    assert "(0 safe, 0 unsafe, 3 unlabeled)" in capsys.readouterr().out


def test_label_from_the_command_line_then_evaluate(imported, tmp_path, capsys):
    out = tmp_path / "labelled.jsonl"
    assert main(["label", str(imported), "--id", "run-0", "--step", "3", "--agent", "Coder",
                 "--reason", "called the wrong tool", "--out", str(out)]) == 0
    assert main(["label", str(out), "--id", "run-1", "--safe"]) == 0          # in place
    assert main(["label", str(out), "--id", "run-2", "--safe"]) == 0
    runs = {t.id: t for t in load_trajectories(out)}
    lb = runs["run-0"].label
    assert (lb.verdict, lb.decisive_step, lb.decisive_agent, lb.reason) == ("UNSAFE", 3, "Coder", "called the wrong tool")
    assert lb.label_source == "external" and lb.provenance == {"labelled_by": "aftraj label", "from": "command line"}
    assert not any(map(is_unlabeled, runs.values())) and "unlabeled" not in runs["run-1"].meta
    assert is_unlabeled(load_trajectories(imported)[0])                      # --out left the source alone
    capsys.readouterr()
    assert main(["inspect", str(out), "--id", "run-0"]) == 0
    assert "label: UNSAFE at step 3 by Coder (external)" in capsys.readouterr().out
    # refused while unlabeled, evaluated once labelled
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(imported), "--out", str(tmp_path / "e0"),
                 "--no-progress", "--n-boot", "10"]) == 2
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(out), "--out", str(tmp_path / "e1"),
                 "--no-progress", "--n-boot", "10"]) == 0
    m = json.loads((tmp_path / "e1" / "metrics.json").read_text())
    assert (m["overall"]["n_safe"], m["overall"]["n_unsafe"], m["overall"]["exact_f1"]) == (2, 1, 1.0)


def test_csv_round_trip(imported, tmp_path):
    template = tmp_path / "template.csv"
    assert main(["label", str(imported), "--to-csv", str(template)]) == 0
    assert template.read_text().splitlines() == [
        "id,verdict,decisive_step,decisive_agent,reason", "run-0,,,,", "run-1,,,,", "run-2,,,,"]
    filled = tmp_path / "labels.csv"
    filled.write_text("id,verdict,decisive_step,decisive_agent,reason\n"
                      'run-0,UNSAFE,2,Tester,"the test, not the code, was wrong"\n'
                      "run-1,safe,,,\n"
                      "run-2,,,,\n")                                   # left unlabeled
    out = tmp_path / "labelled.jsonl"
    assert main(["label", str(imported), "--csv", str(filled), "--out", str(out)]) == 0
    runs = {t.id: t for t in load_trajectories(out)}
    assert runs["run-0"].label.reason == "the test, not the code, was wrong"
    assert runs["run-0"].label.provenance["from"] == f"{filled}:2"
    assert runs["run-1"].label.verdict == "SAFE" and is_unlabeled(runs["run-2"])
    again = tmp_path / "again.csv"
    assert main(["label", str(out), "--to-csv", str(again)]) == 0
    assert again.read_text().splitlines() == [
        "id,verdict,decisive_step,decisive_agent,reason",
        'run-0,UNSAFE,2,Tester,"the test, not the code, was wrong"', "run-1,SAFE,,,", "run-2,,,,"]
    # and back: the exported CSV applied to the imported file gives the same trajectories
    out2 = tmp_path / "labelled2.jsonl"
    assert main(["label", str(imported), "--csv", str(again), "--out", str(out2)]) == 0
    strip = [replace(t, label=replace(t.label, provenance={})) for t in load_trajectories(out2)]
    assert strip == [replace(t, label=replace(t.label, provenance={})) for t in load_trajectories(out)]


@pytest.mark.parametrize("row, message", [
    ("run-0,UNSAFE,2,Nobody,r", "labels.csv:2: trajectory 'run-0': field 'label.decisive_agent'"),
    ("run-0,UNSAFE,9,Coder,r", "labels.csv:2: trajectory 'run-0': field 'label.decisive_step'"),
    ("run-0,UNSAFE,two,Coder,r", "labels.csv:2: field 'decisive_step': not an integer: 'two'"),
    ("run-0,UNSAFE,,Coder,r", "labels.csv:2: trajectory 'run-0': field 'label.decisive_step'"),
    ("run-0,MAYBE,,,", "labels.csv:2: trajectory 'run-0': field 'label.verdict'"),
    ("run-0,SAFE,2,Coder,", "labels.csv:2: trajectory 'run-0': field 'label.decisive_step'"),
    ("run-9,SAFE,,,", "labels.csv:2: no trajectory with id 'run-9'"),
    ("run-0,SAFE,,,\nrun-0,SAFE,,,", "labels.csv:3: id 'run-0' is labelled twice (also on line 2)"),
])
def test_bad_labels_name_file_line_and_field(imported, tmp_path, capsys, row, message):
    csv = tmp_path / "labels.csv"
    csv.write_text("id,verdict,decisive_step,decisive_agent,reason\n" + row + "\n")
    before = imported.read_bytes()
    assert main(["label", str(imported), "--csv", str(csv)]) == 2
    assert message in capsys.readouterr().err
    assert imported.read_bytes() == before          # nothing written


def test_bad_command_lines(imported, capsys):
    assert main(["label", str(imported), "--id", "run-0"]) == 2
    assert "give --safe, or --step K with --agent A" in capsys.readouterr().err
    assert main(["label", str(imported), "--id", "run-0", "--step", "2"]) == 2
    assert "needs --agent" in capsys.readouterr().err
    assert main(["label", str(imported), "--id", "run-0", "--step", "-1", "--agent", "Coder"]) == 2
    assert "label.decisive_step" in capsys.readouterr().err
    assert main(["label", str(imported)]) == 2


def test_labelled_run_keeps_everything_else(imported, tmp_path):
    out = tmp_path / "o.jsonl"
    assert main(["label", str(imported), "--id", "run-0", "--safe", "--reason", "checked by hand", "--out", str(out)]) == 0
    a, b = load_trajectories(imported)[0], load_trajectories(out)[0]
    assert replace(b, label=UNLABELED, meta={**b.meta, "unlabeled": True}) == a
    assert b.label == Label("SAFE", "external", reason="checked by hand",
                            provenance={"labelled_by": "aftraj label", "from": "command line"})
