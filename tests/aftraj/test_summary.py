"""`aftraj summary`: counts recomputed independently from the raw Who&When files."""

from __future__ import annotations

import json
import subprocess
import sys

from aftraj.summary import summarise


def test_summary_counts_match_raw_files(ww_dir, ww_trajs):
    s = summarise(ww_trajs)
    for subset in ("Algorithm-Generated", "Hand-Crafted"):
        raws = [json.loads(f.read_text()) for f in (ww_dir / subset).glob("*.json")]
        assert s[subset]["trajectories"] == len(raws)
        assert s[subset]["steps_total"] == sum(len(r["history"]) for r in raws)
        ks = [int(r["mistake_step"]) for r in raws]
        assert sum(s[subset]["decisive_step_hist"].values()) == len(raws)
        assert abs(s[subset]["decisive_step_mean"] - sum(ks) / len(ks)) < 1e-9
        assert s[subset]["unsafe"] == len(raws) and s[subset]["safe"] == 0
    assert s["all"]["trajectories"] == 184


def test_summary_cli(ww_dir):
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "summary", str(ww_dir), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["Algorithm-Generated"]["trajectories"] == 126 and s["Hand-Crafted"]["trajectories"] == 58
