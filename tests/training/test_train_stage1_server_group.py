"""scripts/train_stage1.sh stops the sampling server's whole process group, not only its first
PID: vLLM with tensor parallelism runs worker processes that keep GPU memory when only the API
server is killed, and the FSDP launch that follows then runs out of memory. The fake server here
starts a "worker" (a `sleep` in its process group that ignores the server's shutdown) and the
preferences phase fails at once (no corpus), so the EXIT trap stops the server; the worker must
be gone too. Default suite: two Python start-ups, no training.

    pytest tests/training/test_train_stage1_server_group.py -q
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "stage1" / "tiny-cpu.yaml"
SERVER = REPO / "tests" / "training" / "fake_openai_server.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # a zombie is gone for our purpose
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow
def test_the_sampling_servers_workers_are_stopped_with_it(tmp_path):
    port, worker_pid = _port(), tmp_path / "worker.pid"
    # the "server": a worker child in the same process group, then the API server in the foreground
    cmd = (f"sh -c 'sleep 300 </dev/null >/dev/null 2>&1 & echo $! > {worker_pid}; exec {sys.executable} {SERVER} {port} {tmp_path / 'exit'}'")
    env = {**os.environ, "PYTHON": sys.executable, "SAMPLER_WAIT_S": "60", "SAMPLER_STOP_S": "10",
           "SAMPLER_SERVER_CMD": cmd}
    args = ["--config", str(TINY), "--out", str(tmp_path / "run"), "--data", str(tmp_path / "no-corpus"),
            "--no-progress", "--set", "sampler=openai", "--set", f"openai_base_url=http://127.0.0.1:{port}/v1",
            "--set", "openai_model=m", "--set", "samples_per_prompt=2"]
    r = subprocess.run(["bash", str(REPO / "scripts" / "train_stage1.sh"), *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "started sampling server" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert "stopped" in r.stdout, (r.stdout + r.stderr)[-3000:]
    pid = int(worker_pid.read_text())
    for _ in range(20):
        if not _alive(pid):
            break
        time.sleep(0.25)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "the server's worker outlived train_stage1.sh"
