"""Keep the console to what a user can act on: library notices that need no action are silenced
when the `aftraj` console script starts (`aftraj.commands` calls `quiet_libraries()`).

Silenced: bitsandbytes' notice that the optional `kernels` package is missing (its CPU 4-bit
kernel; we never run 4-bit); transformers' / huggingface_hub's own "Loading weights" bars (our
commands draw their own bars, and `--no-progress` must mean none); FutureWarning and
DeprecationWarning raised inside torch, transformers, peft, accelerate, trl and datasets (a user
of `aftraj` cannot change those calls); transformers' messages about shared / tied tensors at
save time (expected for tied embeddings). Errors and every other warning still show.
`AFTRAJ_VERBOSE_LIBRARIES=1` keeps everything.

`progress(...)`: the one progress helper of every long step (eval walk, corpus build and
verify, structural fit and its embedding). On a terminal it is a tqdm bar; without one (a log
file, CI, a pipe) it prints one line every `interval` seconds (default 5,
`AFTRAJ_PROGRESS_INTERVAL`) with the count, the rate and an ETA, plus one at the end, never a
line per item; a line comes even while one item is slow (a batched hf round: "0/4617 call, 2m00s
elapsed" says it is alive). Its total may shrink while it runs (`.total -= n`: an eval walk that ends early).

    python -m aftraj.cli train stage1 --config configs/stage1/smollm2-135m-cpu.yaml --out runs/s1
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
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


# --------------------------------------------------------------------------- progress

def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class LineProgress:
    """Progress without a terminal: a line every `interval` seconds and one at the end,
    `desc: done/total unit (pct), elapsed, rate, ETA` (tqdm's interface, the part we use)."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", *, stream=None,
                 interval: float = 5.0, clock=time.monotonic, heartbeat: bool = False):
        self.total, self.desc, self.unit = total, desc, unit
        self.n, self.postfix = 0, ""
        self._stream, self._interval, self._clock = stream or sys.stderr, interval, clock
        self._t0 = self._last = clock()
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if heartbeat and interval > 0:   # a line even while one item takes long (a batched hf round)
            threading.Thread(target=self._beat, daemon=True, name="aftraj-progress").start()

    def _beat(self) -> None:
        while not self._stop.wait(self._interval / 2):
            self._maybe_print()

    def line(self) -> str:
        el = self._clock() - self._t0
        head = f"{self.desc}: {self.n}" + (f"/{self.total}" if self.total else "") + f" {self.unit}"
        if self.total:
            head += f" ({100 * self.n / self.total:.0f} %)"
        head += f", {_duration(el)} elapsed"
        if self.n and el > 0:
            rate = self.n / el
            head += f", {rate:.2f} {self.unit}/s" if rate >= 1 else f", {1 / rate:.1f} s/{self.unit}"
            if self.total and self.total > self.n:
                head += f", ETA {_duration((self.total - self.n) / rate)}"
        return head + (f" [{self.postfix}]" if self.postfix else "")

    def _maybe_print(self, force: bool = False) -> None:
        with self._lock:
            now = self._clock()
            if force or now - self._last >= self._interval:
                self._last = now
                print(self.line(), file=self._stream, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        self._maybe_print()

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        self.postfix = s

    def refresh(self) -> None:
        self._maybe_print()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop.set()
            if self.n:
                self._maybe_print(force=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Off(LineProgress):
    def _maybe_print(self, force: bool = False) -> None:
        pass


def progress(total: int | None, desc: str, unit: str = "it", *, enabled: bool = True, stream=None,
             interval: float | None = None):
    """A progress reporter: tqdm on a terminal, `LineProgress` otherwise, silent when not
    `enabled`. Use as a context manager or call `.close()`."""
    stream = stream or sys.stderr
    if not enabled:
        return _Off(total, desc, unit, stream=stream)
    if getattr(stream, "isatty", lambda: False)():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, leave=False, file=stream)
    if interval is None:
        interval = float(os.environ.get("AFTRAJ_PROGRESS_INTERVAL", "5"))
    return LineProgress(total, desc, unit, stream=stream, interval=interval, heartbeat=True)


def track(iterable, desc: str, unit: str = "it", *, total: int | None = None, enabled: bool = True,
          stream=None, interval: float | None = None):
    """Iterate over `iterable`, reporting progress as `progress` does."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    bar = progress(total, desc, unit, enabled=enabled, stream=stream, interval=interval)
    try:
        for x in iterable:
            yield x
            bar.update(1)
    finally:
        bar.close()
