"""The domain table (aftraj.corpus.domains): every domain fills every typed entry, the builder's
entry points dispatch through it, and an unknown domain or error type is refused by name."""

from __future__ import annotations

import pytest

from aftraj.corpus.config import ERROR_TYPES, POOL_KINDS
from aftraj.corpus.domains import DOMAINS, domain
from aftraj.corpus.domains.base import Domain, Task
from aftraj.corpus.inject import corrupt, targets
from aftraj.corpus.slips import PREDICATES
from aftraj.corpus.tasks import POOL_READERS, check_answer, generate_tasks
from aftraj.corpus.templates import TEMPLATES, template_for


def test_every_domain_fills_every_error_type():
    assert list(DOMAINS) == ["math", "coding", "agentic"]
    for name, d in DOMAINS.items():
        assert isinstance(d, Domain) and d.name == name and d.template.domain == name
        for table in (d.slips, d.targets, d.corruptions):
            assert list(table) == list(ERROR_TYPES), (name, list(table))
            assert all(callable(f) for f in table.values())


def test_the_entry_points_read_the_table():
    assert {n: t for n, t in TEMPLATES.items()} == {n: d.template for n, d in DOMAINS.items()}
    assert template_for("coding") is DOMAINS["coding"].template
    assert PREDICATES["agentic"] is DOMAINS["agentic"].slips
    assert sorted(POOL_READERS) == sorted(POOL_KINDS)          # every kind the config accepts has a reader
    kinds = [k for d in DOMAINS.values() for k in d.pools]
    assert len(kinds) == len(set(kinds))
    for name, d in DOMAINS.items():
        assert generate_tasks(name, 3, 7) == d.generate(3, 7)
        assert all(t.domain == name for t in generate_tasks(name, 3, 7))


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown domain 'poetry'; choose one of math, coding, agentic"):
        generate_tasks("poetry", 1, 0)
    with pytest.raises(ValueError, match="unknown domain 'poetry'"):
        domain("poetry")
    with pytest.raises(ValueError, match="no template for domain 'poetry'"):
        template_for("poetry")
    task = Task(id="x", domain="poetry", source="generated", prompt="p", reference="r")
    with pytest.raises(ValueError, match="unknown domain 'poetry'"):
        check_answer(task, "r")
    math = DOMAINS["math"]
    t = generate_tasks("math", 1, 0)[0]
    turns = [math.template.request_turn(t)]
    assert targets(math.template, t, turns, "no_such_type") == []
    with pytest.raises(ValueError, match="unknown error type 'no_such_type'"):
        corrupt(math.template, t, turns, 0, "no_such_type")


def test_the_checker_of_each_domain_needs_an_answer():
    for name in ("math", "agentic"):
        t = generate_tasks(name, 1, 0)[0]
        assert check_answer(t, None) == (False, "no final answer")
        assert check_answer(t, "  ") == (False, "no final answer")
        assert check_answer(t, t.reference) == (True, "answer matches")
        ok, why = check_answer(t, t.reference + "9")
        assert not ok and "!= reference" in why
    with pytest.raises(ValueError, match="need a sandbox"):
        check_answer(generate_tasks("coding", 1, 0)[0], "def f(): pass")
