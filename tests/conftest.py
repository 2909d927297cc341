"""Shared fixtures. Tests run on CPU with no network; Who&When is the repository's own copy
(eval/data/who_and_when), read-only."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WHO_AND_WHEN = REPO / "eval" / "data" / "who_and_when"
# a test with none of these markers is in the fast tier (`bash scripts/test.sh -m fast`)
NOT_FAST = frozenset({"slow", "heavy", "gpu", "vllm", "postgres", "verl", "ablation_e2e"})


@pytest.hookimpl(tryfirst=True)       # before pytest's own -m deselection reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not NOT_FAST & {m.name for m in item.iter_markers()}:
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session")
def ww_dir() -> Path:
    assert WHO_AND_WHEN.is_dir(), f"Who&When is expected at {WHO_AND_WHEN}"
    return WHO_AND_WHEN


@pytest.fixture(scope="session")
def ww_trajs(ww_dir):
    from aftraj.readers import load_trajectories

    return load_trajectories(ww_dir, "whoandwhen")


@pytest.fixture(scope="session")
def demo_cfg():
    from aftraj.corpus.config import load_corpus_config

    return load_corpus_config(REPO / "configs" / "corpus" / "demo-small.yaml")


@pytest.fixture(scope="session")
def demo_build(demo_cfg, tmp_path_factory):
    """configs/corpus/demo-small.yaml built once for the session (~30-50 s on 2 busy cores; the
    corpus tests and the Hub-dataset tests read it, none writes into it), with the content-blind
    floors that `aftraj corpus build` passes (stats.json's floors_on_test). The folder holds an
    unsplit `hf/` of earlier versions before the build, which the build must replace."""
    from aftraj.corpus.build import build_corpus
    from eval.floors import floor_scores

    out = tmp_path_factory.mktemp("demo-corpus")
    (out / "hf").mkdir()
    return build_corpus(demo_cfg, out, floors=floor_scores)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised tiny Qwen2 + locally trained tokenizer (a few seconds)."""
    from aftraj.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# --------------------------------------------------------------------------- misbehaving HTTP

OK_COMPLETION = {"id": "c", "model": "m",
                 "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": "hello"}}],
                 "usage": {"prompt_tokens": 10, "completion_tokens": 2,
                           "prompt_tokens_details": {"cached_tokens": 8}}}


class RawServer:
    """A TCP server whose reply per connection is chosen by `script` (a list popped per request,
    the last entry repeating): ("json", status, obj, headers) or ("drip", content_length, delay)
    or ("chunked", n_bytes)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.script: list = [("json", 200, OK_COMPLETION, {})]
        self.requests: list[float] = []
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        try:
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            n = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":")[1])
            while len(body) < n:
                body += conn.recv(65536)
            self.requests.append(time.monotonic())
            step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
            if step[0] == "json":
                _, status, obj, headers = step
                payload = json.dumps(obj).encode()
                hdr = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                conn.sendall(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n{hdr}"
                             f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
            elif step[0] == "drip":
                _, length, delay = step
                conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {length}\r\n\r\n".encode())
                while not self.stop.is_set():
                    conn.sendall(b" ")
                    time.sleep(delay)
            elif step[0] == "chunked":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                chunk = b" " * 65536
                for _ in range(step[1] // len(chunk) + 1):
                    conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                conn.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.fixture
def misbehaving_server():
    """A raw TCP HTTP server scripted per request (see RawServer): slow drips, oversize bodies,
    chosen statuses and replies. Used by the client, auditor and corpus tests."""
    s = RawServer()
    yield s
    s.close()


@pytest.fixture
def postgres():
    """A throw-away PostgreSQL (Debian's `postgresql` package) on a free local port, data in a
    temporary directory, trust auth on 127.0.0.1; stopped afterwards (tests marked `postgres`)."""
    import tempfile

    bindir = "/usr/lib/postgresql/15/bin"
    initdb = shutil.which("initdb") or f"{bindir}/initdb"
    pg_ctl = shutil.which("pg_ctl") or f"{bindir}/pg_ctl"
    if not os.path.exists(initdb):
        pytest.fail("PostgreSQL is not installed: apt-get install postgresql (the `postgres` marker needs it)")
    home = Path(tempfile.mkdtemp(prefix="aftraj-pg-"))   # outside pytest's root-only tmp tree
    data = home / "pgdata"
    data.mkdir()
    as_user = []
    if os.geteuid() == 0:             # postgres refuses to run as root: use the package's user
        shutil.chown(home, "postgres")
        shutil.chown(data, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run(as_user + [initdb, "-D", str(data), "-A", "trust", "-U", "postgres"], check=True,
                   capture_output=True)
    log = home / "pg.log"
    r = subprocess.run(as_user + [pg_ctl, "-D", str(data), "-l", str(log), "-w", "start", "-o",
                                  f"-p {port} -k {data} -c listen_addresses=127.0.0.1"],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.fail(f"PostgreSQL did not start: {r.stderr} {log.read_text() if log.exists() else ''}")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(as_user + [pg_ctl, "-D", str(data), "-w", "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)
