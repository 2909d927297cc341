"""training/stage2/gpu_check.py without CUDA refuses to run (its CPU path, --tiny, and the GPU run are
phase 2 of scripts/gpu_check.sh: tests/training/test_gpu_check_script.py)."""

from __future__ import annotations

import pytest


def test_gpu_check_refuses_without_cuda(monkeypatch):
    import torch

    from training.stage2.gpu_check import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # a GPU machine runs it too

    with pytest.raises(SystemExit, match="no CUDA"):
        main([])
