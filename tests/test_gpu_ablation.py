"""scripts/gpu_ablation.sh, a plain script for a GPU node of one's own (issue 46 item 4): its shape,
the GPU configs' sizes, and (ablation_e2e) the whole CPU path on the tiny model. The GPU path
itself has not run anywhere yet.

    nice -n 15 .venv/bin/python -m pytest tests/test_gpu_ablation.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_ablation.sh"


def test_the_script_is_plain(tmp_path):
    """A script for a node of one's own: the project's environment (setup.sh, or a wheel folder),
    no payload parts, no budget, no store; a bad argument prints the usage."""
    text = SCRIPT.read_text()
    for gone in ("part_bytes", "gpu_ablation_parts", "AFTRAJ_GPU_STORE", "GPU_ABLATION_BUDGET_S", "gpu_site"):
        assert gone not in text, gone
    assert "bash scripts/setup.sh" in text and 'PIP_FIND_LINKS="$WHEELS"' in text
    assert not (REPO / "scripts" / "gpu_ablation_parts.py").exists()
    r = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "WHEELS=/path/to/wheels" in r.stderr


def test_gpu_configs_ask_for_the_full_design():
    from aftraj.drivers.ablation import load_config
    from training.stage1.config import load_stage1_config

    c = load_config(REPO / "configs" / "ablation" / "gpu-h200.yaml")
    assert c.corpus_config == "configs/corpus/aftraj-2k-scripted.yaml"
    assert c.heldout_sample >= 10_000 and c.ww_sample >= 184          # the whole test split and Who&When
    assert c.probe_max_post_tokens is None and c.probe_runs is None and c.linear_probe_rows
    assert "stage 1 + 2" in c.model_rows and not c.stage1_set
    s1 = load_stage1_config(REPO / c.stage1_config)
    assert s1.max_pairs is None and s1.max_post_tokens is None and s1.num_epochs >= 2
    assert s1.finetune == "full" and s1.trainable_layers is None and s1.mixed_precision == "bf16"
    assert s1.weight_twin > 0 and s1.decision_coef > 0 and s1.samples_per_prompt == 0
    # the every-prefix row on every train run, its threshold from its own held-out val rows
    from training.prefixes.config import load_prefixes_config

    assert "every prefix" in c.model_rows and c.threshold_rows == ["every prefix"]
    assert c.threshold_from == "heldout rows" and "heldout_split=val" in c.prefixes_set
    assert c.canonical_finish_rows == ["every prefix"]     # it trains the decision token only
    px = load_prefixes_config(REPO / c.prefixes_config)
    assert px.max_unsafe_runs is None and px.max_safe_runs is None and px.max_prompt_tokens >= 4096
    for f in (c.warmup_config, c.stage1_config, c.stage2_config):     # no tracker: no tensorboard wheel
        assert "report_to: []" in (REPO / f).read_text() or "report_to" not in (REPO / f).read_text()


# the whole CPU path of gpu_ablation.sh (corpus, warm-up, stage 1, TRL stage 2, probes, walks: ~20
# subprocesses, ~30 min on the 2-core machine): outside the default suite, run with
#   bash scripts/test.sh -m ablation_e2e tests/test_gpu_ablation.py
@pytest.mark.slow
@pytest.mark.ablation_e2e
def test_cpu_check_runs_end_to_end(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--cpu-check", str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=3600, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "finished=yes" in r.stdout
    summary = json.loads((tmp_path / "out" / "report" / "ablation.json").read_text())
    assert set(summary["results"]["heldout"]) >= {"warmed base", "stage 1", "stage 1 + 2", "every prefix"}
    assert "every prefix" in summary["thresholds"]
