"""training/stage2/gpu_check.py without CUDA refuses to run (its CPU path, --tiny, and the GPU run are
phase 2 of scripts/gpu_check.sh: tests/training/test_gpu_check_script.py)."""

from __future__ import annotations

import pytest


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_refuses_without_cuda():
    from training.stage2.gpu_check import main

    with pytest.raises(SystemExit, match="no CUDA"):
        main([])
