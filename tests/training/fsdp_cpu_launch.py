"""Run the stage-1 entry point (`python -m training.stage1 ARGS`) on CPU ranks through
accelerate's FSDP1 path, as the two-rank CPU tests do:

    ACCELERATE_USE_CPU=1 accelerate launch --config_file CPU_VARIANT.yaml tests/training/fsdp_cpu_launch.py ARGS

accelerate 1.15 selects FSDP only for GPU-type process groups (`AcceleratorState` turns
MULTI_GPU into FSDP; MULTI_CPU never is), so this wrapper relabels the CPU group as MULTI_GPU
right after accelerate forms it (gloo, on CPU); everything else (the env-var FSDP plugin
from `accelerate launch`, `FSDP(...)` wrapping with device_id=cpu, sharded checkpoints) is
accelerate's own code. The CPU variant of the launch config comes from
`training.accelerate_config.cpu_variant` (no `sync_module_states`, which needs a GPU).
"""

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from torch.distributed.fsdp._flat_param import FlatParamHandle  # noqa: E402

_orig_init = PartialState.__init__


def _init(self, cpu: bool = False, **kwargs):
    _orig_init(self, cpu, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.MULTI_GPU
        # accelerate names the CPU device `cpu:0`; FSDP1 takes a CPU module's compute device as `cpu`
        self.device = torch.device("cpu")


PartialState.__init__ = _init


# torch 2.13's FSDP1 `FlatParamHandle.to_cpu` (state-dict `offload_to_cpu=True`, which accelerate
# uses for full and sharded state dicts) moves the unsharded flat parameter to the CPU and frees
# the unsharded storage; when the compute device *is* the CPU the move is a no-op, so it frees
# the very storage the parameter views ("setStorage ... storage of size 0"). On CPU ranks there
# is nothing to offload: skip it. GPU runs never reach this wrapper.
@contextlib.contextmanager
def _to_cpu_on_cpu(self):
    if self.flat_param.device.type == "cpu":
        yield
        return
    with _orig_to_cpu(self):
        yield


_orig_to_cpu = FlatParamHandle.to_cpu
FlatParamHandle.to_cpu = _to_cpu_on_cpu

from training.stage1.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
