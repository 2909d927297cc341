"""One real `aftraj serve gateway` process for the benchmarks (gateway_load, gateway_steps,
half_open, web_attack): its config written with a free 127.0.0.1 port, started in a session of
its own from the working tree or another revision's code (`code_at`), its log in a file, up when
`/healthz` answers 200, its CPU and peak memory read from /proc, stopped with its children.

    from _gateway import Gateway, code_at
    with Gateway(tmp, {"ledger_url": ..., "api_keys": [...], "auditor": {"backend": "none"}}) as gw:
        httpx.get(f"{gw.url}/healthz")
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def code_at(rev: str | None, dest: Path, paths: tuple[str, ...] = ()) -> Path:
    """The code to run: the working tree (`rev` None or "."), else revision `rev` (or only its
    `paths`) unpacked from `git archive` into `dest` (the index is not touched)."""
    if rev in (None, "."):
        return REPO
    dest.mkdir(parents=True, exist_ok=True)
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev, *paths], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    return dest


class Gateway:
    """`cfg` (the gateway config as a dict; `kind`, `host` and `port` are filled in) is written to
    `tmp/<name>.yaml`; `start()` runs the gateway from `code` (`PYTHONPATH` too) with `env` added
    to this process's environment, and returns once `/healthz` answers 200. `argv(config_path)`
    replaces the default command (`python -m aftraj.cli serve gateway --config …`). A gateway that
    exits or is not healthy within `start_timeout_s` is a SystemExit with its log's tail."""

    def __init__(self, tmp: Path, cfg: dict, *, code: Path = REPO, name: str = "gw", env: dict | None = None,
                 argv: Callable[[Path], list[str]] | None = None, start_timeout_s: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = Path(tmp) / f"{name}.yaml"
        self.log_path = Path(tmp) / f"{name}.log"
        self.code, self.name, self.env, self.start_timeout_s = code, name, env or {}, start_timeout_s
        self.argv = argv or (lambda config: [sys.executable, "-m", "aftraj.cli", "serve", "gateway",
                                             "--config", str(config)])
        import yaml

        self.config.write_text(yaml.safe_dump({"kind": "gateway", "host": "127.0.0.1", **cfg, "port": self.port}))
        self.proc: subprocess.Popen | None = None

    def start(self) -> Gateway:
        import httpx

        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv(self.config), cwd=self.code, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONPATH=str(self.code), **self.env),
                                         start_new_session=True)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"gateway {self.name} exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.start_timeout_s:
                self.stop()
                raise SystemExit(f"gateway {self.name} not healthy after {self.start_timeout_s:g} s: {self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def cpu_s(self) -> float | None:
        """The gateway process's CPU seconds so far (user + system, all its threads)."""
        try:
            f = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, AttributeError):
            return None
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mb(self) -> float:
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except (OSError, AttributeError):
            pass
        return 0.0

    def stop(self) -> None:
        """SIGTERM to the gateway's process group; SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
