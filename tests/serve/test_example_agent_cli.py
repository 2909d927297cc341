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
