"""The corpus's domains, one module each, registered in one table (DESIGN §4). A domain owns its
task generation, its checker and multi-agent template, its public-pool readers, and, per error
type, its slip predicates, injection targets and corruptions (`base.Domain`):

- `math`: multi-step word problems, MathSolver + Verifier (`compute`);
- `coding`: small modules of functions with unit tests, CodeWriter + CodeTester (`run_tests`);
- `agentic`: multi-hop questions over a local document store, Manager + search_agent.

    from aftraj.corpus.domains import DOMAINS, domain
    tasks = domain("math").generate(10, seed=0)

A new domain is a module with a `DOMAIN` entry, added to `DOMAINS` here; the builder, the
injector (`aftraj.corpus.inject`) and the slip detector (`aftraj.corpus.slips`) read it from here.
"""

from __future__ import annotations

from aftraj.corpus.domains import agentic, coding, math
from aftraj.corpus.domains.base import Domain

DOMAINS: dict[str, Domain] = {d.name: d for d in (math.DOMAIN, coding.DOMAIN, agentic.DOMAIN)}


def domain(name: str) -> Domain:
    """The domain called `name`; ValueError naming the known ones otherwise."""
    if name not in DOMAINS:
        raise ValueError(f"unknown domain {name!r}; choose one of {', '.join(DOMAINS)}")
    return DOMAINS[name]


__all__ = ["DOMAINS", "Domain", "domain"]
