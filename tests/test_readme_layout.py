"""The README's layout tree is true: it lists folders, not files (issue 48: a reader sees the
rooms; the modules say what they are themselves), names every top-level folder and every folder
directly inside a package (`aftraj/commands/`, `eval/auditors/`, …), and every line names a folder
that holds a tracked file, at its real place. A new package folder without its line, or a line
left behind by a move, fails here with the path named.

The tree is the code block under "## Layout": one entry a line, two spaces of indent a level, the
name first (a folder ends with "/"; a name may hold a subpath, `corpus/domains/`), then what it
is; a line indented to the description's column continues the description above it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("aftraj", "training", "eval", "serve")


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


def required_folders(tracked: set[str]) -> set[str]:
    """The folders the tree must name: every top-level folder, and every folder directly inside a
    package (aftraj/commands/, eval/auditors/, …), as far as they hold a tracked file."""
    top = {f.split("/", 1)[0] + "/" for f in tracked if "/" in f}
    sub = {"/".join(f.split("/")[:2]) + "/" for f in tracked if f.split("/")[0] in PACKAGES and f.count("/") >= 2}
    return top | sub


def check_tree(block: str, tracked: set[str]) -> list[str]:
    """Every problem of the tree against the tracked files, one line each (empty: the tree is true)."""
    entries, errors = parse_tree(block)
    tracked_dirs = {f.rsplit("/", i)[0] + "/" for f in tracked for i in range(1, f.count("/") + 1)}
    for path, n in sorted(entries.items(), key=lambda x: x[1]):
        if not path.endswith("/"):
            errors.append(f"tree line {n}: {path} is a file: the tree lists folders only")
        elif path not in tracked_dirs:
            errors.append(f"tree line {n}: folder {path} holds no tracked file (moved or renamed?)")
    for f in sorted(required_folders(tracked) - set(entries)):
        errors.append(f"{f} is a folder of the repository but not in the README's layout tree")
    return errors


def tracked_files() -> set[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        # an unpacked archive: its files, less environments, caches and what runs write
        def ours(part: str) -> bool:
            return not (part in {"runs", "out", "__pycache__", ".git", ".whl"} or part.endswith(".egg-info")
                        or part.startswith((".venv", ".pytest", ".ruff")))
        return {str(p.relative_to(REPO)) for p in REPO.rglob("*")
                if p.is_file() and all(ours(part) for part in p.relative_to(REPO).parts[:-1])}
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    # a file deleted in the work tree but not yet in the index is not the tree's concern
    return {p for p in out.decode().split("\0") if p and (REPO / p).exists()}


def test_readme_layout_names_every_folder_and_only_those():
    block = layout_block((REPO / "README.md").read_text(encoding="utf-8"))
    errors = check_tree(block, tracked_files())
    assert not errors, "README layout tree:\n" + "\n".join(errors)


def test_the_check_finds_a_misplaced_a_missing_a_stale_and_a_file_line():
    tracked = {"README.md", "aftraj/commands/serve.py", "aftraj/structural/monitor.py", "aftraj/tokens.py",
               "eval/data/ww/1.json", "eval/data/ww/2.json", "scripts/demo.sh"}
    good = ("aftraj/                  the core\n"
            "  commands/              subcommands\n"
            "  structural/            the monitor,\n"
            "                         its description continued\n"
            "eval/                    evaluation\n"
            "  data/                  shipped data\n"
            "    ww/                  Who&When (a folder below a package's sub-folder may be listed)\n"
            "scripts/                 entry points\n")
    assert check_tree(good, tracked) == []
    misplaced = good.replace("  commands/              subcommands\n", "") \
                    .replace("  data/                  shipped data\n",
                             "  data/                  shipped data\n  commands/              subcommands\n")
    errs = check_tree(misplaced, tracked)
    assert "tree line 6: folder eval/commands/ holds no tracked file (moved or renamed?)" in errs
    assert "aftraj/commands/ is a folder of the repository but not in the README's layout tree" in errs
    missing = good.replace("scripts/                 entry points\n", "")
    assert check_tree(missing, tracked) == ["scripts/ is a folder of the repository but not in the README's layout tree"]
    with_file = good + "README.md                this file\n"
    assert check_tree(with_file, tracked) == ["tree line 9: README.md is a file: the tree lists folders only"]
    no_desc = good.replace("subcommands", "")
    assert any("(commands/): no description" in e for e in check_tree(no_desc, tracked))
    under_file = with_file + "  x/                     nested in a file\n"
    assert any("not its folder" in e for e in check_tree(under_file, tracked))
