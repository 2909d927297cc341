"""The scripts committed beside a report (reports/*/): a missing input is one line on stderr naming
the option and the path, exit status 2, before any model loads (the project's error rule,
aftraj/guard.py), not a traceback from open()."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from aftraj.guard import run_guarded

REPO = Path(__file__).resolve().parents[1]
CONTROLS = REPO / "reports" / "ablation-cpu" / "controls.py"


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
    r = subprocess.run([sys.executable, str(CONTROLS), *argv], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"controls.py: --train {gone}: no such file"], r.stderr[-2000:]


@pytest.mark.parametrize("missing", ["--tokenizer", "--train", "--heldout", "--out"])
def test_controls_checks_every_input_first(missing, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("_report_controls", CONTROLS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv, gone = _argv(tmp_path, missing)
    assert run_guarded(mod._cli, argv, "controls.py") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"controls.py: {missing} {gone}"), err
