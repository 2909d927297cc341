"""Rewrite a wheel without some of its files (scripts/gpu/gpu_wheels.sh): what a GPU check carries
must fit in 64 MiB with the working tree, and two wheels alone are 98 MB. The members dropped are
ones the checks never load (bitsandbytes' libraries for other CUDA versions and ROCm; pyarrow's
Flight, S3 and test libraries, headers and sources); RECORD is rewritten to match, the wheel's
name and version are kept, and the dropped members are listed in WHEEL_DIR/TRIMMED.txt.

    python scripts/gpu/trim_wheel.py WHEEL PATTERN...      # fnmatch patterns of member names to drop
"""

from __future__ import annotations

import fnmatch
import os
import sys
import tempfile
import zipfile
from pathlib import Path


def trim(wheel: Path, patterns: list[str]) -> list[str]:
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        drop = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]
        if not drop:
            raise SystemExit(f"trim_wheel: {wheel.name}: no member matches {patterns} (a new layout?)")
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        fd, tmp = tempfile.mkstemp(dir=wheel.parent, suffix=".whl")
        os.close(fd)
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename in drop:
                    continue
                data = src.read(info.filename)
                if info.filename == record:
                    keep = [ln for ln in data.decode().splitlines() if ln.split(",")[0] not in drop]
                    data = ("\n".join(keep) + "\n").encode()
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, wheel)
    with open(wheel.parent / "TRIMMED.txt", "a") as f:
        f.write(f"{wheel.name}: dropped {len(drop)} members: {', '.join(sorted(drop))}\n")
    return drop


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    dropped = trim(Path(sys.argv[1]), sys.argv[2:])
    print(f"trim_wheel: {Path(sys.argv[1]).name}: dropped {len(dropped)} members")
