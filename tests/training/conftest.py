"""Stage-1 fixtures: a small hand-made corpus (unsafe runs with known k*, a*, one with k* = 0,
and safe runs) written as a corpus folder, and a tiny-model stage-1 config factory."""

from __future__ import annotations

from pathlib import Path

import pytest

from aftraj.schema import Label, Step, Trajectory, write_jsonl

REPO = Path(__file__).resolve().parents[2]
TINY_CFG = REPO / "configs" / "stage1" / "tiny-cpu.yaml"

# (agents of steps 0.., k*, label) — a* is the agent of step k*.
_RUNS = [
    (["user", "Planner", "Coder", "Tester", "Coder"], 2),
    (["user", "MathSolver", "Verifier", "MathSolver"], 1),
    (["user", "Manager", "search_agent", "Manager", "search_agent"], 3),
    (["user", "MathSolver", "Verifier"], 0),
    (["user", "Coder", "Tester", "Coder"], 3),
    (["user", "MathSolver", "Verifier", "MathSolver", "Verifier"], None),   # safe
]


def handmade_trajectories() -> list[Trajectory]:
    out = []
    for i, (agents, k) in enumerate(_RUNS):
        steps = [Step(index=j, agent=a, kind="message",
                      content=f"run {i} step {j}: {a} reports value {i * 10 + j}"
                              + (" (this is wrong)" if k is not None and j == k else ""))
                 for j, a in enumerate(agents)]
        label = (Label(verdict="SAFE", label_source="verified_safe") if k is None else
                 Label(verdict="UNSAFE", label_source="injected", decisive_step=k,
                       decisive_agent=agents[k], reason=f"{agents[k]} reported a wrong value at step {k}."))
        out.append(Trajectory(id=f"hand-{i}", family_id=f"fam-{i}", domain="math", source="handmade",
                              task=f"Task {i}: report the values.", steps=steps, label=label,
                              outcome="success" if k is None else "failure"))
    return out


@pytest.fixture
def handmade():
    """A fresh list of the hand-made trajectories."""
    return handmade_trajectories()


@pytest.fixture(scope="session")
def handmade_corpus(tmp_path_factory) -> Path:
    """A corpus folder holding train.jsonl (and a decoy corpus.jsonl that must not be read)."""
    d = tmp_path_factory.mktemp("corpus")
    write_jsonl(handmade_trajectories(), d / "train.jsonl")
    write_jsonl(handmade_trajectories()[:1], d / "corpus.jsonl")
    return d


@pytest.fixture
def stage1_cfg(tmp_path, tiny_model_dir, handmade_corpus):
    """make(**overrides) -> a validated Stage1Config on the tiny model and hand-made corpus."""
    from training.stage1.config import load_stage1_config

    def make(**over):
        base = {"model": str(tiny_model_dir), "data": str(handmade_corpus),
                "output_dir": str(tmp_path / "run"), "report_to": [], "samples_per_prompt": 0}
        return load_stage1_config(TINY_CFG, {**base, **over})
    return make
