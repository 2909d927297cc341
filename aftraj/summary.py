"""A dataset summary per subset: trajectories, steps, agents, approximate prompt tokens, label
mix (runs imported by an adapter count as "unlabeled", not safe) and the decisive-step distribution. Used by `aftraj summary` and the demo.

    aftraj summary who_and_when
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from aftraj.boundary import is_unlabeled
from aftraj.prompt import render_prompt
from aftraj.schema import Trajectory
from aftraj.tokens import approx_tokens

STEP_BUCKETS = ((0, 0), (1, 4), (5, 9), (10, 19), (20, 49), (50, None))


def subset_of(t: Trajectory) -> str:
    return str(t.meta.get("subset") or t.meta.get("split") or t.domain)


def _bucket(k: int) -> str:
    for lo, hi in STEP_BUCKETS:
        if hi is None or k <= hi:
            return f"{lo}" if lo == hi else (f"{lo}+" if hi is None else f"{lo}-{hi}")
    raise AssertionError


def summarise(trajs: Iterable[Trajectory]) -> dict[str, dict]:
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[subset_of(t)].append(t)
        groups["all"].append(t)
    out = {}
    for name, ts in sorted(groups.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        n_steps = [len(t.steps) for t in ts]
        tokens = [approx_tokens("".join(m["content"] for m in render_prompt(t, len(t.steps) - 1).messages))
                  for t in ts]
        unsafe = [t for t in ts if t.label.unsafe]
        unlabeled = sum(map(is_unlabeled, ts))   # an adapter's placeholder SAFE is no label
        ks = [t.label.decisive_step for t in unsafe]
        rel = [t.label.decisive_step / max(1, len(t.steps) - 1) for t in unsafe]
        out[name] = {
            "trajectories": len(ts),
            "safe": len(ts) - len(unsafe) - unlabeled, "unsafe": len(unsafe), "unlabeled": unlabeled,
            "steps_total": sum(n_steps), "steps_mean": sum(n_steps) / len(ts),
            "steps_max": max(n_steps),
            "agents_distinct": len({a for t in ts for a in t.agents}),
            "agents_per_trajectory": sum(len(t.agents) for t in ts) / len(ts),
            "approx_prompt_tokens_mean": sum(tokens) / len(ts), "approx_prompt_tokens_max": max(tokens),
            "label_sources": dict(sorted(Counter("unlabeled" if is_unlabeled(t) else t.label.label_source
                                                 for t in ts).items())),
            "decisive_step_hist": {b: c for b, c in sorted(Counter(map(_bucket, ks)).items(),
                                                           key=lambda kv: int(kv[0].split("-")[0].rstrip("+")))},
            "decisive_step_mean": sum(ks) / len(ks) if ks else None,
            "decisive_relative_position_mean": sum(rel) / len(rel) if rel else None,
        }
    return out


def format_summary(summary: dict[str, dict]) -> str:
    lines = []
    for name, s in summary.items():
        lab = f"{s['safe']} safe, {s['unsafe']} unsafe" + (f", {s['unlabeled']} unlabeled" if s.get("unlabeled") else "")
        lines.append(f"== {name}: {s['trajectories']} trajectories ({lab})")
        lines.append(f"   steps: {s['steps_total']} total, {s['steps_mean']:.1f} mean, {s['steps_max']} max")
        lines.append(f"   agents: {s['agents_distinct']} distinct, {s['agents_per_trajectory']:.1f} per trajectory")
        lines.append(f"   prompt tokens (approx., whole trajectory): {s['approx_prompt_tokens_mean']:.0f} mean, "
                     f"{s['approx_prompt_tokens_max']} max")
        lines.append(f"   label sources: {s['label_sources']}")
        if s["decisive_step_mean"] is not None:
            hist = ", ".join(f"{b}: {c}" for b, c in s["decisive_step_hist"].items())
            lines.append(f"   decisive step: mean {s['decisive_step_mean']:.1f}, relative position "
                         f"{s['decisive_relative_position_mean']:.2f}; histogram {hist}")
    return "\n".join(lines)
