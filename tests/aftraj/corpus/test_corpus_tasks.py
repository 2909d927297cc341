"""Task pools: seeded generation, deterministic checkers, and readers for local copies of the
public pools (tiny fixtures in their formats, written here)."""

from __future__ import annotations

import json

import pytest

from aftraj.corpus.domains.agentic import search_docs
from aftraj.corpus.domains.coding import code_from_text, functions_of, suite_tests
from aftraj.corpus.domains.math import eval_arith, full_expression, math_equal
from aftraj.corpus.tasks import POOL_READERS, check_answer, generate_tasks
from aftraj.schema import SchemaError


def test_generation_is_seeded():
    for d in ("math", "coding", "agentic"):
        a, b, c = generate_tasks(d, 5, 0), generate_tasks(d, 5, 0), generate_tasks(d, 5, 1)
        assert a == b and a != c
        assert len({t.id for t in a}) == 5 and all(t.domain == d and t.scripted for t in a)


def test_math_plans_reach_the_reference():
    for t in generate_tasks("math", 40, 3):
        assert math_equal(str(eval_arith(full_expression(t.data["plan"]))), t.reference)
        assert 2 <= len(t.data["plan"]) <= 9


@pytest.mark.parametrize("a, r, ok", [("3/4", "0.75", True), ("\\frac{3}{4}", "3/4", True), ("1,000", "1000", True),
                                      ("\\boxed{12}", "12", True), ("2*sqrt(2)", "sqrt(8)", True), ("13", "12", False),
                                      ("", "0", False), (None, "1", False), ("x+", "1", False)])
def test_math_checker(a, r, ok):
    assert math_equal(a, r) is ok


@pytest.mark.parametrize("answer", ["__import__('os').system('touch {probe}')",
                                    "exec(bytes((105,109,112,111,114,116,32,111,115)))",
                                    "open('{probe}', 'w')"])
def test_math_checker_never_evaluates_an_answer_as_code(answer, tmp_path):
    """Answers are untrusted (model output): sympy's parse_expr must never eval them as Python."""
    probe = tmp_path / "probe"
    assert math_equal(answer.format(probe=probe), "3") is False
    assert not probe.exists()
    assert math_equal("sqrt(2)/2", "1/sqrt(2)") and math_equal("2*pi", "pi+pi") and not math_equal("x+1", "x")


def test_compute_refuses_a_result_too_large_to_compute_quickly():
    with pytest.raises(ValueError, match="too large"):
        eval_arith("(((9**64)**64)**64)**64")   # 53 million bits: about a minute without the bound
    assert eval_arith("(2**64)**2") == 2**128


def test_coding_reference_passes_and_bugs_fail(sandbox):
    tasks = generate_tasks("coding", 12, 0)
    funcs = [(t, f) for t in tasks for f in functions_of(t)]
    items = [(code, suite_tests(t, s, f["function"])) for t, f in funcs for code in f["variants"].values()
             for s in ("public", "all")]
    sandbox.run_many(items)   # one batched subprocess; the checks below hit the cache
    n_hidden_only = 0
    for t, f in funcs:
        V, fn = f["variants"], f["function"]
        assert sandbox.run(V["correct"], suite_tests(t, "all", fn)).passed, (t.id, fn)
        for name, code in V.items():
            if name == "correct":
                continue
            assert not sandbox.run(code, suite_tests(t, "all", fn)).passed, (t.id, fn, name)
            if name.startswith("bug:") and sandbox.run(code, suite_tests(t, "public", fn)).passed:
                n_hidden_only += 1
    for t in tasks:
        blocks = "".join(f"```python\n{f['variants']['correct']}```\n" for f in functions_of(t))
        ok, why = check_answer(t, f"FINAL ANSWER:\n{blocks}", sandbox)
        assert ok, why
    assert n_hidden_only > 0   # some bugs slip past the public tests: natural failures exist


