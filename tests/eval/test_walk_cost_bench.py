"""benchmarks/walk_cost.py runs and its two walks agree token for token (marker `slow`: ~1 min)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_walk_cost_benchmark_small():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "walk_cost.py"), "--steps", "20",
                          "--trajectories", "2", "--hidden-size", "64", "--max-new-tokens", "4",
                          "--batch-size", "2", "--compare-cache"],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"walk_reencode_s=([\d.]+) walk_reuse_s=([\d.]+) ratio=([\d.]+) "
                     r"verdicts_equal=(true|false)", last)
    assert m, last
    assert m.group(4) == "true"
    b = re.search(r"batched_equal=(\d+)/(\d+)", out.stdout)
    assert b and b.group(1) == b.group(2) == "40", out.stdout[-500:]   # 2 runs x 20 prefixes
    c = re.search(r"cache_dynamic_s=[\d.]+ cache_slack_s=[\d.]+ cache_speedup=[\d.]+ batched_dynamic_s=[\d.]+ "
                  r"batched_slack_s=[\d.]+ batched_cache_speedup=[\d.]+ cache_equal=(true|false)", out.stdout)
    assert c and c.group(1) == "true", out.stdout[-800:]
