"""`--set KEY=VALUE` overrides, parsed in one place for every command that takes them (training
stages, the ablation): VALUE is YAML (`--set lr=1e-4`, `--set targets=[q_proj,v_proj]`).

    python -c "from aftraj.overrides import parse_set; print(parse_set(['max_steps=4']))"
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from aftraj.errors import UsageError


def parse_set(items: Iterable[str]) -> dict:
    """{key: YAML value} of KEY=VALUE strings; a malformed item is a UsageError naming it."""
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        if not k.strip():
            raise UsageError(f"--set {item!r}: the key is empty")
        try:
            val = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise UsageError(f"--set {item!r}: the value is not YAML ({' '.join(str(e).split())})") from None
        if isinstance(val, str) and _FLOAT.match(val.strip()):
            val = float(val)        # YAML 1.1 reads 1e-3 (no dot) as a string
        out[k.strip()] = val
    return out


def cli_overrides(args, flags: dict[str, str]) -> dict:
    """A training command's overrides: its `--set` items, then each dedicated flag that was given
    ({config key: argparse attribute}, e.g. {"output_dir": "out"}); a flag wins over `--set`."""
    over = parse_set(getattr(args, "set", None) or [])
    for key, attr in flags.items():
        if (val := getattr(args, attr, None)) is not None:
            over[key] = val
    return over


_FLOAT = re.compile(r"\A[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+\Z")
