"""The README's layout tree is true: every tracked file appears in it (by its own line, or under a
folder the tree describes as a whole, i.e. a folder line with no lines below it), and every line
names a file or folder that is tracked, at its real place. A new module without its line, or a
line left behind by a move, fails here with the path named.

The tree is the code block under "## Layout": one entry a line, two spaces of indent a level, the
name first (a folder ends with "/"; a name may hold a subpath, `accelerate/fsdp.yaml`), then what
it is; a line indented to the description's column continues the description above it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def layout_block(readme: str) -> str:
    m = re.search(r"^## Layout\n.*?^```\n(.*?)^```", readme, re.M | re.S)
    if not m:
        raise AssertionError("the README has no code block under '## Layout'")
    return m.group(1)


def parse_tree(block: str) -> tuple[dict[str, int], list[str]]:
    """Entries of the tree: {path: line number} (folders end with "/") and the format errors."""
    entries: dict[str, int] = {}
    errors: list[str] = []
    stack: list[str] = []          # folder path at each level
    prev_level, prev_is_dir, desc_col = -1, True, None
    for n, line in enumerate(block.splitlines(), 1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if desc_col is not None and indent >= desc_col:
            continue                 # the description of the entry above, continued
        parts = line.strip().split(None, 1)
        name, desc = parts[0], (parts[1].strip() if len(parts) > 1 else "")
        desc_col = line.index(desc, indent + len(name)) if desc else None
        if indent % 2:
            errors.append(f"tree line {n} ({name}): indent {indent} is not a multiple of 2")
            continue
        level = indent // 2
        if level > prev_level + 1 or (level > prev_level and not prev_is_dir):
            errors.append(f"tree line {n} ({name}): indented under a line that is not its folder")
            continue
        if not desc:
            errors.append(f"tree line {n} ({name}): no description")
        path = "".join(stack[:level]) + name
        if path in entries:
            errors.append(f"tree line {n}: {path} is listed twice (first on line {entries[path]})")
        entries[path] = n
        del stack[level:]
        is_dir = name.endswith("/")
        if is_dir:
            stack.append(name)
        prev_level, prev_is_dir = level, is_dir
    return entries, errors


def check_tree(block: str, tracked: set[str]) -> list[str]:
    """Every problem of the tree against the tracked files, one line each (empty: the tree is true)."""
    entries, errors = parse_tree(block)
    folders = {p for p in entries if p.endswith("/")}
    leaves = {f for f in folders if not any(p != f and p.startswith(f) for p in entries)}
    tracked_dirs = {f.rsplit("/", i)[0] + "/" for f in tracked for i in range(1, f.count("/") + 1)}
    for path, n in sorted(entries.items(), key=lambda x: x[1]):
        if path.endswith("/"):
            if path not in tracked_dirs:
                errors.append(f"tree line {n}: folder {path} holds no tracked file")
        elif path not in tracked:
            errors.append(f"tree line {n}: {path} is not a tracked file (moved or renamed?)")
    for f in sorted(tracked):
        if f in entries:
            continue
        if not any(f.startswith(leaf) for leaf in leaves):
            errors.append(f"{f} is tracked but not in the README's layout tree")
    return errors


def tracked_files() -> set[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    # a file deleted in the work tree but not yet in the index is not the tree's concern
    return {p for p in out.decode().split("\0") if p and (REPO / p).exists()}


def test_readme_layout_names_every_tracked_file_and_only_those():
    block = layout_block((REPO / "README.md").read_text(encoding="utf-8"))
    errors = check_tree(block, tracked_files())
    assert not errors, "README layout tree:\n" + "\n".join(errors)


def test_the_check_finds_a_misplaced_a_missing_and_a_stale_line():
    tracked = {"README.md", "aftraj/commands/serve.py", "aftraj/structural/monitor.py", "aftraj/tokens.py",
               "eval/data/ww/1.json", "eval/data/ww/2.json"}
    good = ("README.md                this file\n"
            "aftraj/                  the core\n"
            "  tokens.py              token counting\n"
            "  commands/              subcommands\n"
            "    serve.py             aftraj serve\n"
            "  structural/            the monitor,\n"
            "                         its description continued\n"
            "    monitor.py           fit and score\n"
            "eval/                    evaluation\n"
            "  data/                  shipped data, described as a whole\n")
    assert check_tree(good, tracked) == []
    misplaced = good.replace("  commands/              subcommands\n    serve.py             aftraj serve\n", "") \
                    .replace("    monitor.py           fit and score\n",
                             "    monitor.py           fit and score\n    serve.py             aftraj serve\n")
    errs = check_tree(misplaced, tracked)
    assert any("aftraj/structural/serve.py is not a tracked file" in e for e in errs)
    assert any("aftraj/commands/serve.py is tracked but not in" in e for e in errs)
    missing = good.replace("  tokens.py              token counting\n", "")
    assert check_tree(missing, tracked) == ["aftraj/tokens.py is tracked but not in the README's layout tree"]
    no_desc = good.replace("token counting", "")
    assert any("(tokens.py): no description" in e for e in check_tree(no_desc, tracked))
    under_file = good.replace("    serve.py             aftraj serve\n",
                              "    serve.py             aftraj serve\n      x.py               nested in a file\n")
    assert any("not its folder" in e for e in check_tree(under_file, tracked))
