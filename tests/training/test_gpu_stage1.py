"""The production stage-1 settings on a GPU (marker `gpu`: needs CUDA, bitsandbytes' 8-bit AdamW
and bf16), plus the same script's code path on CPU, shrunk (default suite)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^gpu_stage1: steps=(\d+) median_step_s=([\d.]+) peak_mem_gib=(\S+) params_m=(\d+) "
                  r"prompt_tokens_max=(\d+) loss_first=(\S+) loss_last=(\S+)$", re.M)


def test_gpu_check_code_path_on_cpu_tiny():
    from training.stage1.gpu_check import main

    assert main(["--tiny", "--steps", "3"]) == 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_refuses_without_cuda():
    from training.stage1.gpu_check import main

    with pytest.raises(SystemExit, match="no CUDA"):
        main([])


@pytest.mark.gpu
def test_gpu_stage1_production_settings_five_steps():
    """bash scripts/gpu_stage1_check.sh on one H200: 5 steps, bf16, checkpointing, 8-bit AdamW."""
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_stage1_check.sh")], cwd=REPO, text=True,
                       capture_output=True, timeout=1200, env=None)
    sys.stdout.write(r.stdout[-4000:])
    assert r.returncode == 0, r.stderr[-4000:]
    m = LINE.search(r.stdout)
    assert m, "no gpu_stage1 summary line"
    steps, _, peak, params, prompt_max, first, last = m.groups()
    assert int(steps) == 5 and float(peak) > 0 and int(params) > 200 and int(prompt_max) > 4000
    assert float(first) == pytest.approx(0.6931, abs=1e-3)
