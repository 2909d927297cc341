"""Layers only point down, and no import circle (issue 26 item 2).

Every tracked .py file is read with `ast` (nothing is imported, so a missing extra cannot hide an
import); every `import` and `from … import` counts, module-level or inside a function (a lazy
import is still a dependency). The floors, lowest first:

    0  core      aftraj.*  (schema, prompt, verdict, fold, corpus, structural, …)
    1  packages  training, eval, serve  (each builds on the core only, never on a sibling)
    2  top       aftraj.cli, aftraj.commands.*, aftraj.drivers.* (the ablation and reproduce
                 drivers), and the scripts, benchmarks, reports and tests, which may import anything

A module may import its own package and any lower floor. A circle (two or more project modules
that import each other, directly or through others) fails whatever the floors.

    python -m pytest tests/test_layering.py
"""

from __future__ import annotations

import ast
import subprocess
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_PREFIXES = ("aftraj.cli", "aftraj.commands", "aftraj.drivers")
PACKAGES = ("training", "eval", "serve")
TOOLS = ("scripts", "benchmarks", "reports", "tests")


def module_name(path: str) -> str:
    mod = path[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def floor_of(module: str) -> tuple[int, str] | None:
    """(floor, group) of a project module; None for anything outside the project."""
    first = module.split(".")[0]
    if any(module == p or module.startswith(p + ".") for p in TOP_PREFIXES) or first in TOOLS:
        return 2, "top"
    if first == "aftraj":
        return 0, "aftraj"
    if first in PACKAGES:
        return 1, first
    return None


def imports_of(path: Path, module: str, is_package: bool) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) of every import statement in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target, [a.name for a in node.names]))
    return out


def dependency_graph(root: Path, files: list[str]) -> dict[str, dict[str, tuple[str, int]]]:
    """module -> {imported project module: (file, line) of the first such import}."""
    modules = {module_name(f): f for f in files}
    graph: dict[str, dict[str, tuple[str, int]]] = defaultdict(dict)
    for mod, f in modules.items():
        graph[mod]
        for line, target, names in imports_of(root / f, mod, f.endswith("__init__.py")):
            for cand in [f"{target}.{n}" for n in names] or [target]:
                x = cand if cand in modules else None
                if x is None:   # `from pkg import name`: the package; `import a.b.c`: the longest module
                    x = target
                    while x and x not in modules:
                        x = x.rpartition(".")[0]
                if x and x != mod:
                    graph[mod].setdefault(x, (f, line))
    return graph


def upward_imports(graph) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        me = floor_of(mod)
        if me is None:
            continue
        for dep, (f, line) in sorted(deps.items()):
            it = floor_of(dep)
            if it is None or me[0] == 2:
                continue
            if it[0] > me[0] or (it[0] == me[0] and it[1] != me[1]):
                out.append(f"{f}:{line}: {mod} ({me[1]}, floor {me[0]}) imports {dep} ({it[1]}, floor {it[0]})")
    return out


def circles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def check(root: Path, files: list[str]) -> list[str]:
    """Every layering problem of the tree: upward or sideways imports, then circles."""
    graph = dependency_graph(root, files)
    problems = upward_imports(graph)
    for comp in circles(graph):
        edges = [f"{a} -> {b} ({graph[a][b][0]}:{graph[a][b][1]})" for a in comp for b in sorted(graph[a]) if b in comp]
        problems.append("import circle: " + "; ".join(edges))
    return problems


def tracked_py_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "*.py"],
                         cwd=root, capture_output=True, text=True, check=True).stdout
    return sorted(f for f in out.split("\0") if f and (root / f).is_file())


# --------------------------------------------------------------------------- the repository

# Violations being moved away while issue 26 is open, each "importer -> imported": listed here so
# that a NEW one fails at once; an entry that no longer occurs fails too (delete it). Empty when done.
PENDING: set[str] = set()


def _key(problem: str) -> str:
    if problem.startswith("import circle: "):
        return "circle " + " ".join(sorted({e.split(" -> ")[0] for e in problem[15:].split("; ")}))
    words = problem.split(" ")
    return f"{words[1]} -> {words[6]}"


def test_layers_point_down_and_no_circles():
    files = tracked_py_files(ROOT)
    assert len(files) > 100 and "aftraj/cli.py" in files
    problems = check(ROOT, files)
    new = [p for p in problems if _key(p) not in PENDING]
    assert not new, "layering problems:\n" + "\n".join(new)
    stale = PENDING - {_key(p) for p in problems}
    assert not stale, f"fixed, delete from PENDING: {sorted(stale)}"


# --------------------------------------------------------------------------- the checker itself

def _tree(root: Path, files: dict[str, str]) -> list[str]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return sorted(files)


CLEAN = {
    "aftraj/__init__.py": "",
    "aftraj/schema.py": "import json\n",
    "aftraj/verdict.py": "from aftraj.schema import x\nfrom . import schema\n",
    "aftraj/cli.py": "import eval.run\nimport aftraj.commands.eval\n",
    "aftraj/commands/__init__.py": "",
    "aftraj/commands/eval.py": "def run():\n    from eval.run import evaluate\n    from training import models\n",
    "aftraj/drivers/__init__.py": "",
    "aftraj/drivers/ablation.py": "from eval.run import evaluate\nfrom training.models import m\n",
    "eval/__init__.py": "",
    "eval/run.py": "from aftraj.verdict import Verdict\nfrom .metrics import grouped\n",
    "eval/metrics.py": "from aftraj import schema\n",
    "training/__init__.py": "",
    "training/models.py": "from aftraj.schema import Trajectory\n",
    "tests/test_x.py": "from aftraj.drivers.ablation import y\n",
    "eval/leaf.py": "",
    "training/leaf.py": "",
    "aftraj/commands/leaf.py": "",
}


def test_checker_passes_a_clean_tree(tmp_path):
    assert check(tmp_path, _tree(tmp_path, CLEAN)) == []


def test_checker_fails_on_a_planted_upward_import(tmp_path):
    files = _tree(tmp_path, {**CLEAN, "aftraj/schema.py": "def f():\n    from eval.leaf import grouped\n"})
    problems = check(tmp_path, files)
    assert len(problems) == 1 and problems[0].startswith("aftraj/schema.py:2: aftraj.schema (aftraj, floor 0) "
                                                         "imports eval.leaf (eval, floor 1)"), problems


def test_checker_fails_on_a_sideways_import_and_on_the_core_importing_the_top(tmp_path):
    files = _tree(tmp_path, {**CLEAN, "eval/metrics.py": "from training.leaf import m\n",
                             "aftraj/verdict.py": "from aftraj.commands.leaf import run_guarded\n"})
    problems = check(tmp_path, files)
    assert [p.split(": ", 1)[0] for p in problems] == ["aftraj/verdict.py:1", "eval/metrics.py:1"], problems


def test_checker_fails_on_a_relative_upward_import(tmp_path):
    files = _tree(tmp_path, {**CLEAN, "aftraj/verdict.py": "from .commands import leaf\n"})
    assert [p.split(": ", 1)[0] for p in check(tmp_path, files)] == ["aftraj/verdict.py:1"]


def test_checker_fails_on_a_circle(tmp_path):
    files = _tree(tmp_path, {**CLEAN, "aftraj/schema.py": "def f():\n    import aftraj.verdict\n"})
    problems = check(tmp_path, files)
    assert problems == ["import circle: aftraj.schema -> aftraj.verdict (aftraj/schema.py:2); "
                        "aftraj.verdict -> aftraj.schema (aftraj/verdict.py:1)"], problems
