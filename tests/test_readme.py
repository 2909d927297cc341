"""The README's Python snippet runs as written (from a folder with nothing in it, so it needs no
file a reader would not have)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_python_snippet_runs(tmp_path):
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert blocks, "the README has no Python snippet"
    outs = []
    for code in blocks:
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                           env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                "HF_DATASETS_OFFLINE": "1"}, timeout=300)
        assert r.returncode == 0, f"README snippet failed:\n{code}\n{r.stderr[-2000:]}"
        outs.append(r.stdout)
    assert "SAFE False" in outs[0]   # what the snippet's last comment promises
