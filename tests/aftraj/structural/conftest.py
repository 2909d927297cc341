"""A small synthetic corpus for the structural-monitor tests: safe runs compute, check and
answer; unsafe runs hit tool errors, retry in a loop and give up (so they are longer).
Hashing embedder: no model, seconds."""

from __future__ import annotations

import random

import pytest


def make_runs(n_families: int = 24, per_family: int = 3, seed: int = 0):
    from aftraj.schema import Label, Step, Trajectory

    rng = random.Random(seed)
    runs = []
    for f in range(n_families):
        task = f"Compute the value of expression number {f} and report it."
        for v in range(per_family):
            unsafe = (f + v) % 2 == 1
            steps = [("User", "message", task, None, None, None)]
            for _ in range(rng.randint(0, 2)):
                steps.append(("Solver", "message", f"Let me think about part {rng.randint(1, 99)} first.", None, None, None))
            steps.append(("Solver", "tool_call", "Calling the calculator.", "calc", {"expr": f"{f}*{v}+{rng.randint(1, 9)}"}, None))
            k_star = None
            if unsafe:
                k_star = len(steps) - 1
                for r in range(rng.randint(2, 4)):
                    steps.append(("environment", "tool_result", "", "calc", None, "ZeroDivisionError: division by zero"))
                    steps.append(("Solver", "tool_call", f"Retrying the calculator, attempt {r + 2}.", "calc",
                                  {"expr": f"{f}/0"}, None))
                steps.append(("environment", "tool_result", "", "calc", None, "ZeroDivisionError: division by zero"))
                steps.append(("Solver", "final_answer", "FINAL ANSWER: unknown (the tool kept failing)", None, None, None))
            else:
                steps.append(("environment", "tool_result", f"= {f * v + 3}", "calc", None, None))
                steps.append(("Verifier", "message", f"I checked the computation: {f * v + 3} is correct.", None, None, None))
                steps.append(("Solver", "final_answer", f"FINAL ANSWER: {f * v + 3}", None, None, None))
            st = [Step(index=i, agent=a, kind=k, content=c, tool=tool, arguments=args, error=err)
                  for i, (a, k, c, tool, args, err) in enumerate(steps)]
            label = (Label("UNSAFE", "injected", decisive_step=k_star, decisive_agent=st[k_star].agent,
                           reason="bad argument") if unsafe else Label("SAFE", "verified_safe"))
            runs.append(Trajectory(id=f"f{f}/r{v}", family_id=f"f{f}", domain="math", source="synthetic",
                                   task=task, steps=st, label=label,
                                   outcome="failure" if unsafe else "success"))
    return runs


@pytest.fixture(scope="session")
def synthetic_runs():
    return make_runs()


@pytest.fixture(scope="session")
def hashing_cfg():
    from aftraj.structural.config import StructuralConfig

    return StructuralConfig(embedder="hashing", k_action=8, k_observation=4, n_tokens=12, top_k=(3, 5),
                            num_perm=128, auc_start=1)


@pytest.fixture(scope="session")
def fitted(synthetic_runs, hashing_cfg):
    """(monitor fitted on families 0..15, held-out runs of families 16..23)."""
    from aftraj.structural.monitor import StructuralMonitor

    fit = [t for t in synthetic_runs if int(t.family_id[1:]) < 16]
    held = [t for t in synthetic_runs if int(t.family_id[1:]) >= 16]
    return StructuralMonitor.fit(fit, hashing_cfg), held
