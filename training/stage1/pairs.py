"""Boundary pairs (DESIGN §5): for each unsafe trajectory, the two prompts that differ by
exactly one step, rendered by the shared prompt builder (`aftraj.prompt`).

- pre-boundary prompt: prefix 0..k*-1, gold verdict SAFE (CONTINUE);
- post-boundary prompt: prefix 0..k*, gold verdict UNSAFE at (k*, a*) (ALARM).

k* = 0: there is no pre-boundary prefix (the first step is already the decisive one; an empty
prefix is never shown to the auditor, since the online walk starts at t = 0). Such a trajectory
contributes its post-boundary prompt only; the pre subset is filled by the other trajectories
(every batch still holds both subsets). `BoundaryStats.k0_post_only` counts them.

Safe trajectories have no boundary and contribute nothing to stage 1 (stage 2 uses them).

    from training.stage1.pairs import boundary_prompts
    prompts, stats = boundary_prompts(trajs, count_tokens=lambda s: len(tok(s).input_ids), budget=8192)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aftraj.prompt import Verdict, approx_tokens, gold_verdict, render
from aftraj.schema import Trajectory

PRE, POST = "pre", "post"
SUBSETS = (PRE, POST)


@dataclass(frozen=True)
class BoundaryPrompt:
    """One side of a boundary pair: the prompt for prefix t and its gold verdict."""

    traj_id: str
    subset: str            # "pre" | "post"
    t: int                 # last step shown
    messages: list[dict]   # system + user, from aftraj.prompt.render
    gold: Verdict
    agents: tuple[str, ...]  # agents seen in steps 0..t, the last one step t's (for a canonical wrong verdict)


@dataclass
class BoundaryStats:
    n_trajectories: int = 0
    n_safe_skipped: int = 0
    n_unsafe: int = 0
    k0_post_only: int = 0
    n_pre: int = 0
    n_post: int = 0


def boundary_pair(traj: Trajectory, *, budget: int | None = None,
                  count_tokens: Callable[[str], int] = approx_tokens) -> list[BoundaryPrompt]:
    """[pre, post] for an unsafe trajectory ([post] when k* = 0); [] for a safe one."""
    lb = traj.label
    if not lb.unsafe:
        return []
    k = lb.decisive_step
    out = []
    for subset, t in ((PRE, k - 1), (POST, k)):
        if t < 0:
            continue
        out.append(BoundaryPrompt(
            traj_id=traj.id, subset=subset, t=t,
            messages=render(traj, t, budget, count_tokens=count_tokens),
            gold=gold_verdict(traj, t),
            agents=tuple(reversed(dict.fromkeys(s.agent for s in reversed(traj.steps[: t + 1]))))))
    return out


def is_from_who_and_when(traj: Trajectory) -> bool:
    return traj.source.lower().replace("&", "_and_").startswith(("who_and_when", "whoandwhen"))


def boundary_prompts(trajs: Iterable[Trajectory], *, budget: int | None = None,
                     count_tokens: Callable[[str], int] = approx_tokens
                     ) -> tuple[list[BoundaryPrompt], BoundaryStats]:
    """Boundary prompts of every unsafe trajectory, in input order (pre before post)."""
    stats, out = BoundaryStats(), []
    for traj in trajs:
        stats.n_trajectories += 1
        if is_from_who_and_when(traj):
            raise ValueError(f"trajectory {traj.id!r} comes from Who&When ({traj.source}); Who&When "
                             f"is for evaluation only and is never trained on")
        if not traj.label.unsafe:
            stats.n_safe_skipped += 1
            continue
        stats.n_unsafe += 1
        pair = boundary_pair(traj, budget=budget, count_tokens=count_tokens)
        if len(pair) == 1:
            stats.k0_post_only += 1
        for p in pair:
            setattr(stats, f"n_{p.subset}", getattr(stats, f"n_{p.subset}") + 1)
        out.extend(pair)
    return out, stats
