"""`bash scripts/demo.sh --quick` (what CI runs of the demo): the whole pipeline on a random tiny
model, from corpus to report. Every number in the report comes from the evaluations this run
wrote; the report names model, corpus sizes, steps and seeds; no process is left running."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from aftraj.drivers import ablation as ab

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-quick")
    out, report = root / "out", root / "report"
    env = dict(os.environ, OUT=str(out), REPORT=str(report))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh"), "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, report, proc.stdout


def test_report_rows_come_from_the_runs_evaluations(quick_run):
    out, report, stdout = quick_run
    s = json.loads((report / "ablation.json").read_text())
    assert set(s["results"]) == {"heldout", "ww"}
    for target, rows in s["results"].items():
        # quick.yaml names every model row, the opt-in "every prefix" one too
        assert list(rows) == [*ab.MODEL_ROWS, *ab.BASELINE_ROWS]
        for row, r in rows.items():
            m = json.loads((out / "ablation" / "eval" / target / ab.row_slug(row) / "metrics.json").read_text())
            for k, _, _ in ab.COLUMNS:
                assert r["overall"][k] == m["overall"][k], (target, row, k)
            assert r["overall"]["n"] == (s["config"]["raw_base_sample"] or s["config"][
                "heldout_sample" if target == "heldout" else "ww_sample"]
                if row == "raw base" else s["config"]["heldout_sample" if target == "heldout" else "ww_sample"])
    md = (report / "ablation.md").read_text()
    assert "builtin:tiny-qwen2" in md and "seed 0" in md and "## Wall time per phase" in md
    for phase in ("corpus", "warmup", "stage 1", "stage 2", "stage 1 + 2", "every prefix",
                  "tune threshold every prefix", "step-scored"):
        assert f"| {phase} |" in md
    # the every-prefix row's threshold came from its held-out rows (no val walk), and both of its
    # walks decided at it
    th = json.loads((out / "ablation" / "eval" / "val" / "every_prefix-threshold" / "threshold.json").read_text())
    assert th["run"].endswith("prefixes") and "heldout_rows" in th and "| val walk every prefix |" not in md
    assert s["thresholds"]["every prefix"]["threshold"] == th["pick"]["threshold"]
    for target in ("heldout", "ww"):
        m = json.loads((out / "ablation" / "eval" / target / "every_prefix" / "metrics.json").read_text())
        assert m["provenance"]["auditor_settings"]["decision_threshold"] == th["pick"]["threshold"], target
    # the step-scored row walked with hf-steps at the threshold stored with its checkpoint
    cal = json.loads((out / "ablation" / "steps" / "final" / "steps_calibration.json").read_text())
    for target in ("heldout", "ww"):
        m = json.loads((out / "ablation" / "eval" / target / "step-scored" / "metrics.json").read_text())
        assert m["auditor"].startswith("hf-steps"), m["auditor"]
    assert "- step-scored (not in the paper):" in md and f"threshold {cal['threshold']}" in md
    assert (report / "compare-heldout" / "compare.md").is_file()
    assert "Report: " in stdout


def test_training_phases_ran_their_steps(quick_run):
    out, _, _ = quick_run
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml")
    # run.json records seeds and invocations; the steps are in the trainer's own log
    rows = [json.loads(line) for line in (out / "ablation" / "stage2" / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    assert max(r["step"] for r in rows if "step" in r) == cfg.stage2_steps
    assert (out / "ablation" / "warmup" / "final" / "config.json").is_file()
    assert (out / "ablation" / "stage1" / "final" / "config.json").is_file()
    assert json.loads((out / "ablation" / "stage12" / "selection.json").read_text())["chosen"]
    for row in cfg.model_rows:                                    # quick.yaml keeps the probe on
        if row in ab.STEP_ROWS:                                   # read through its tagged reading: not probed
            assert not (out / "ablation" / "probe" / ab.row_slug(row)).exists()
            continue
        probe = json.loads((out / "ablation" / "probe" / ab.row_slug(row) / "probe.json").read_text())
        assert probe["summary"]["n_runs"] >= 1


def test_no_process_is_left_running(quick_run):
    out, _, _ = quick_run
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out) not in ps
