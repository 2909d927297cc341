"""Validation of accelerate launch configs (`configs/accelerate/*.yaml`).

accelerate itself rejects unknown top-level keys (`ClusterConfig.from_yaml_file`) but passes
`fsdp_config` through unchecked, so a misspelt FSDP key would be silently ignored at launch.
This check also matches every `fsdp_config` key against `accelerate launch`'s own `--fsdp_*`
options, checks the values accelerate would otherwise only reject on the GPU node, and that the
layer class to wrap exists in transformers.

    python -m training.accelerate_config configs/accelerate/fsdp-2xh200.yaml
    python -m training.accelerate_config --cpu-variant configs/accelerate/fsdp-2xh200.yaml OUT.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from aftraj.config import ConfigError, read_yaml

_CHOICES = {
    "fsdp_version": (1, 2),
    "fsdp_sharding_strategy": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"),
    "fsdp_auto_wrap_policy": ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
    "fsdp_backward_prefetch": ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"),
    "fsdp_state_dict_type": ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"),
}
_BOOLS = ("fsdp_forward_prefetch", "fsdp_offload_params", "fsdp_use_orig_params", "fsdp_sync_module_states",
          "fsdp_cpu_ram_efficient_loading", "fsdp_activation_checkpointing", "fsdp_reshard_after_forward")


def check_accelerate_config(path: str | Path) -> dict:
    """Load and validate; returns the raw mapping. Raises ConfigError naming the file and key
    (`aftraj.config`, the one config error)."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    src = str(path)
    raw = read_yaml(path)
    if not raw:
        raise ConfigError("the file must hold a mapping, got an empty file", source=src)
    try:
        cfg = ClusterConfig.from_yaml_file(yaml_file=src)    # unknown top-level keys raise here
    except (ValueError, TypeError) as e:
        raise ConfigError(" ".join(str(e).split()), source=src) from None
    if cfg.mixed_precision not in ("no", "fp16", "bf16", "fp8"):
        raise ConfigError(f"unknown value {cfg.mixed_precision!r}", key="mixed_precision", source=src)
    if not isinstance(cfg.num_processes, int) or cfg.num_processes < 1:
        raise ConfigError("must be a positive integer", key="num_processes", source=src)
    fsdp = raw.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        raise ConfigError(f"must be a mapping, got {type(fsdp).__name__}", key="fsdp_config", source=src)
    if str(cfg.distributed_type).endswith("FSDP") and not fsdp:
        raise ConfigError("is required when distributed_type is FSDP", key="fsdp_config", source=src)
    launch_opts = {a.dest for a in launch_command_parser()._actions}
    for key, val in fsdp.items():
        where = f"fsdp_config.{key}"
        if key not in launch_opts:
            raise ConfigError("is not an `accelerate launch` FSDP option", key=where, source=src)
        if key in _CHOICES and val not in _CHOICES[key]:
            raise ConfigError(f"must be one of {_CHOICES[key]}, got {val!r}", key=where, source=src)
        if key in _BOOLS and not isinstance(val, bool):
            raise ConfigError(f"must be true or false, got {val!r}", key=where, source=src)
    for cls in str(fsdp.get("fsdp_transformer_layer_cls_to_wrap") or "").split(","):
        if cls.strip() and not _layer_class_exists(cls.strip()):
            raise ConfigError(f"no transformers layer class named {cls.strip()!r}",
                              key="fsdp_config.fsdp_transformer_layer_cls_to_wrap", source=src)
    return raw


def _layer_class_exists(name: str) -> bool:
    """'Qwen2DecoderLayer' -> transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer."""
    import importlib

    import transformers.models as tm

    family = name.replace("DecoderLayer", "").replace("EncoderLayer", "").lower()
    try:
        mod = importlib.import_module(f"{tm.__name__}.{family}.modeling_{family}")
    except ImportError:
        return False
    return hasattr(mod, name)


def set_rank_device() -> None:
    """Make this rank's accelerator device the current one, as accelerate's `PartialState.set_device`
    does (`LOCAL_RANK % device_count`), without starting the process group. Needed BEFORE
    `FullyShardedDataParallelPlugin(...)`: with `sync_module_states` (forced on by
    `cpu_ram_efficient_loading`) accelerate 1.15 captures `torch.cuda.current_device()` in the
    plugin's `param_init_fn` when the plugin is built; left at cuda:0, rank 1's FSDP wrap raises
    "Inconsistent compute device and device_id on rank 1". No-op without CUDA or outside a launch."""
    import os

    import torch

    local = os.environ.get("LOCAL_RANK")
    if local is None or not torch.cuda.is_available():
        return
    torch.cuda.set_device(torch.device("cuda", int(local) % torch.cuda.device_count()))


def fsdp_plugin(**kwargs):
    """`FullyShardedDataParallelPlugin(**kwargs)` built after `set_rank_device()` (the launch
    config's `FSDP_*` environment fills what `kwargs` leaves out)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    set_rank_device()
    return FullyShardedDataParallelPlugin(**kwargs)


def cpu_variant(path: str | Path, out: str | Path) -> Path:
    """The same launch config for CPU ranks (gloo), as the two-rank CPU tests run it: `use_cpu`,
    and no `sync_module_states` / `cpu_ram_efficient_loading` (accelerate needs a GPU for them;
    every rank then loads the weights itself). Everything else (FSDP1, sharding, wrapping,
    mixed precision, sharded state dict) is kept."""
    raw = check_accelerate_config(path)
    raw["use_cpu"] = True
    fsdp = raw.setdefault("fsdp_config", {})
    fsdp["fsdp_sync_module_states"] = False
    fsdp["fsdp_cpu_ram_efficient_loading"] = False
    Path(out).write_text(yaml.safe_dump(raw, sort_keys=False))
    return Path(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cpu-variant"]:
        print(cpu_variant(sys.argv[2], sys.argv[3]))
        raise SystemExit(0)
    for a in sys.argv[1:]:
        check_accelerate_config(a)
        print(f"ok: {a}")
