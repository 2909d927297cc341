"""The boundary pair and the label rules training reads (DESIGN §5, amended 2026-12-01): stage 1
trains on the pairs, the boundary probe (`eval/probe.py`) scores them, stage 2 and the fits refuse
what carries no gold label.

Boundary pairs: for each unsafe trajectory, the prompts that differ by exactly one step, rendered
by the shared prompt builder (`aftraj.prompt`), each with its gold verdict and its canonical wrong
verdict (both worded by `aftraj.verdict.canonical_verdict`).

- pre-boundary prompt: prefix 0..k*-1, gold SAFE; wrong: an ALARM blaming the latest *agent* step
  <= k*-1 (never a tool result or an `environment` step: otherwise "never blame environment" wins
  the pre subset without reading content, as 86 of 178 train runs of the demo corpus showed);
- post-boundary prompt: prefix 0..k*, gold ALARM at (k*, a*); wrong: SAFE (a missed alarm);
- twin prompt (optional, beyond the paper): where the run's family holds a verified-safe *twin*
  (identical steps up to k*-1, the same agent, kind and tool at k*, only step k*'s content differs), the twin's
  prefix 0..k*, gold SAFE; wrong: ALARM at (k*, a*). Post vs twin is the content control: two
  prompts of the same length, agents and kinds, that only the content of step k* tells apart.

k* = 0: there is no pre-boundary prefix (an empty prefix is never shown to the auditor, since the
online walk starts at t = 0); such a trajectory contributes its post (and twin) prompt only
(`BoundaryStats.k0_post_only`). A pre prefix with no agent step (only tool results before k*) has
no well-formed premature alarm either and contributes no pre prompt (`no_agent_step_pre`).

Safe trajectories have no boundary and contribute nothing by themselves (stage 2 uses them).

The unlabeled-run rule: a run imported by an adapter carries the placeholder label `UNLABELED`
(SAFE, `provenance.unlabeled`, `meta.unlabeled`), which is no gold; training and fitting refuse it
(`refuse_unlabeled`), evaluation and the summaries count it apart (`is_unlabeled`). Who&When is
for evaluation only and is never trained on (`is_from_who_and_when`).

    from aftraj.boundary import boundary_prompts
    prompts, stats = boundary_prompts(trajs, count_tokens=lambda s: len(tok(s).input_ids), budget=8192,
                                      twins=True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from aftraj.prompt import render
from aftraj.schema import Label, Trajectory
from aftraj.tokens import approx_tokens
from aftraj.verdict import Verdict, canonical_verdict, gold_verdict

# --------------------------------------------------------------------------- the label rules

UNLABELED = Label(verdict="SAFE", label_source="external", provenance={"unlabeled": True})


def is_unlabeled(traj: Trajectory) -> bool:
    """True for a run imported by an adapter: its SAFE label is the placeholder, not gold."""
    return bool((traj.label.provenance or {}).get("unlabeled") or traj.meta.get("unlabeled"))


def refuse_unlabeled(trajs, where: str) -> None:
    """Raise ValueError naming the first unlabeled trajectory (and the count) in `trajs`:
    training and fitting must never read the placeholder label as gold SAFE."""
    bad = [t.id for t in trajs if is_unlabeled(t)]
    if bad:
        raise ValueError(f"{where}: trajectory {bad[0]!r} ({len(bad)} of {len(trajs)}) carries no gold label "
                         f"(imported from an agent framework, meta.unlabeled); label it first, or leave it out")


def is_from_who_and_when(traj: Trajectory) -> bool:
    """A Who&When run (evaluation only: never trained on)."""
    return traj.source.lower().replace("&", "_and_").startswith(("who_and_when", "whoandwhen"))


# --------------------------------------------------------------------------- boundary pairs

PRE, POST, TWIN = "pre", "post", "twin"
SUBSETS = (PRE, POST, TWIN)
NON_AGENTS = frozenset({"environment", "tool", "tools", "system"})


@dataclass(frozen=True)
class BoundaryPrompt:
    """One prompt of a boundary pair: prefix t of a run, its gold verdict and the canonical wrong one."""

    traj_id: str           # the unsafe run the pair belongs to (for a twin prompt too)
    subset: str            # "pre" | "post" | "twin"
    t: int                 # last step shown
    messages: list[dict]   # system + user, from aftraj.prompt.render
    gold: Verdict
    wrong: Verdict         # the boundary error on this prompt (canonical rejected side)
    agents: tuple[str, ...]  # agents seen in steps 0..t, the last one step t's
    prompt_traj_id: str = ""  # the run whose prefix is shown (the twin's id on a twin prompt)


@dataclass
class BoundaryStats:
    n_trajectories: int = 0
    n_safe_skipped: int = 0
    n_unsafe: int = 0
    k0_post_only: int = 0
    no_agent_step_pre: int = 0
    n_pre: int = 0
    n_post: int = 0
    n_twin: int = 0
    over_budget_skipped: int = 0


def is_agent_step(step) -> bool:
    """A step an agent wrote (not a tool result, not the environment or the system)."""
    return step.kind != "tool_result" and step.agent.strip().casefold() not in NON_AGENTS


def latest_agent_step(traj: Trajectory, t: int) -> int | None:
    """Index of the latest agent step <= t (None when steps 0..t hold none)."""
    for j in range(t, -1, -1):
        if is_agent_step(traj.steps[j]):
            return j
    return None


def _same_step(a, b) -> bool:
    return (a.agent, a.kind, a.content, a.tool, a.arguments, a.error) == (b.agent, b.kind, b.content, b.tool,
                                                                  b.arguments, b.error)


def is_twin(unsafe: Trajectory, safe: Trajectory) -> bool:
    """`safe` is a verified-safe twin of `unsafe`: same family, identical steps 0..k*-1, the same
    agent, step kind and tool at step k*, and a different step k* content (the only thing that tells
    the two prefixes apart). A post whose step k* changed kind (a fabricated result where the twin
    calls a tool) has no twin: kind alone would tell them apart."""
    lb = unsafe.label
    if not lb.unsafe or safe.label.unsafe or safe.label.label_source != "verified_safe":
        return False
    k = lb.decisive_step
    if safe.family_id != unsafe.family_id or len(safe.steps) <= k or len(unsafe.steps) <= k:
        return False
    a, b = safe.steps[k], unsafe.steps[k]
    if (a.agent, a.kind, a.tool) != (b.agent, b.kind, b.tool) or _same_step(a, b):
        return False
    return all(_same_step(a, b) for a, b in zip(safe.steps[:k], unsafe.steps[:k], strict=True))


def find_twins(trajs: Sequence[Trajectory]) -> dict[str, Trajectory]:
    """{unsafe run id: its verified-safe twin} over `trajs` (the first twin in input order)."""
    safe_by_family: dict[str, list[Trajectory]] = {}
    for t in trajs:
        if not t.label.unsafe:
            safe_by_family.setdefault(t.family_id, []).append(t)
    out = {}
    for t in trajs:
        if t.label.unsafe:
            for s in safe_by_family.get(t.family_id, ()):
                if is_twin(t, s):
                    out[t.id] = s
                    break
    return out


def _agents(traj: Trajectory, t: int) -> tuple[str, ...]:
    return tuple(reversed(dict.fromkeys(s.agent for s in reversed(traj.steps[: t + 1]))))


def boundary_pair(traj: Trajectory, *, budget: int | None = None,
                  count_tokens: Callable[[str], int] = approx_tokens,
                  twin: Trajectory | None = None) -> list[BoundaryPrompt]:
    """[pre, post, twin] for an unsafe trajectory (pre absent when k* = 0 or no agent step precedes
    k*; twin only when given); [] for a safe one."""
    lb = traj.label
    if not lb.unsafe:
        return []
    k, a = lb.decisive_step, lb.decisive_agent
    out = []

    def add(subset: str, run: Trajectory, t: int, gold: Verdict, wrong: Verdict) -> None:
        out.append(BoundaryPrompt(traj_id=traj.id, subset=subset, t=t,
                                  messages=render(run, t, budget, count_tokens=count_tokens),
                                  gold=gold, wrong=wrong, agents=_agents(run, t), prompt_traj_id=run.id))

    if k >= 1:
        j = latest_agent_step(traj, k - 1)
        if j is not None:
            add(PRE, traj, k - 1, gold_verdict(traj, k - 1), canonical_verdict(k - 1, j, traj.steps[j].agent))
    add(POST, traj, k, gold_verdict(traj, k), canonical_verdict(k))
    if twin is not None:
        if not is_twin(traj, twin):
            raise ValueError(f"{twin.id!r} is not a verified-safe twin of {traj.id!r}")
        add(TWIN, twin, k, canonical_verdict(k), canonical_verdict(k, k, a))
    return out


def boundary_prompts(trajs: Iterable[Trajectory], *, budget: int | None = None,
                     count_tokens: Callable[[str], int] = approx_tokens, twins: bool = False,
                     max_post_tokens: int | None = None) -> tuple[list[BoundaryPrompt], BoundaryStats]:
    """Boundary prompts of every unsafe trajectory, in input order (pre, post, then twin).
    `twins`: add the twin subset where a run's family (among `trajs`) holds a twin.
    `max_post_tokens`: skip a run whose full post-boundary prompt (no bounded view) is longer, so
    every prompt trained on shows the whole prefix, evidence included (counted)."""
    trajs = list(trajs)
    stats, out = BoundaryStats(), []
    twin_of = find_twins(trajs) if twins else {}
    for traj in trajs:
        stats.n_trajectories += 1
        if is_from_who_and_when(traj):
            raise ValueError(f"trajectory {traj.id!r} comes from Who&When ({traj.source}); Who&When "
                             f"is for evaluation only and is never trained on")
        if not traj.label.unsafe:
            stats.n_safe_skipped += 1
            continue
        if max_post_tokens is not None and prompt_tokens(traj, traj.label.decisive_step,
                                                         count_tokens) > max_post_tokens:
            stats.over_budget_skipped += 1
            continue
        stats.n_unsafe += 1
        pair = boundary_pair(traj, budget=budget, count_tokens=count_tokens, twin=twin_of.get(traj.id))
        subsets = {p.subset for p in pair}
        if traj.label.decisive_step == 0:
            stats.k0_post_only += 1
        elif PRE not in subsets:
            stats.no_agent_step_pre += 1
        for p in pair:
            setattr(stats, f"n_{p.subset}", getattr(stats, f"n_{p.subset}") + 1)
        out.extend(pair)
    return out, stats


def prompt_tokens(traj: Trajectory, t: int, count_tokens: Callable[[str], int] = approx_tokens) -> int:
    """Tokens of the full (unbounded) prompt for prefix t: system + user message, no template."""
    msgs = render(traj, t, None)
    return sum(count_tokens(m["content"]) for m in msgs)
