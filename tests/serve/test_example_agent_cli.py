"""Small things a first user meets: the gateway prints where it listens, the example agent
prints its run id, stream URL and web page and its --help is the whole story, and the README's
example talks to the port the shipped config listens on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def test_readme_example_uses_the_shipped_configs_port_and_key():
    cfg = yaml.safe_load((REPO / "configs/serve/gateway-local.yaml").read_text())
    readme = (REPO / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "python -m serve.example_agent" in x)
    port = int(re.search(r"--gateway http://127\.0\.0\.1:(\d+)", line).group(1))
    assert port == cfg["port"]
    key = re.search(r"--key (\S+)", line).group(1)
    assert f'"{key}"' in (REPO / "configs/serve/gateway-local.yaml").read_text()    # the config's demo key


def test_example_agent_help_is_whole(capsys):
    from serve.example_agent import main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m serve.example_agent" in out
    assert "aftraj serve gateway --config configs/serve/gateway-local.yaml" in out     # the docstring, whole
    assert "exits 0 when the auditor stopped the run" in out and "--run-id" in out


def test_gateway_prints_its_address_and_the_agent_its_run(gateway_process, fake_auditor, gw_key, capsys):
    from serve.example_agent import main
    fake = fake_auditor("418")
    g = gateway_process(auditor={"backend": "openai", "base_url": fake.url, "model": "auditor", "deadline_s": 5.0})
    g.start()
    assert f"listening on {g.url}" in g.log.read_text()
    assert main(["--gateway", g.url, "--key", gw_key, "--run-id", "pens-1"]) == 0      # stopped by the ALARM
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "run pens-1"
    assert out[1] == f"stream: curl -N -H 'Authorization: Bearer <key>' {g.url}/v1/runs/pens-1/stream"
    assert out[2] == f"web view: {g.url}/ui/runs/pens-1"
    assert out[-1] == "stopped by the auditor at step 3"


def test_the_example_agent_replays_a_recorded_run_and_stops_where_the_auditor_alarms(
        gateway_process, fake_auditor, gw_key, capsys, tmp_path):
    """`--replay FILE --trajectory ID` (the demo's live run): one event a step, with the steps'
    kinds and tools, stopped at the first ALARM."""
    from aftraj.schema import Label, Step, Trajectory, write_jsonl
    from serve.example_agent import main

    steps = (Step(0, "Planner", "message", "Plan: add the two prices."),
             Step(1, "Calculator", "tool_call", "", tool="compute", arguments={"expression": "3.5+4"}),
             Step(2, "Calculator", "tool_result", "7.5", tool="compute"),
             Step(3, "Calculator", "message", "3.5 + 4 = 8.25 [[BAD]]"),
             Step(4, "Planner", "final_answer", "8.25"))
    other = Trajectory(id="other", family_id="f0", domain="math", source="test", task="t", steps=steps[:1],
                       label=Label("SAFE", "external"))
    traj = Trajectory(id="prices-1", family_id="f1", domain="math", source="test", task="Add 3.5 and 4.",
                      steps=steps, label=Label("UNSAFE", "external", decisive_step=3, decisive_agent="Calculator"))
    write_jsonl([other, traj], tmp_path / "runs.jsonl")
    fake = fake_auditor("[[BAD]]")
    g = gateway_process(auditor={"backend": "openai", "base_url": fake.url, "model": "auditor", "deadline_s": 5.0})
    g.start()
    assert main(["--gateway", g.url, "--key", gw_key, "--replay", str(tmp_path / "runs.jsonl"),
                 "--trajectory", "prices-1", "--run-id", "replay-1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "replaying prices-1: labelled unsafe, decisive step 3 (Calculator)"
    assert [x.split(":")[0] for x in out if x.startswith("step ")] == ["step 0", "step 1", "step 2", "step 3"]
    assert out[-1] == "stopped by the auditor at step 3" and "k=3 agent=Calculator" in out[-2]
    # the auditor saw the tool call as a tool call (kind and tool kept)
    assert 'kind="tool_call"' in fake.bodies[-1]["messages"][-1]["content"]
    with pytest.raises(SystemExit):
        main(["--gateway", g.url, "--key", gw_key, "--replay", str(tmp_path / "runs.jsonl"), "--trajectory", "nope"])
