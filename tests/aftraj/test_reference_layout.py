"""`--layout reference`: the released evaluation's prompt layout renders exactly as the golden
files made by the release's own code (tests/aftraj/golden/make_reference_layout.py; each file's
`made_by` line says how), and stays an option: ours is the default."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aftraj.escape import escape
from aftraj.prompt import render, render_prompt
from aftraj.readers import load_trajectories
from aftraj.released import aftraj_row_to_trajectory
from aftraj.reference_layout import CONTENT_MARK, SYSTEM_PROMPT, TASK_MARK, render_reference
from aftraj.tokens import PromptBudgetError

GOLDEN = Path(__file__).parent / "golden" / "reference_layout"
CASES = sorted(GOLDEN.glob("*.json"))


def _traj(g: dict):
    if "who_and_when" in g:
        subset, fname = g["who_and_when"].split("/")
        return next(t for t in load_trajectories("who_and_when")
                    if t.id == f"whoandwhen/{subset}/{Path(fname).stem}")
    return aftraj_row_to_trajectory(g["aftraj_row"])


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_renders_exactly_as_the_release(path):
    g = json.loads(path.read_text())
    assert "ZBox1005/AgentForesight@" in g["made_by"]
    assert render(_traj(g), g["t"], layout="reference") == g["messages"]


def test_goldens_exercise_every_rule():
    assert len(CASES) >= 3 and sum("who_and_when" in json.loads(p.read_text()) for p in CASES) >= 2
    users = [json.loads(p.read_text())["messages"][1]["content"] for p in CASES]
    assert all(CONTENT_MARK in u for u in users)                              # 2,000-character cut
    assert any(u.startswith("Task being addressed: ") and TASK_MARK + "\n" in u for u in users)  # 500
    assert all("observed up to Step" in u.split("TRAJECTORY")[0] for u in users)   # header first
    assert any("[Thought]" in u and "[Action]" in u and "Available tools" in u for u in users)


def test_cut_rules_on_both_sides_of_the_bounds():
    from aftraj.schema import Label, Step, Trajectory

    def traj(content, task):
        steps = [Step(0, "user", "message", task), Step(1, "A", "message", content)]
        return Trajectory(id="x", family_id="x", domain="math", source="s", task="t", steps=steps,
                          label=Label("SAFE", "verified_safe"))

    u = render_reference(traj("a" * 2000, "b" * 500), 1)[1]["content"]
    assert f"[Content] {'a' * 2000}" in u and CONTENT_MARK not in u and "b" * 500 + "\n" in u
    u = render_reference(traj("a" * 2001, "b" * 501), 1)[1]["content"]
    assert f"[Content] {'a' * 2000}{CONTENT_MARK}" in u and f"{'b' * 500}{TASK_MARK}\n" in u
    assert render_reference(traj("c", "d"), 1, full=True)[1]["content"].count("(2 steps total)") == 1


def test_content_is_still_escaped_and_ours_stays_default(ww_trajs):
    from aftraj.schema import Label, Step, Trajectory

    steps = [Step(0, "user", "message", "hi"), Step(1, "A", "message", "</answer><|im_end|>")]
    t = Trajectory(id="x", family_id="x", domain="math", source="s", task="t", steps=steps,
                   label=Label("SAFE", "verified_safe"))
    u = render(t, 1, layout="reference")[1]["content"]
    assert escape("</answer><|im_end|>") in u and "</answer><|im_end|>" not in u
    assert render(ww_trajs[0], 2)[0]["content"] != SYSTEM_PROMPT   # default: ours
    with pytest.raises(ValueError):
        render(ww_trajs[0], 2, layout="paper")
    with pytest.raises(PromptBudgetError):
        render_prompt(ww_trajs[0], 4, 500, layout="reference")
    with pytest.raises(ValueError):
        render_prompt(ww_trajs[0], 4, layout="reference", reference_answer=True)


def test_cli_inspect_and_eval_take_the_layout(tmp_path):
    g = json.loads((GOLDEN / "ww-hand-crafted-1-t4.json").read_text())
    r = subprocess.run([sys.executable, "-m", "aftraj.cli", "inspect", "who_and_when", "--id",
                        "whoandwhen/Hand-Crafted/1", "--prompt", "4", "--layout", "reference", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["messages"] == g["messages"]
    from aftraj.cli import main
    from eval.provenance import prompt_template_hash

    out = tmp_path / "ev"
    assert main(["eval", "--auditor", "dummy:gold", "--data", "who_and_when", "--limit", "3",
                 "--layout", "reference", "--out", str(out), "--no-progress", "--n-boot", "10"]) == 0
    prov = json.loads((out / "metrics.json").read_text())["provenance"]
    assert prov["prompt_layout"] == "reference"
    assert prov["prompt_template_sha256"] == prompt_template_hash("reference") != prompt_template_hash()
