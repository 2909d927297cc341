"""The console carries no library notice a user cannot act on (aftraj/console.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import logging, warnings, aftraj.commands
logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward from kernels-community")
logging.getLogger("transformers.modeling_utils").warning("Removed shared tensor {'lm_head.weight'} while saving")
# accelerate's own save (Accelerator.save_model): its MultiProcessAdapter prefixes "[RANK 0]"
from accelerate.logging import get_logger
from accelerate.state import PartialState
PartialState()
get_logger("accelerate.utils.other").warning("Removed shared tensor {'base_model.model.lm_head.weight'} while saving (accelerate)", main_process_only=False)
logging.getLogger("transformers.modeling_utils").warning("a warning that matters")
warnings.warn_explicit("`is_gradient_checkpointing` is deprecated", FutureWarning, "x.py", 1, module="transformers.modeling_utils")
warnings.warn_explicit("our own deprecation", FutureWarning, "y.py", 1, module="aftraj.prompt")
import os; print(os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"))
"""


def _run(env_extra=None):
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env)


def test_library_noise_is_silenced_and_the_rest_shows():
    r = _run()
    assert r.returncode == 0, r.stderr
    assert "kernels-community" not in r.stderr and "shared tensor" not in r.stderr
    assert "(accelerate)" not in r.stderr
    assert "is_gradient_checkpointing" not in r.stderr
    assert "a warning that matters" in r.stderr and "our own deprecation" in r.stderr
    assert r.stdout.strip() == "1"


def test_verbose_switch_keeps_everything():
    r = _run({"AFTRAJ_VERBOSE_LIBRARIES": "1"})
    assert "kernels-community" in r.stderr and "is_gradient_checkpointing" in r.stderr
    assert "(accelerate)" in r.stderr
