"""benchmarks/walk_speed.py: every variant walks to the same records as this build's walk."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_walk_speed_variants_agree(tiny_model_dir, make_traj, tmp_path):
    from aftraj.schema import write_jsonl

    data = tmp_path / "runs.jsonl"
    write_jsonl([make_traj(0, 7, 3), make_traj(1, 5, None), make_traj(2, 6, None, "coding")], data)
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "walk_speed.py"), "--model",
                          str(tiny_model_dir), "--data", str(data), "--sample", "3", "--batch", "4",
                          "--max-new-tokens", "6", "--threads", "1"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = re.findall(r"variant=(\S+) s=[\d.]+ ratio_to_now=[\d.]+ same_records=(true|false)", out.stdout)
    assert [v for v, _ in lines] == ["now", "no-lookahead", "fixed-drafts", "gqa-copy", "before"]
    assert all(same == "true" for _, same in lines), out.stdout
    assert re.search(r"^load_avg=[\d.]+,[\d.]+,[\d.]+$", out.stdout, re.M)
