"""Issue 23 (10): CLI bad input is one line on stderr and exit 2, never a traceback or a hang:
`convert --out` into a missing folder or onto its own input, `summary /dev/zero`, a structural
monitor.json that is `[]` or lacks `config`. (The `serve` cases: tests/serve/test_gateway_hardening.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aftraj.cli import main

REPO = Path(__file__).resolve().parents[2]
ROW = {"id": "t1", "family_id": "f", "domain": "math", "source": "s", "task": "t",
       "steps": [{"index": 0, "agent": "a", "kind": "message", "content": "x"}], "termination": "completed",
       "outcome": "success", "label": {"verdict": "SAFE", "source": "verified_safe"}}


def _one_line(capsys, args):
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (rc, err)
    return err


def test_convert_out_into_a_missing_folder_is_refused(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("")
    err = _one_line(capsys, ["convert", "--from", "jsonl", str(src), "--out", str(tmp_path / "no" / "dir" / "x.jsonl")])
    assert "does not exist" in err and not (tmp_path / "no").exists()


def test_convert_out_onto_its_own_input_is_refused(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("not json\n")
    before = src.read_bytes()
    err = _one_line(capsys, ["convert", "--from", "jsonl", str(src), "--out", str(src), "--skip-invalid"])
    assert "input itself" in err and src.read_bytes() == before


def test_summary_of_dev_zero_does_not_hang():
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "summary", "/dev/zero"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "regular file" in r.stderr, r.stderr


@pytest.mark.parametrize("meta", [[], {"format_version": 1}])
def test_structural_monitor_json_without_config_is_one_line(tmp_path, capsys, meta):
    from aftraj.structural.monitor import StructuralMonitor
    from aftraj.errors import UsageError
    (tmp_path / "monitor.json").write_text(json.dumps(meta))
    with pytest.raises(UsageError, match="refit"):
        StructuralMonitor.load(tmp_path)
