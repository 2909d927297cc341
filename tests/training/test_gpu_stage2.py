"""The stage-2 TRL path on a GPU (marker `gpu`: a format warm-start, 2 GRPO steps, bf16, one H200;
not run on the machines this was written on, none had a GPU), plus the same code path on CPU, shrunk."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
def _figures(out: str) -> dict[str, str]:
    """The check's `key=value` lines."""
    return dict(m.groups() for m in re.finditer(r"^([a-z_]+)=(.*)$", out, re.M))


def test_gpu_check_code_path_on_cpu_tiny(capsys, tmp_path):
    """The warm-start gives the reward a spread within a group, so GRPO has a non-zero advantage
    and moves the parameters (a random model alone is malformed everywhere: advantage 0)."""
    import json

    from training.stage2.gpu_check import main

    assert main(["--tiny", "--steps", "2", "--figures-dir", str(tmp_path)]) == 0
    fig = _figures(capsys.readouterr().out)
    saved = json.loads((tmp_path / "gpu_stage2.json").read_text())
    assert int(fig["steps"]) == saved["steps"] == 2 and saved["completion_tokens"] == 96
    assert saved["reward_std_max"] > 0 and saved["params_changed"] > 0 and saved["max_param_change"] > 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_refuses_without_cuda():
    from training.stage2.gpu_check import main

    with pytest.raises(SystemExit, match="no CUDA"):
        main([])


@pytest.mark.gpu
def test_gpu_stage2_two_grpo_steps_bf16():
    """bash scripts/gpu_stage2_check.sh on one H200: 2 GRPO steps, bf16, 8 × 512-token completions."""
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_stage2_check.sh")], cwd=REPO, text=True,
                       capture_output=True, timeout=1200)
    sys.stdout.write(r.stdout[-4000:])
    assert r.returncode == 0, r.stderr[-4000:]
    f = _figures(r.stdout)
    assert int(f["steps"]) == 2 and float(f["median_step_s"]) > 0 and 0 < float(f["peak_mem_gib"]) < 139
    assert float(f["params_m"]) > 200 and int(f["completion_tokens"]) == 512 and math_finite(f["reward_first"])
    assert float(f["reward_std_max"]) > 0 and int(f["params_changed"]) > 0 and float(f["kl_last"]) >= 0


def math_finite(x: str) -> bool:
    import math

    return math.isfinite(float(x))
