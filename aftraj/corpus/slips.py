"""The slip detector (DESIGN §4 "Validity"): one predicate per injection type and domain (each in
its domain's module, `aftraj.corpus.domains.<domain>`), each reading only the prefix that ends at the
step it judges (the step's content, the turns before it and the task), never the simulator's slip
record. Three users, one definition:

- safe curation rejects a successful run that holds any slip, even one caught later;
- the injector keeps a corruption only if the detector sees it at its step (the error is
  visible in the prefix that ends at it);
- the scripted diagnosis judge proposes the detector's findings on a failed run.

    from aftraj.corpus.slips import find_slips
    for f in find_slips(template, task, rollout.turns): print(f.step, f.type, f.reason)
"""

from __future__ import annotations

from dataclasses import dataclass

from aftraj.corpus.config import ERROR_TYPES
from aftraj.corpus.domains import DOMAINS
from aftraj.corpus.domains.base import act


@dataclass(frozen=True)
class Finding:
    step: int
    agent: str
    type: str
    reason: str


# domain -> error type -> predicate(template, task, turns, j) -> reason | None (each domain's module)
PREDICATES = {name: d.slips for name, d in DOMAINS.items()}
assert all(set(p) == set(ERROR_TYPES) for p in PREDICATES.values())


def slips_at(template, task, turns, j: int) -> list[Finding]:
    """Every injection type whose predicate holds at step j (reading turns[: j + 1] only)."""
    t = turns[j]
    if j == 0 or t.kind == "tool_result" or str(act(t)).startswith("llm_"):
        return []
    prefix = list(turns[: j + 1])
    out = []
    for etype, pred in PREDICATES.get(template.domain, {}).items():
        why = pred(template, task, prefix, j)
        if why:
            out.append(Finding(j, t.agent, etype, why))
    return out


def find_slips(template, task, turns) -> list[Finding]:
    """Every slip of a run, earliest first."""
    return [f for j in range(1, len(turns)) for f in slips_at(template, task, turns, j)]


__all__ = ["Finding", "PREDICATES", "find_slips", "slips_at"]
