"""scripts/train_stage1.sh runs the phases in order on CPU (one process each, tiny model): the
sampling server it starts answers phase 1 and is stopped before the training launch; a server
still answering at the config's endpoint stops the script before training. Marker `slow`: two
script runs of ~40-60 s each on a 2-core machine (Python start-ups, accelerate launch)."""

from __future__ import annotations

import calendar
import json
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
pytestmark = pytest.mark.slow

ONE_CPU = """compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
num_processes: 1
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
use_cpu: true
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, port, out, tiny_model_dir, corpus, **env):
    acc = tmp_path / "one-cpu.yaml"
    acc.write_text(ONE_CPU)
    args = ["--config", str(TINY), "--out", str(out), "--data", str(corpus), "--model", str(tiny_model_dir),
            "--max-steps", "1", "--no-progress", "--set", "report_to=[]", "--set", "sampler=openai",
            "--set", f"openai_base_url=http://127.0.0.1:{port}/v1", "--set", "openai_model=m",
            "--set", "samples_per_prompt=2"]
    full_env = {**os.environ, "PYTHON": sys.executable, "ACCELERATE_CONFIG": str(acc), "OMP_NUM_THREADS": "1",
                "SAMPLER_WAIT_S": "60", **env}
    return subprocess.run(["bash", str(REPO / "scripts" / "train_stage1.sh"), *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=600)


def test_script_samples_stops_the_server_then_trains(tiny_model_dir, handmade_corpus, tmp_path):
    port, exit_file, out = _port(), tmp_path / "server-exit", tmp_path / "run"
    r = _run(tmp_path, port, out, tiny_model_dir, handmade_corpus,
             SAMPLER_SERVER_CMD=f"{sys.executable} {SERVER} {port} {exit_file}")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert json.loads((out / "preference_stats.json").read_text())["n_samples"] == 2 * 9
    assert "sampling server" in r.stdout and "stopped" in r.stdout
    stopped = float(exit_file.read_text())
    started = calendar.timegm(time.strptime(json.loads((out / "run.json").read_text())["invocations"][0]["at"],
                                            "%Y-%m-%dT%H:%M:%SZ"))
    assert stopped < started + 1                    # the server was gone before training began
    assert (out / "final" / "model.safetensors").is_file()


def test_script_refuses_to_train_beside_a_live_sampler(tiny_model_dir, handmade_corpus, tmp_path):
    port, out = _port(), tmp_path / "run"
    server = subprocess.Popen([sys.executable, str(SERVER), str(port), str(tmp_path / "exit")])
    try:
        for _ in range(50):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        r = _run(tmp_path, port, out, tiny_model_dir, handmade_corpus)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert r.returncode != 0 and "still answers" in r.stderr
    assert (out / "preferences.jsonl").is_file() and not (out / "run.json").exists()
