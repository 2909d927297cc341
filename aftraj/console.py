"""Keep the console to what a user can act on: library notices that need no action are silenced
when the `aftraj` console script starts (`aftraj.commands` calls `quiet_libraries()`).

Silenced: bitsandbytes' notice that the optional `kernels` package is missing (its CPU 4-bit
kernel; we never run 4-bit); transformers' / huggingface_hub's own "Loading weights" bars (our
commands draw their own bars, and `--no-progress` must mean none); FutureWarning and
DeprecationWarning raised inside torch, transformers, peft, accelerate, trl and datasets (a user
of `aftraj` cannot change those calls); transformers' messages about shared / tied tensors at
save time (expected for tied embeddings). Errors and every other warning still show.
`AFTRAJ_VERBOSE_LIBRARIES=1` keeps everything.

    python -m aftraj.cli train stage1 --config configs/stage1/smollm2-135m-cpu.yaml --out runs/s1
"""

from __future__ import annotations

import logging
import os
import warnings

LIBRARIES = r"(torch|transformers|peft|accelerate|trl|datasets|bitsandbytes|huggingface_hub)(\.|$)"
_NOISE = ("shared tensor", "tied weight")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage().casefold()
        return not any(n in msg for n in _NOISE)


def quiet_libraries() -> None:
    if os.environ.get("AFTRAJ_VERBOSE_LIBRARIES") == "1":
        return
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # read by transformers at import
    for cat in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=cat, module=LIBRARIES)
    # a filter acts on the logger a record is logged to (not on records propagated from children)
    for name in ("transformers", "transformers.modeling_utils", "peft", "safetensors", "accelerate.utils.other"):
        logging.getLogger(name).addFilter(_DropNoise())