def test_agentic_chain_is_findable():
    for t in generate_tasks("agentic", 30, 0):
        hops, docs = t.data["hops"], t.data["docs"]
        for h in hops:
            hits = search_docs(docs, f"{h['subject']} {h['relation']}")
            doc = next(d for d in docs if d["title"] == h["subject"])
            assert doc in hits and str(doc["facts"][h["relation"]]) == str(h["answer"])
        assert check_answer(t, f"  {t.reference.upper()}.")[0]
        assert not check_answer(t, hops[-1]["subject"])[0]


def test_code_from_text():
    assert code_from_text("x\n```python\ndef f():\n    return 1\n```\n") == "def f():\n    return 1\n"
    assert code_from_text("Sure.\ndef g(): pass") == "def g(): pass\n"
    assert code_from_text("no code here") == ""


# --------------------------------------------------------------------------- public pools

def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_public_pool_readers(tmp_path, sandbox):
    m = _jsonl(tmp_path / "math500.jsonl", [{"problem": "What is $1+1$?", "answer": "2", "unique_id": "a/1"},
                                            {"problem": "Half of 3?", "answer": "\\frac{3}{2}", "unique_id": "a/2"}])
    he = _jsonl(tmp_path / "he.jsonl", [{"task_id": "HumanEval/0", "prompt": "def inc(x):\n", "entry_point": "inc",
                                         "canonical_solution": "    return x + 1\n",
                                         "test": "def check(candidate):\n    assert candidate(1) == 2\n"}])
    mb = _jsonl(tmp_path / "mbpp.jsonl", [{"task_id": 2, "prompt": "Double a number.", "code": "def dbl(x):\n    return 2*x\n",
                                           "test_list": ["assert dbl(2) == 4", "assert dbl(0) == 0"]}])
    hp = tmp_path / "hotpot.json"
    hp.write_text(json.dumps([{"_id": "h1", "question": "Who founded X?", "answer": "Ann", "type": "bridge",
                               "context": [["X", ["X was founded by Ann."]], ["Ann", ["Ann is a chemist."]]]}]))
    ga = _jsonl(tmp_path / "gaia.jsonl", [{"task_id": "g1", "Question": "2+2?", "Final answer": "4", "Level": 1}])
    tasks = {k: POOL_READERS[k](p) for k, p in [("math500", m), ("humaneval_plus", he), ("mbpp_plus", mb),
                                                 ("hotpotqa", hp), ("gaia", ga)]}
    assert [t.id for t in tasks["math500"]] == ["math500/a/1", "math500/a/2"]
    assert check_answer(tasks["math500"][1], "1.5")[0]
    assert not tasks["math500"][0].scripted
    he_t = tasks["humaneval_plus"][0]
    assert check_answer(he_t, "```python\ndef inc(x):\n    return x + 1\n```", sandbox)[0]
    assert not check_answer(he_t, "```python\ndef inc(x):\n    return x\n```", sandbox)[0]
    mb_t = tasks["mbpp_plus"][0]
    assert mb_t.data["function"] == "dbl" and check_answer(mb_t, mb_t.reference, sandbox)[0]
    hp_t = tasks["hotpotqa"][0]
    assert hp_t.domain == "agentic" and search_docs(hp_t.data["docs"], "founded X")[0]["title"] == "X"
    assert check_answer(hp_t, "ann")[0] and check_answer(tasks["gaia"][0], "4")[0]
    assert len(POOL_READERS["math500"](m, limit=1)) == 1


def test_public_pool_errors_name_file_line_field(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_text(json.dumps({"problem": "x", "answer": "1"}) + "\n" + json.dumps({"problem": "y"}) + "\n")
    with pytest.raises(SchemaError) as e:
        POOL_READERS["math500"](bad)
    assert e.value.line == 2 and e.value.field == "answer" and "m.jsonl" in str(e.value)
    broken = tmp_path / "g.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(SchemaError, match="g.jsonl:1"):
        POOL_READERS["gaia"](broken)
    hp = tmp_path / "h.json"
    hp.write_text(json.dumps([{"_id": "1", "question": "q", "answer": "a", "context": [["t", "not a list"]]}]))
    with pytest.raises(SchemaError, match=r"context\[0\]"):
        POOL_READERS["hotpotqa"](hp)
