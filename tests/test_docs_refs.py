"""The docs name what is there: every repository path (`aftraj/corpus/sandbox.py`, `configs/stage1/`)
and every Python name (`aftraj.verdict.canonical_verdict`, `training/reward.py:compute_score`,
`tests/x.py::test_y`) written in backticks in the README, DEVELOPERS.md, docs/ and the other
notes resolves: the path exists, the module defines the name (read with `ast`, nothing imported).
A module moved or a function renamed without its docs fails here, naming the file and the reference.

Not checked: placeholders (`eval/auditors/<name>.py`, `configs/stage2/*.yaml`), paths a run writes
(ignored by git: `reports/demo/ablation.md`), prose without backticks."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "DEVELOPERS.md", "benchmarks/README.md", "training/verl/README.md",
        *sorted(str(p.relative_to(REPO)) for p in (REPO / "reports").glob("*/README.md")),
        *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
TOP_DIRS = ("aftraj", "training", "eval", "serve", "configs", "scripts", "tests", "benchmarks", "docs", "reports")
PACKAGES = ("aftraj", "training", "eval", "serve")
PLACEHOLDER = re.compile(r"[*<>{}…$=|\[\]]|\bN\b|\bK\b")
FILE_EXT = (".yaml", ".yml", ".json", ".jsonl", ".md", ".txt", ".sh", ".csv", ".parquet", ".npz", ".log", ".pt")


def _defines(py: Path, names: list[str]) -> bool:
    """Whether `py` defines names[0] at top level (def, class, assignment, import), and each
    further name inside the previous one (a method, a class attribute)."""
    body: list[ast.stmt] = ast.parse(py.read_text(encoding="utf-8")).body
    for name in names:
        hit = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                hit = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                    hit = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                    hit = node
        if hit is None:
            return False
        body = getattr(hit, "body", [])
    return True


def _module_file(parts: list[str]) -> tuple[Path, list[str]] | None:
    """The longest prefix of a dotted name that is a module of ours, and the names after it."""
    for i in range(len(parts), 0, -1):
        mod = REPO.joinpath(*parts[:i])
        for f in (mod.with_suffix(".py"), mod / "__init__.py"):
            if f.is_file():
                return f, parts[i:]
    return None


def problem(ref: str) -> str | None:
    """Why a backticked reference does not resolve, or None when it does (or is not one we check)."""
    ref = ref.split("(")[0].rstrip(".,:;")
    if PLACEHOLDER.search(ref) or " " in ref:
        return None
    if "/" in ref:
        if ref.split("/")[0] not in TOP_DIRS:
            return None
        path, sep, attr = (ref.partition("::") if "::" in ref else ref.partition(":"))
        if (REPO / path).exists():
            if sep and path.endswith(".py") and not _defines(REPO / path, attr.split(".")):
                return f"{attr} is not defined in {path}"
            return None
        if path.endswith(FILE_EXT) or path.endswith((".py", "/")) or "." not in path.rsplit("/", 1)[-1]:
            return f"{path} does not exist"
        head, _, tail = path.rpartition("/")          # aftraj/corpus/sandbox.Sandbox, training/stage1/data.first_divergence
        mod, *names = tail.split(".")
        f = REPO / head / f"{mod}.py"
        if not f.is_file():
            return f"{head}/{mod}.py does not exist"
        return None if _defines(f, names) else f"{'.'.join(names)} is not defined in {head}/{mod}.py"
    parts = ref.split(".")
    if parts[0] not in PACKAGES or len(parts) < 2 or ref.endswith(FILE_EXT) or not all(p.isidentifier() for p in parts):
        return None
    found = _module_file(parts)
    if found is None:
        return f"no module {ref}"
    f, names = found
    if names and not _defines(f, names):
        return f"{'.'.join(names)} is not defined in {f.relative_to(REPO)}"
    return None


def ignored(paths: list[str]) -> set[str]:
    """The paths git ignores (what a run writes: runs/, out/, reports/demo/, ...)."""
    if not paths or shutil.which("git") is None or not (REPO / ".git").exists():
        return set()
    r = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=REPO, input="\n".join(paths),
                       capture_output=True, text=True)
    return set(r.stdout.split())


def test_every_path_and_name_the_docs_give_exists():
    bad: list[tuple[str, str, str]] = []
    for doc in DOCS:
        refs = sorted(set(re.findall(r"`([^`\n]+)`", (REPO / doc).read_text(encoding="utf-8"))))
        found = [(r, why) for r in refs if (why := problem(r.strip()))]
        skip = ignored([r.split(":")[0] for r, _ in found])
        bad += [(doc, r, why) for r, why in found if r.split(":")[0] not in skip]
    assert not bad, "references in the docs that do not resolve:\n" + "\n".join(
        f"{doc}: `{r}`: {why}" for doc, r, why in bad)


@pytest.mark.parametrize("ref, ok", [
    ("aftraj/verdict.py", True), ("aftraj/nowhere.py", False), ("configs/stage1/", True),
    ("aftraj.verdict.canonical_verdict", True), ("aftraj.verdict.no_such_name", False),
    ("aftraj/verdict.canonical_verdict(t, step)", True), ("training/reward.py:compute_score", True),
    ("training/reward.py:nothing_here", False), ("eval/auditors/<name>.py", True), ("serve.yaml", True),
])
def test_the_check_tells_a_real_reference_from_a_stale_one(ref, ok):
    assert (problem(ref) is None) is ok, problem(ref)
