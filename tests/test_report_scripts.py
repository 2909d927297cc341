"""The scripts that regenerate a committed report's data (`eval/controls.py`, the ladder's
controls; `aftraj/drivers/ladder_report.py`, the ladder's table): a missing input is one line on
stderr naming the option and the path, exit status 2, before any model loads (the project's error
rule, aftraj/guard.py), not a traceback from open(); the ladder is recombined from probe files.
No code lives under reports/ (issue 48)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aftraj.guard import run_guarded

REPO = Path(__file__).resolve().parents[1]


def _argv(tmp_path: Path, missing: str) -> tuple[list[str], Path]:
    good = tmp_path / "runs.jsonl"
    good.write_text("{}\n")
    args = {"--tokenizer": str(tmp_path), "--train": str(good), "--heldout": str(good)}
    gone = tmp_path / "gone" / ("out.json" if missing == "--out" else "x.jsonl")
    args[missing] = str(gone)
    return [x for kv in args.items() for x in kv], gone


def test_controls_script_names_a_missing_input(tmp_path):
    """The script as run from the shell."""
    argv, gone = _argv(tmp_path, "--train")
    r = subprocess.run([sys.executable, "-m", "eval.controls", *argv], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"controls.py: --train {gone}: no such file"], r.stderr[-2000:]


@pytest.mark.parametrize("missing", ["--tokenizer", "--train", "--heldout", "--out"])
def test_controls_checks_every_input_first(missing, tmp_path, capsys):
    from eval import controls

    argv, gone = _argv(tmp_path, missing)
    assert run_guarded(controls._cli, argv, "controls.py") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"controls.py: {missing} {gone}"), err


def _tracked_reports() -> list[Path]:
    if not (REPO / ".git").exists():        # an unpacked archive: every file there counts (stricter)
        return [p for p in (REPO / "reports").rglob("*") if p.is_file()]
    out = subprocess.run(["git", "ls-files", "-z", "reports"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / f for f in out.decode().split("\0") if f and (REPO / f).exists()]


def test_reports_hold_summaries_only():
    """No code under reports/ (it lives in the packages) and no committed file over 100 KB (a
    walk's predictions, a training log: they stay under runs/, git history keeps the old ones)."""
    files = _tracked_reports()
    assert files, "reports/ holds no tracked file"
    code = [str(f.relative_to(REPO)) for f in files if f.suffix == ".py"]
    assert not code, f"code belongs in the packages, not in reports/: {code}"
    big = [f"{f.relative_to(REPO)} ({f.stat().st_size // 1024} KB)" for f in files if f.stat().st_size > 100 * 1024]
    assert not big, f"files over 100 KB under reports/: {big}"


def _run_with_twin(i: int, k: int):
    """An unsafe run (step k says "wrong") and its verified-safe twin (same family, same steps)."""
    from aftraj.schema import Label, Step, Trajectory

    def steps(bad: bool):
        return [Step(index=j, agent="user" if j == 0 else "Solver", kind="message",
                     content=f"run {i} step {j}" + (" wrong" if bad and j == k else "")) for j in range(k + 2)]
    unsafe = Trajectory(id=f"u{i}", family_id=f"f{i}", domain="math", source="test", task="t", steps=steps(True),
                        label=Label("UNSAFE", "injected", decisive_step=k, decisive_agent="Solver", reason="r"))
    twin = Trajectory(id=f"s{i}", family_id=f"f{i}", domain="math", source="test", task="t", steps=steps(False),
                      label=Label("SAFE", "verified_safe"))
    return [unsafe, twin]


def test_ladder_report_recombines_probe_files(tmp_path, capsys):
    """Two probe files of one row (two splits) give one row over all their runs, the content-blind
    rules recomputed on the same runs; a row probed on other runs, or a missing file, is a one-line
    error."""
    from aftraj.drivers import ladder_report
    from aftraj.schema import write_jsonl
    from eval.probe import CONTENT_BLIND_RULES, probe

    trajs = [t for i in range(4) for t in _run_with_twin(i, 1 + i % 2)]
    heldout = tmp_path / "heldout.jsonl"
    write_jsonl(trajs, heldout)

    def reads(messages, t, alarm):
        return {"decision": 1.0 if " wrong" in messages[-1]["content"] else -1.0}

    files = []
    for half in (trajs[:4], trajs[4:]):
        f = tmp_path / f"probe{len(files)}.json"
        f.write_text(json.dumps(probe(half, reads, budget=None, count_tokens=len, n_boot=0)))
        files.append(str(f))
    argv = [json.dumps({"model": files}), "", str(tmp_path), "test split", str(heldout)]
    assert run_guarded(ladder_report.main, argv, "ladder_report") == 0
    out = json.loads((tmp_path / "ladder.json").read_text())
    assert out["sources"]["model"]["n_runs"] == 4
    assert out["rows"]["model"]["post_beats_twin"]["share"] == 1.0 and out["rows"]["model"]["post_beats_twin"]["n"] == 4
    for name in CONTENT_BLIND_RULES:
        assert out["rows"][name]["n_runs"] == 4 and out["rows"][name]["post_beats_twin"]["share"] == 0.5, name
    assert "| model | 4 |" in (tmp_path / "ladder.md").read_text()
    capsys.readouterr()
    other = json.dumps({"model": files, "other": files[:1]})
    assert run_guarded(ladder_report.main, [other, "", str(tmp_path), "x", str(heldout)], "ladder_report") == 2
    assert "'other' was probed on other runs" in capsys.readouterr().err
    gone = str(tmp_path / "gone.json")
    assert run_guarded(ladder_report.main, [json.dumps({"model": [gone]}), "", str(tmp_path)], "ladder_report") == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"ladder_report: row 'model': {gone}: no such file"]
