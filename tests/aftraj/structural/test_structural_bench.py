"""benchmarks/structural.py runs and prints its last line (hashing embedder, synthetic runs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_structural_benchmark_small(synthetic_runs, tmp_path):
    from aftraj.schema import write_jsonl

    write_jsonl(synthetic_runs, tmp_path / "runs.jsonl")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "structural.py"), "--data",
                          str(tmp_path / "runs.jsonl"), "--embedder", "hashing", "--queries", "50"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"fit_s=([\d.]+) query_p50_ms=([\d.]+) query_p99_ms=([\d.]+)", last)
    assert m, last
    assert float(m.group(2)) <= float(m.group(3))
    assert f"{len(synthetic_runs)} trajectories" in out.stdout
