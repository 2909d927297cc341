"""The content-blind floors (eval/auditors/floors.py): fit on a train split, blind to content,
reachable as heuristic:position-prior / heuristic:length, and shown in every corpus report."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from aftraj.schema import Label, Step, Trajectory, write_jsonl
from eval.auditors import get_auditor
from eval.auditors.floors import FLOOR_SPECS, MIN_CELL, LengthFloor, PositionPrior, floor_metrics, train_split_of


def _traj(i: int, n: int, k: int | None, domain: str = "math", content: str = "x") -> Trajectory:
    steps = tuple(Step(index=j, agent="User" if j == 0 else ("A" if j % 2 else "B"), kind="message",
                       content=f"{content} {j}") for j in range(n))
    label = Label("SAFE", "verified_safe") if k is None else Label("UNSAFE", "injected", decisive_step=k,
                                                                   decisive_agent=steps[k].agent)
    return Trajectory(id=f"t{i}", family_id=f"f{i}", domain=domain, source="s", task="q", steps=steps, label=label)


def test_position_prior_takes_the_better_of_absolute_and_relative():
    # absolute: k* = 3 in every run of any length -> ("abs", 3)
    train = [_traj(i, n, 3) for i, n in enumerate((8, 12, 20, 30))] + [_traj(9, 10, None)]
    pp = PositionPrior("position-prior", train=train)
    assert pp.prior["math"] == ("abs", 3) and pp.pick(_traj(20, 40, None)) == 3 and pp.pick(_traj(21, 3, None)) == 2
    # relative: k* at the middle of runs of different lengths -> ("rel", 10 twentieths)
    train = [_traj(i, n, (n - 1) // 2) for i, n in enumerate((9, 13, 21, 31))]
    pp = PositionPrior("position-prior", train=train)
    assert pp.prior["math"] == ("rel", 10) and pp.pick(_traj(30, 41, None)) == 20
    # an unseen domain falls back to the prior over all domains
    assert pp.pick(_traj(31, 41, None, domain="coding")) == 20


def _blind_view(t: Trajectory) -> Trajectory:
    """`t` with everything a content-blind floor must not read changed: step content, the label
    (unsafe <-> safe, another step), outcome, final answer, meta."""
    k = t.label.decisive_step
    label = (Label("UNSAFE", "injected", decisive_step=0, decisive_agent=t.steps[0].agent) if k is None
             else Label("SAFE", "verified_safe"))
    return replace(t, steps=tuple(replace(s, content="completely different") for s in t.steps), label=label,
                   outcome="unknown", final_answer="other", meta={"split": "test", "note": "scrambled"})


def _reads_only_blind_fields(floor, trajs: list[Trajectory]) -> bool:
    return ([floor.audit(t, len(t.steps) - 1) for t in trajs]
            == [floor.audit(_blind_view(t), len(t.steps) - 1) for t in trajs])


def test_floors_never_read_content():
    train = [_traj(i, 10 + i % 7, 2 + i % 5) for i in range(40)] + [_traj(100 + i, 12 + i % 5, None) for i in range(30)]
    test = [_traj(200 + i, 9 + i % 9, (1 + i) % 6) for i in range(30)]
    for cls, rule in ((PositionPrior, "position-prior"), (LengthFloor, "length")):
        assert _reads_only_blind_fields(cls(rule, train=train), test)

    class PeekingFloor(PositionPrior):     # a floor reading the evaluated run's gold label must be caught
        def pick(self, traj):
            return traj.label.decisive_step

    assert not _reads_only_blind_fields(PeekingFloor("position-prior", train=train), test)


def test_floors_refuse_unlabeled_imported_runs(tmp_path):
    from aftraj.adapters.base import UNLABELED

    train = [_traj(i, 10, 3) for i in range(10)]
    imported = replace(_traj(99, 10, None), label=UNLABELED, meta={"unlabeled": True})
    with pytest.raises(ValueError, match="'t99'.*no gold label"):
        PositionPrior("position-prior", train=[*train, imported])
    write_jsonl([*train, imported], tmp_path / "train.jsonl")
    with pytest.raises(ValueError, match="'t99'.*no gold label"):
        get_auditor(f"heuristic:length,train={tmp_path / 'train.jsonl'}")
    assert PositionPrior("position-prior", train=train).n_train == 10   # the labelled side fits


def test_train_file_keeps_only_its_train_split(tmp_path):
    train = [replace(_traj(i, 10, 3), meta={"split": "train"}) for i in range(10)]
    held = [replace(_traj(100 + i, 10, 7), meta={"split": s}) for i, s in enumerate(["val", "test"] * 10)]
    write_jsonl(train + held, tmp_path / "corpus.jsonl")
    got = get_auditor(f"heuristic:position-prior,train={tmp_path / 'corpus.jsonl'}")
    assert got.n_train == 10 and got.prior["math"] == ("abs", 3)      # val/test (k* = 7) never fitted
    write_jsonl(held, tmp_path / "held.jsonl")
    with pytest.raises(ValueError, match="no record with meta.split == 'train'"):
        get_auditor(f"heuristic:position-prior,train={tmp_path / 'held.jsonl'}")
    write_jsonl([_traj(i, 10, 3) for i in range(4)], tmp_path / "plain.jsonl")   # no splits: the file whole
    assert get_auditor(f"heuristic:position-prior,train={tmp_path / 'plain.jsonl'}").n_train == 4


def test_test_file_beside_corpus_jsonl_fits_on_its_train_records(tmp_path):
    train = [replace(_traj(i, 10, 3), meta={"split": "train"}) for i in range(10)]
    test = [replace(_traj(100 + i, 10, 3 if i % 2 else None), meta={"split": "test"}) for i in range(10)]
    write_jsonl(train + test, tmp_path / "corpus.jsonl")
    write_jsonl(test, tmp_path / "test.jsonl")                     # no train.jsonl beside it
    assert [t.id for t in train_split_of(tmp_path / "test.jsonl")] == [t.id for t in train]
    m = floor_metrics(tmp_path / "test.jsonl", test, n_boot=0)
    assert tuple(m) == FLOOR_SPECS
    # no val records: the floors whose threshold is chosen on val are not scored, and say why
    assert "no val split" in m["heuristic:bow"]["skipped"] and "no val split" in m["heuristic:structure"]["skipped"]
    assert get_auditor("heuristic:length", data=str(tmp_path / "test.jsonl")).n_train == 10


def test_length_floor_alarms_only_where_train_runs_of_that_length_are_mostly_unsafe():
    train = ([_traj(i, 10, 4) for i in range(MIN_CELL)] + [_traj(50 + i, 20, None) for i in range(MIN_CELL)]
             + [_traj(90 + i, 30, 7) for i in range(MIN_CELL // 2)] + [_traj(95 + i, 30, None) for i in range(MIN_CELL // 2)])
    f = LengthFloor("length", train=train)
    assert f.unsafe_share("math", 10) == 1.0 and f.pick(_traj(1, 10, None)) == 4
    assert f.unsafe_share("math", 20) == 0.0 and f.pick(_traj(2, 20, None)) is None
    assert f.unsafe_share("math", 30) == 0.5 and f.pick(_traj(3, 30, None)) is None      # a tie is no majority
    # a length with too few train runs pools its neighbours (11 -> 10 ± 1)
    assert f.unsafe_share("math", 11) == 1.0 and f.pick(_traj(4, 11, None)) is not None
    assert f.unsafe_share("math", 60) is None and f.pick(_traj(5, 60, None)) is None
    assert f.audit(_traj(6, 20, None), 19).verdict.alarm is False


def test_spec_dispatch_and_fit_on_the_train_split_beside_the_data(tmp_path):
    train = [_traj(i, 10, 3) for i in range(10)]
    test = [_traj(100 + i, 10, 3 if i % 2 else None) for i in range(10)]
    write_jsonl(train, tmp_path / "train.jsonl")
    write_jsonl(test, tmp_path / "test.jsonl")
    for spec in ("heuristic:position-prior", "floor:position-prior", "heuristic:length"):
        a = get_auditor(spec, data=str(tmp_path / "test.jsonl"))
        assert a.posthoc and a.label.startswith(f"heuristic:{spec.split(':')[1]}") and a.n_train == 10
    assert get_auditor("heuristic:last-step").rule == "last-step"        # the others are untouched
    assert len(train_split_of(tmp_path)) == 10
    with pytest.raises(ValueError, match="no train split"):
        train_split_of(tmp_path / "nowhere" / "test.jsonl")
    with pytest.raises(ValueError, match="unknown option"):
        get_auditor("heuristic:length,seed=3", data=str(tmp_path / "test.jsonl"))
    with pytest.raises(ValueError, match="floor auditor needs"):
        get_auditor("floor:median")
    got = get_auditor(f"heuristic:position-prior,train={tmp_path / 'train.jsonl'}")
    assert got.prior["math"] == ("abs", 3)
    m = floor_metrics(tmp_path / "test.jsonl", test, n_boot=0)
    assert tuple(m) == FLOOR_SPECS
    assert m["heuristic:position-prior"]["step_acc"] == 1.0 and m["heuristic:position-prior"]["far"] == 1.0
    # without a train split (Who&When) only the lexical rule, which fits nothing, is scored
    far = floor_metrics(tmp_path / "nowhere.jsonl", test)
    assert [k for k, g in far.items() if "skipped" not in g] == ["heuristic:lexical"]


def test_eval_report_shows_the_floors_beside_the_auditor(tmp_path):
    from aftraj.cli import main

    train = [_traj(i, 10, 3) for i in range(10)] + [_traj(50 + i, 10, None) for i in range(3)]
    test = [_traj(100 + i, 10, 3 if i % 2 else None) for i in range(10)]
    write_jsonl(train, tmp_path / "train.jsonl")
    write_jsonl(test, tmp_path / "test.jsonl")
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(tmp_path / "test.jsonl"), "--out",
                 str(tmp_path / "ev"), "--no-progress", "--n-boot", "10"]) == 0
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["floors"]["heuristic:position-prior"]["exact_f1"] == pytest.approx(2 * 5 / (10 + 5))
    report = (tmp_path / "ev" / "report.md").read_text()
    assert "## Floors" in report and "heuristic:length" in report and "dummy:gold (under test)" in report
    # every floor is in the table, and the run is compared to the best one on the same runs
    assert all(f"| {spec} |" in report for spec in FLOOR_SPECS)
    vs = metrics["vs_best_floor"]
    assert vs["floor"] == "heuristic:position-prior"          # 2*5/(10+5) beats the others here
    assert vs["exact_f1"]["diff"] == pytest.approx(1.0 - 2 * 5 / 15) and vs["exact_f1"]["ci"] is not None
    assert "Paired difference, dummy:gold minus the best floor here (heuristic:position-prior)" in report
    # a floor under test gets no second copy of itself
    assert main(["eval", "--auditor", "heuristic:length", "--data", str(tmp_path / "test.jsonl"), "--out",
                 str(tmp_path / "ev2"), "--no-progress", "--n-boot", "10"]) == 0
    assert "floors" not in json.loads((tmp_path / "ev2" / "metrics.json").read_text())
