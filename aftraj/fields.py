"""Field checks the readers of external layouts share (`aftraj.readers` for Who&When,
`aftraj.released` for the released AFTraj-2K parquet): a value is taken as it is or refused with a
`SchemaError` naming the field, never guessed.

    from aftraj.fields import label_int, need_str
    k = label_int(row["mistake_step"], "mistake_step", minimum=-1)      # 3, "3"; never True, 1.7, "1_0"
"""

from __future__ import annotations

import re
from typing import Any

from aftraj.schema import ReadReport, SchemaError


def label_int(v: Any, field: str, *, minimum: int = 0) -> int:
    """A step label as an integer, never a guess: an int, or a string of decimal digits (Who&When
    writes "3"); `True`, `1.7`, `"1_0"` (which `int()` reads as 10), `" 3"` are errors."""
    if isinstance(v, bool) or v is None:
        raise SchemaError(f"must be an integer step index, got {v!r}", field=field)
    if isinstance(v, int):
        k = v
    elif isinstance(v, str) and re.fullmatch(r"-?[0-9]{1,9}", v):
        k = int(v)
    else:
        raise SchemaError(f"must be an integer step index, got {v!r}", field=field)
    if k < minimum:
        raise SchemaError(f"must be >= {minimum}, got {k}", field=field)
    return k


def need_str(v: Any, field: str, *, optional: bool = False) -> str | None:
    """`v` when it is a string (or None when `optional`); else a SchemaError naming `field`."""
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise SchemaError(f"must be a string, got {'null' if v is None else type(v).__name__}",
                          field=field)
    return v


def skip_or_raise(err: SchemaError, skip_invalid: bool, report: ReadReport) -> None:
    """Raise `err`, or with `skip_invalid` count it in `report` and go on."""
    if not skip_invalid:
        raise err
    report.n_skipped += 1
    report.errors.append(err)
