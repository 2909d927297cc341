"""The README's Python snippet runs as written (from a folder with nothing in it, so it needs no
file a reader would not have), and every `aftraj …` command shown in the README and in
docs/commands.md parses with the real CLI parser (a renamed or removed flag fails here)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

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


def shown_commands(text: str) -> list[str]:
    """The `aftraj …` lines of a Markdown file's fenced code blocks, continuation lines joined;
    lines that elide arguments ("aftraj eval ... --resume") are not whole commands: left out."""
    out, fenced, pending = [], False, ""
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced, pending = not fenced, ""
            continue
        if not fenced:
            continue
        line = (pending + " " + line.strip()) if pending else line.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        pending = ""
        if line.startswith("aftraj ") and "..." not in line and "\u2026" not in line:
            out.append(line)
    return out


def test_shown_commands_are_found_whole():
    text = ("```python\nx = 1\n```\nprose: aftraj not a command\n"
            "```bash\naftraj eval --auditor rules \\\n    --out o   # note\naftraj eval ... --resume\n```\n")
    assert shown_commands(text) == ["aftraj eval --auditor rules --out o   # note"]


@pytest.mark.parametrize("doc", ["README.md", "docs/commands.md"])
def test_every_shown_aftraj_command_parses(doc):
    from aftraj.cli import build_parser
    commands = shown_commands((REPO / doc).read_text(encoding="utf-8"))
    assert len(commands) >= 10, f"{doc}: expected its aftraj commands, found {len(commands)}"
    parser, bad = build_parser(), []
    for c in commands:
        try:
            parser.parse_args(shlex.split(c, comments=True)[1:])
        except SystemExit:
            bad.append(c)
    assert not bad, f"{doc}: commands the CLI does not accept:\n" + "\n".join(bad)
