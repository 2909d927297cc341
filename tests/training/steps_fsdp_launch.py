"""Run `aftraj train steps` (the driver: training, then the val calibration) on CPU ranks through
accelerate's FSDP1 path, with the two CPU workarounds of tests/training/fsdp_cpu_launch.py (loaded
from there, not copied):

    ACCELERATE_USE_CPU=1 accelerate launch --config_file CPU_VARIANT.yaml tests/training/steps_fsdp_launch.py ARGS
"""

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
_spec = importlib.util.spec_from_file_location("fsdp_cpu_launch", HERE / "fsdp_cpu_launch.py")
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))     # the patches, applied at import

from aftraj.drivers.steps import run  # noqa: E402
from training.steps.cli import add_arguments  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    raise SystemExit(run(p.parse_args(sys.argv[1:])))
