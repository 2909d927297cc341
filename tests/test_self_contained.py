"""The repository runs from itself alone: Who&When ships inside it, and nothing reads ../shared."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f]


def test_no_file_reads_shared_data():
    offenders = []
    for f in _tracked_files():
        if (f.startswith("eval/data/") or f == "tests/test_self_contained.py"
                or not f.endswith((".py", ".sh", ".yaml", ".toml"))):
            continue
        text = (REPO / f).read_text(errors="replace")
        if "shared/data" in text or '"shared" / "data"' in text:
            offenders.append(f)
    assert offenders == []


def test_builtin_name_resolves(tmp_path):
    from aftraj.readers import WHO_AND_WHEN_DIR, load_trajectories, resolve_data_path

    assert resolve_data_path("who_and_when") == WHO_AND_WHEN_DIR
    assert (WHO_AND_WHEN_DIR / "LICENSE").is_file() and (WHO_AND_WHEN_DIR / "README.md").is_file()
    # an existing path of that name wins over the built-in
    (tmp_path / "who_and_when").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert resolve_data_path("who_and_when") == Path("who_and_when")
    finally:
        os.chdir(cwd)
    trajs = load_trajectories("who_and_when")
    assert len(trajs) == 184


def test_fresh_copy_without_shared_reads_who_and_when(tmp_path):
    """A copy of the repository in a folder with no ../shared evaluates on Who&When by name."""
    dst = tmp_path / "clone"
    for f in _tracked_files():
        src = REPO / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    assert not (tmp_path / "shared").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(dst)
    out = tmp_path / "ww-last"
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "eval", "--auditor", "heuristic:last-step",
                        "--data", "who_and_when", "--out", str(out), "--n-boot", "50", "--no-progress"],
                       cwd=dst, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    import json

    m = json.loads((out / "metrics.json").read_text())
    assert m["overall"]["n"] == 184 and m["overall"]["n_unsafe"] == 184
    # the data came from the copy, not from the checkout the tests run in
    check = subprocess.run([sys.executable, "-c",
                            "import aftraj.readers as r; print(r.WHO_AND_WHEN_DIR)"],
                           cwd=dst, env=env, capture_output=True, text=True, timeout=60)
    assert check.stdout.strip() == str(dst / "eval" / "data" / "who_and_when")
