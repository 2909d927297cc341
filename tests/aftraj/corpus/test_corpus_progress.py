"""`corpus build` and `corpus verify` (3 and 4.5 minutes on the 2k config, loaded machine) report
counts and an ETA (aftraj.console.progress): without a terminal, a line every few seconds and
one at the end, never a line per task (issue 25)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEMO = str(REPO / "configs" / "corpus" / "demo-small.yaml")


def test_build_and_verify_report_progress_without_a_tty(tmp_path, capsys):
    import yaml

    from aftraj.cli import main

    cfg = yaml.safe_load(Path(DEMO).read_text())
    cfg["tasks"] = {"math": 12, "coding": 6, "agentic": 12, "humaneval": False}   # seconds, not minutes
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "c"
    assert main(["corpus", "build", "--config", str(small), "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert any(re.match(r"corpus build: \d+ tasks; running the coding tasks' unit-test suites", x) for x in err)
    assert any(re.match(r"corpus build: \d+ \(code, suite\) pairs tested in \d+ s", x) for x in err)
    done = [x for x in err if x.startswith("corpus build: rollouts: ")]
    n = int(re.match(r"corpus build: rollouts: (\d+)/\1 task \(100 %\)", done[-1]).group(1))
    assert 1 <= len(done) < n       # the default interval: lines every few seconds, not one per task
    assert len(done) == 1 or "ETA" in done[0]
    assert main(["corpus", "verify", "--config", str(small), "--corpus", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert re.match(r"corpus verify: (\d+)/\1 run \(100 %\), \d+s elapsed", err[-1]), err
    assert main(["corpus", "build", "--config", str(small), "--out", str(tmp_path / "d"), "--no-progress"]) == 0
    assert "corpus build:" not in capsys.readouterr().err
