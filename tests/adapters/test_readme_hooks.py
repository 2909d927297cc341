"""Issue 47.6: the README's "Audit your own agent" quick start runs verbatim (the block after the
`<!-- hooks quick start -->` marker), in a fresh process from an empty folder: against a live
gateway (every step posted, no failure) and against a gateway that is down (the agent still
answers: the hook fails open). Needs the `adapters` extra."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- hooks quick start -->"


def quick_start() -> str:
    text = (REPO / "README.md").read_text()
    assert MARKER in text, "the README lost its hooks quick start"
    m = re.match(r"\s*```py\n(.*?)```", text.split(MARKER, 1)[1], re.DOTALL)
    assert m, "no ```py block right after the marker"
    return m.group(1)


def _run(tmp_path, gateway: str, key: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1",
           "AFTRAJ_GATEWAY": gateway, "AFTRAJ_KEY": key}
    return subprocess.run([sys.executable, "-c", quick_start()], cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=120)


def test_the_readme_quick_start_runs_against_a_gateway(live_gateway, tmp_path):
    pytest.importorskip("smolagents")
    url, key, _ = live_gateway("never appears")
    r = _run(tmp_path, url, key)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "408 pens" in r.stdout and "alarm None, failed posts 0" in r.stdout, r.stdout + r.stderr[-2000:]
    assert re.search(r": [1-9]\d* verdicts", r.stdout), r.stdout


def test_the_readme_quick_start_fails_open(tmp_path):
    pytest.importorskip("smolagents")
    with socket.socket() as s:            # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _run(tmp_path, f"http://127.0.0.1:{port}", "k")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "408 pens" in r.stdout and re.search(r"failed posts [1-9]", r.stdout), r.stdout
    assert "gateway post failed" in r.stderr and "Traceback" not in r.stderr
