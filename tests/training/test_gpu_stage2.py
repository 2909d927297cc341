"""The stage-2 TRL path on a GPU (marker `gpu`: 2 GRPO steps, bf16, one H200; not run on the
machines this was written on, none had a GPU), plus the same script's code path on CPU, shrunk."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^gpu_stage2: steps=(\d+) median_step_s=([\d.]+) peak_mem_gib=(\S+) params_m=(\d+) "
                  r"completion_tokens=(\d+) reward_first=(\S+) kl_last=(\S+)$", re.M)


def test_gpu_check_code_path_on_cpu_tiny(capsys):
    from training.stage2.gpu_check import main

    assert main(["--tiny", "--steps", "2"]) == 0
    m = LINE.search(capsys.readouterr().out)
    assert m and int(m.group(1)) == 2 and int(m.group(5)) == 16


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
    m = LINE.search(r.stdout)
    assert m, "no gpu_stage2 summary line"
    steps, step_s, peak, params, completion, reward_first, kl_last = m.groups()
    assert int(steps) == 2 and float(step_s) > 0 and 0 < float(peak) < 139 and int(params) > 200
    assert int(completion) == 512 and math_finite(reward_first) and float(kl_last) >= 0


def math_finite(x: str) -> bool:
    import math

    return math.isfinite(float(x))
