"""`aftraj.released`, the one module of the released AFTraj-2K layout, in both directions: runs of
ours exported and read back are the same runs (steps, tools, labels, splits, families), a second
export of what was read writes the same rows, and the unsafe_source mapping goes both ways.
(The release's own rows round-trip byte for byte: tests/aftraj/test_aftraj_parquet.py.)"""

from __future__ import annotations

import pyarrow.parquet as pq

from aftraj.released import LABEL_SOURCE, UNSAFE_SOURCE, iter_aftraj_parquet, write_aftraj_parquet
from aftraj.schema import Label, Step, Trajectory


def _run(i: int, source: str | None) -> Trajectory:
    steps = [Step(index=0, agent="user", kind="message", content=f"Task {i}: compute 6*7."),
             Step(index=1, agent="Solver", kind="tool_call", content="", tool="python",
                  arguments={"code": "print(6*7)"}, thought="run it"),
             Step(index=2, agent="environment", kind="tool_result", content="42", tool="python"),
             Step(index=3, agent="Checker", kind="message", content="The answer is 42.")]
    label = (Label(verdict="SAFE", label_source="verified_safe") if source is None else
             Label(verdict="UNSAFE", label_source=source, decisive_step=3, decisive_agent="Checker",
                   reason="Checker misreads the result."))
    return Trajectory(id=f"run-{i}", family_id=f"fam-{i // 2}", domain="math", source="ours",
                      task=f"Task {i}: compute 6*7.", steps=steps, label=label,
                      outcome="success" if source is None else "failure", reference_answer="42",
                      meta={"split": ("train", "val", "test")[i % 3]})


def _same_run(a: Trajectory, b: Trajectory) -> None:
    assert (a.id, a.family_id, a.domain, a.task, a.reference_answer, a.meta["split"]) == \
        (b.id, b.family_id, b.domain, b.task, b.reference_answer, b.meta["split"])
    assert (a.label.verdict, a.label.label_source, a.label.decisive_step, a.label.decisive_agent, a.label.reason) == \
        (b.label.verdict, b.label.label_source, b.label.decisive_step, b.label.decisive_agent, b.label.reason)
    assert [(s.agent, s.kind, s.content, s.tool, s.arguments, s.thought) for s in a.steps] == \
        [(s.agent, s.kind, s.content, s.tool, s.arguments if s.kind == "tool_call" else None, s.thought)
         for s in b.steps]


def test_export_then_read_gives_the_same_runs_and_a_second_export_the_same_rows(tmp_path):
    ours = [_run(0, None), _run(1, "injected"), _run(2, "diagnosed"), _run(3, None), _run(4, "injected")]
    counts = write_aftraj_parquet(ours, None, tmp_path / "a")
    assert counts == {"aftraj_safe.parquet": 2, "aftraj_unsafe.parquet": 3}
    back = {t.id: t for t in iter_aftraj_parquet(tmp_path / "a")}
    assert sorted(back) == sorted(t.id for t in ours)
    for t in ours:
        _same_run(back[t.id], t)
    write_aftraj_parquet([back[t.id] for t in ours], None, tmp_path / "b")
    for name in counts:
        assert pq.read_table(tmp_path / "b" / name).to_pylist() == pq.read_table(tmp_path / "a" / name).to_pylist()
    assert list(iter_aftraj_parquet(tmp_path / "b")) == list(iter_aftraj_parquet(tmp_path / "a"))


def test_unsafe_source_maps_both_ways():
    # every spelling the release uses reads as one of our sources, which is written back as a
    # spelling that reads as the same source
    assert set(LABEL_SOURCE.values()) == set(UNSAFE_SOURCE)
    for spelling, ours in LABEL_SOURCE.items():
        assert LABEL_SOURCE[UNSAFE_SOURCE[ours]] == ours, spelling
