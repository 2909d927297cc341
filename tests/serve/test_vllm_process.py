"""serve.vllm.running_vllm, the one way a vLLM server is started and stopped (the `aftraj serve
vllm` command, benchmarks/prefix_cache.py, the vLLM test fixtures), driven here by a stand-in
interpreter: a script that takes vLLM's command line, answers /health, and leaves a worker in its
process group, as vLLM's engine processes are."""

from __future__ import annotations

import os
import socket
import sys
import time

import httpx
import pytest

from serve.config import VllmConfig
from serve.vllm import VllmStartError, running_vllm

FAKE = """#!{python}
import http.server, subprocess, sys, time
args = sys.argv[1:]
assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"], args
port = int(args[args.index("--port") + 1])
mode = {mode!r}
print("fake vllm starting on", port, flush=True)
if mode == "exit":
    print("CUDA out of memory (a stand-in error)", flush=True)
    sys.exit(3)
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open({pidfile!r}, "w").write(str(worker.pid))
if mode == "hang":
    time.sleep(600)

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(tmp_path, mode: str) -> tuple[VllmConfig, str]:
    pidfile = str(tmp_path / "worker.pid")
    fake = tmp_path / "python"
    fake.write_text(FAKE.format(python=sys.executable, mode=mode, pidfile=pidfile))
    fake.chmod(0o755)
    cfg = VllmConfig(profile="cpu", python=str(fake), model=str(tmp_path), port=_port(), dtype="float32",
                     max_model_len=1024, gpu_memory_utilization=None, structured_outputs_backend=None,
                     health_timeout_s=60)
    return cfg, pidfile


def _gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie of an already-reaped group still answers kill(0): read its state
        try:
            if open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_running_vllm_waits_for_health_and_stops_the_whole_group(tmp_path):
    cfg, pidfile = _cfg(tmp_path, "serve")
    log = tmp_path / "vllm.log"
    with running_vllm(cfg, log=log, env={"EXTRA_FLAG": "1"}) as server:
        assert server.url == f"http://127.0.0.1:{cfg.port}" and server.ready_s >= 0
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        worker = int(open(pidfile).read())
        leader = server.proc.pid
    assert server.proc.poll() is not None                     # the server is stopped on the way out
    assert _gone(leader) and _gone(worker)                     # and its worker with it (one process group)
    assert "fake vllm starting" in log.read_text()


def test_running_vllm_stops_the_server_when_the_body_fails(tmp_path):
    cfg, pidfile = _cfg(tmp_path, "serve")
    with pytest.raises(KeyError):
        with running_vllm(cfg, log=tmp_path / "vllm.log") as server:
            raise KeyError("the caller's own failure")
    assert server.proc.poll() is not None and _gone(int(open(pidfile).read()))


def test_a_server_that_exits_is_a_start_error_with_its_log(tmp_path):
    cfg, _ = _cfg(tmp_path, "exit")
    with pytest.raises(VllmStartError, match="exited with code 3 before it was healthy") as e:
        with running_vllm(cfg, log=tmp_path / "vllm.log"):
            pytest.fail("the body must not run")
    assert "CUDA out of memory" in e.value.log_tail


@pytest.mark.slow
def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    cfg, pidfile = _cfg(tmp_path, "hang")
    with pytest.raises(VllmStartError, match="not healthy after 8 s"):
        with running_vllm(cfg, timeout_s=8, stop_timeout_s=5):
            pytest.fail("the body must not run")
    assert _gone(int(open(pidfile).read()))
