"""The three multi-agent templates (DESIGN §4), one per domain, from the domain table:
MathSolver + Verifier (tool `compute`), CodeWriter + CodeTester (tool `run_tests`), Manager +
search_agent (tools `search`, `lookup`). Each is defined in its domain's module
(`aftraj.corpus.domains.<domain>`); their base class, the environment's name and the phrasing
helpers the injector shares in `aftraj.corpus.domains.base`.

    from aftraj.corpus.templates import TEMPLATES, template_for
    tpl = TEMPLATES["math"]
"""

from __future__ import annotations

from aftraj.corpus.domains import DOMAINS
from aftraj.corpus.domains.base import Template

TEMPLATES: dict[str, Template] = {name: d.template for name, d in DOMAINS.items()}


def template_for(domain: str) -> Template:
    if domain not in TEMPLATES:
        raise ValueError(f"no template for domain {domain!r}")
    return TEMPLATES[domain]


__all__ = ["TEMPLATES", "Template", "template_for"]
