"""The fast tier: `bash scripts/test.sh -m fast` selects every test that carries none of the
slow/opt-in markers (tests/conftest.py adds `fast`), and nothing marked slow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _collected(*args: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 5), out.stdout + out.stderr      # 5: nothing selected
    return {ln.strip() for ln in out.stdout.splitlines() if "::" in ln}


def test_fast_selects_the_unmarked_and_leaves_out_the_slow(tmp_path):
    probe = f"tests/test_fast_tier_probe_{os.getpid()}.py"      # beside tests/conftest.py, removed after
    (REPO / probe).write_text("import pytest\n\n\ndef test_plain():\n    pass\n\n\n"
                              "@pytest.mark.slow\ndef test_marked_slow():\n    pass\n\n\n"
                              "@pytest.mark.gpu\ndef test_marked_gpu():\n    pass\n")
    try:
        fast = _collected("-m", "fast", probe)
        default = _collected(probe)
    finally:
        (REPO / probe).unlink()
    assert fast == {f"{probe}::test_plain"}
    assert default == {f"{probe}::test_plain", f"{probe}::test_marked_slow"}    # the default suite keeps slow
