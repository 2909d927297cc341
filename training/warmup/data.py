"""Warm-up examples: a random prefix t of a train-split run, rendered by the one prompt builder,
with a target verdict drawn from a seeded RNG that never reads the label or the content: with
probability `alarm_fraction` an ALARM at the last shown step t blaming steps[t].agent (the step
the prompt's last line names: "Verdict on steps 0 to t"), else SAFE. The model learns the format,
not the boundary (NOT in the paper). The verdicts are worded by `aftraj.verdict.canonical_verdict`,
the one wording stage 1 and the probe use: the decision is a coin, so greedy decoding keeps the
majority answer (SAFE) and the base row measures no boundary.

Why the last step and not a random one: with the ALARM at a uniformly random step s <= t the
parse rate fell as training went on (benchmarks/README.md): a random step is noise the model
cannot fit, and greedy decoding settles on a wrong mode. The last step is a
deterministic function of the prompt (copy its index and agent), the verdict shape an online
auditor gives when an alarm is on time.

    from training.warmup.data import warmup_examples
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from aftraj.prompt import render
from aftraj.schema import Trajectory
from aftraj.tokens import approx_tokens
from aftraj.verdict import Verdict, canonical_verdict, format_completion


def draw_verdict(rng: random.Random, traj: Trajectory, t: int, alarm_fraction: float) -> Verdict:
    """A content-independent verdict for prefix t (reads only t and the agent of step t)."""
    if rng.random() < alarm_fraction:
        return canonical_verdict(t, t, traj.steps[t].agent)
    return canonical_verdict(t)


def warmup_examples(trajs: Sequence[Trajectory], n: int, *, seed: int, alarm_fraction: float,
                    budget: int | None = None,
                    count_tokens: Callable[[str], int] = approx_tokens) -> list[dict]:
    """n examples {traj_id, t, messages, completion}, seeded; trajectories with no steps skipped."""
    pool = [tr for tr in trajs if tr.steps]
    if not pool:
        raise ValueError("no trajectory with steps to warm up on")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tr = pool[rng.randrange(len(pool))]
        t = rng.randrange(len(tr.steps))
        v = draw_verdict(rng, tr, t, alarm_fraction)
        out.append({"traj_id": tr.id, "t": t, "completion": format_completion(v),
                    "messages": render(tr, t, budget, count_tokens=count_tokens)})
    return out


def check_prefixes(trajs: Sequence[Trajectory], n: int, *, seed: int) -> list[tuple[Trajectory, int]]:
    """n seeded (trajectory, t) prefixes for the parse check (distinct where possible)."""
    allp = [(tr, t) for tr in trajs for t in range(len(tr.steps))]
    rng = random.Random(seed + 1)
    return rng.sample(allp, n) if n <= len(allp) else allp
