"""Gateway processes for the serve tests: `aftraj serve gateway --config …` started as a real
process on 127.0.0.1 with a temporary ledger, and a small fake OpenAI-compatible auditor."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from serve.config import hash_key

REPO = Path(__file__).resolve().parents[2]
KEY = "proc-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    """One `aftraj serve gateway` process; `kill9()` and `start()` again on the same config."""

    def __init__(self, tmp: Path, *, ledger_url: str | None = None, auditor: dict | None = None,
                 port: int | None = None, name: str = "gw", limits: dict | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg = tmp / f"{name}.yaml"
        self.log = tmp / f"{name}.log"
        self.cfg.write_text(yaml.safe_dump({
            "kind": "gateway", "host": "127.0.0.1", "port": self.port,
            "ledger_url": ledger_url or f"sqlite:///{tmp / 'ledger.db'}",
            "api_keys": [{"name": "t", "sha256": hash_key(KEY)}],
            "auditor": auditor or {"backend": "none"},
            "limits": {"rate_per_s": 100000, "burst": 100000, "max_events_per_batch": 1000, **(limits or {})}}))
        self.proc = None

    def start(self, timeout: float = 60) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        fh = open(self.log, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "aftraj.cli", "serve", "gateway", "--config",
                                      str(self.cfg)], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"gateway not healthy: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill9()


@pytest.fixture
def gateway_process(tmp_path):
    made = []

    def make(**kw):
        g = GatewayProcess(tmp_path, **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.stop()


_STEP = re.compile(r'<step index=(\d+) agent="((?:[^"\\]|\\.)*)"')


class FakeAuditor:
    """An OpenAI-compatible auditor that alarms at the first shown step holding `trigger`
    (blaming that step's agent); records every request body."""

    def __init__(self, trigger: str):
        self.trigger, self.bodies = trigger, []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                user = body["messages"][-1]["content"]
                steps = [(int(m.group(1)), json.loads(f'"{m.group(2)}"')) for m in _STEP.finditer(user)]
                blocks = user.split("<step index=")[1:]
                bad = next(((k, a) for (k, a), b in zip(steps, blocks, strict=True) if fake.trigger in b), None)
                ans = ({"answer": "SAFE", "agent": None, "reason": None} if bad is None else
                       {"answer": bad[0], "agent": bad[1], "reason": f"{fake.trigger} is wrong"})
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content":
                                                f"<think>checked</think><answer>{json.dumps(ans)}</answer>"},
                                                "finish_reason": "stop"}],
                                   "usage": {"prompt_tokens": 10, "completion_tokens": 5}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_auditor():
    made = []

    def make(trigger: str) -> FakeAuditor:
        f = FakeAuditor(trigger)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


@pytest.fixture
def gw_key() -> str:
    return KEY


@pytest.fixture
def port_factory():
    return free_port


@pytest.fixture
def serve_app():
    """`serve_app(app) -> url`: the app under uvicorn on a free 127.0.0.1 port, in a thread of
    this process (stopped at teardown): for tests that need a real server (SSE, disconnects)."""
    import uvicorn

    servers = []

    def start(app) -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        t0 = time.monotonic()
        while not server.started:
            assert time.monotonic() - t0 < 30, "the server did not start"
            time.sleep(0.05)
        servers.append(server)
        return f"http://127.0.0.1:{port}"

    yield start
    for s in servers:
        s.should_exit = True
