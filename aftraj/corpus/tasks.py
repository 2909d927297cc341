"""Task pools with deterministic checkers (DESIGN §4), generated offline from a seed, plus readers
for local copies of the public pools the paper used (nothing downloads). Each domain's tasks,
checker and readers live in its module under `aftraj.corpus.domains` (math: word problems
checked exactly, then symbolically; coding: functions with unit tests run in the sandbox;
agentic: multi-hop questions over a local document store, normalised match); this module reaches
them through the domain table.

    from aftraj.corpus.tasks import generate_tasks, check_answer
    tasks = generate_tasks("math", 10, seed=0)
    python -m aftraj.cli corpus build --config configs/corpus/demo-small.yaml --out out/demo
"""

from __future__ import annotations

from aftraj.corpus.domains import DOMAINS, domain
from aftraj.corpus.domains.base import Task


def check_answer(task: Task, final_answer: str | None, sandbox=None) -> tuple[bool, str]:
    """The deterministic checker of a task's domain: (passed, reason). Coding tasks need a sandbox."""
    return domain(task.domain).template.check(task, final_answer, sandbox)


def generate_tasks(domain_name: str, n: int, seed: int, *, humaneval: bool = False, screen=None) -> list[Task]:
    """n tasks of a domain; coding tasks draw some of their functions from HumanEval when asked
    (each problem used once, in a seeded order; `screen(functions) -> functions` may drop problems
    or mutants first, e.g. by running their tests)."""
    return domain(domain_name).generate(n, seed, humaneval=humaneval, screen=screen)


# public pool kind (config `public_pools[].kind`) -> reader(path, limit) -> tasks
POOL_READERS = {kind: reader for d in DOMAINS.values() for kind, reader in d.pools.items()}

__all__ = ["POOL_READERS", "Task", "check_answer", "generate_tasks"]
