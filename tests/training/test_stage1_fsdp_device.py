"""Stage 1 on two GPUs: the FSDP plugin must record each rank's own device.

accelerate 1.15's `FullyShardedDataParallelPlugin.__post_init__` with `sync_module_states` (forced
on by `cpu_ram_efficient_loading`, both set by configs/accelerate/fsdp-2xh200.yaml) builds
`param_init_fn = lambda m: m.to_empty(device=torch.cuda.current_device())` AT CONSTRUCTION. Built
before the rank's device is set, every rank records cuda:0 and FSDP on rank 1 raises
"Inconsistent compute device and device_id". Two ranks are mocked here (CUDA calls replaced by a
per-process current device, the launch's environment variables set, `Accelerator` captured), and
the device that `make_accelerator`'s plugin initialises modules on is read per rank.

    pytest tests/training/test_stage1_fsdp_device.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


class _FakeCuda:
    """One process's CUDA runtime: the current device starts at 0 (as in a fresh process)."""

    def __init__(self, n: int):
        self.n, self.current = n, 0

    def set_device(self, d) -> None:
        self.current = d.index if isinstance(d, torch.device) else int(d)

    def current_device(self) -> int:
        return self.current


class _Module:
    def __init__(self):
        self.device = None

    def to_empty(self, *, device, recurse=True):
        self.device = device
        return self


def _plugin_device_on_rank(monkeypatch, rank: int, world: int = 2):
    import accelerate
    import accelerate.utils.dataclasses as acc_dc

    from training.stage1.config import load_stage1_config
    from training.stage1.trainer import make_accelerator

    cuda = _FakeCuda(world)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: world)
    monkeypatch.setattr(torch.cuda, "set_device", cuda.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", cuda.current_device)
    monkeypatch.setattr(acc_dc, "is_cuda_available", lambda: True)
    # what `accelerate launch --config_file configs/accelerate/fsdp-2xh200.yaml` exports per rank
    for k, v in {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                 "LOCAL_WORLD_SIZE": str(world), "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1",
                 "FSDP_SYNC_MODULE_STATES": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
                 "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}.items():
        monkeypatch.setenv(k, v)
    seen = {}

    class _Accelerator:
        def __init__(self, **kw):
            seen.update(kw)

    monkeypatch.setattr(accelerate, "Accelerator", _Accelerator)
    cfg = load_stage1_config(REPO / "configs" / "stage1" / "qwen2.5-7b-2xh200.yaml")
    make_accelerator(cfg, Path("/nonexistent-run"))
    plugin = seen["fsdp_plugin"]
    assert plugin.sync_module_states and plugin.cpu_ram_efficient_loading
    m = _Module()
    plugin.param_init_fn(m)
    return m.device, cuda.current


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_initialises_modules_on_its_own_device(monkeypatch, rank):
    device, current = _plugin_device_on_rank(monkeypatch, rank)
    index = device.index if isinstance(device, torch.device) else int(device)
    assert index == rank, f"rank {rank}'s FSDP plugin initialises modules on cuda:{index}"
    assert current == rank                    # and the rank's current device is its own
