"""Fixtures for the eval tests: a context-sensitive tiny model, a fake OpenAI-compatible HTTP
server on 127.0.0.1, and (marker `vllm`) a real vLLM CPU server in its own venv."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- synthetic runs

def _make_traj(i: int, n: int, k: int | None, domain: str = "math"):
    """A run of n steps; UNSAFE at k (its content holds "[[ERROR]]", which the fake server
    flags) or SAFE when k is None."""
    from aftraj.schema import Label, Step, Trajectory

    agents = ["user", "Solver", "Verifier"]
    steps = [Step(index=j, agent=agents[0] if j == 0 else agents[1 + j % 2], kind="message",
                  content=f"step {j} of run {i}" + (" [[ERROR]]" if j == k else "")) for j in range(n)]
    label = (Label("SAFE", "verified_safe") if k is None else
             Label("UNSAFE", "injected", decisive_step=k, decisive_agent=steps[k].agent, reason="bad"))
    return Trajectory(id=f"t{i}", family_id=f"f{i}", domain=domain, source="test", task="compute",
                      steps=steps, label=label)


@pytest.fixture(scope="session")
def make_traj():
    return _make_traj


# --------------------------------------------------------------------------- tiny model

@pytest.fixture
def torch_one_thread():
    """One torch thread for the duration of a test, restored after: on a shared 2-core machine
    spinning OpenMP threads made the tiny-model tests 4x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def noisy_tiny(tiny_model_dir):
    """(model, tokenizer): the tiny Qwen2 re-initialised with std 0.3 weights, so its greedy
    output depends on the context (the default init repeats one token, which would make
    cache-vs-scratch comparisons vacuous)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


# --------------------------------------------------------------------------- fake OpenAI server

_STEP = re.compile(r'<step index=(\d+) agent="((?:[^"\\]|\\.)*)"')


class FakeOpenAI:
    """A small OpenAI-compatible server. It alarms at the first shown step whose content holds
    "[[ERROR]]", answers SAFE otherwise, returns logprobs for the verdict token and simulates a
    prefix cache (cached_tokens = longest common prefix with any earlier prompt, in 4-char
    "tokens"). Knobs: `fail_next` (answer HTTP 503 that many times), `stall_next` (sleep
    `stall_s` before answering that many times), `status_next` (a fixed error status)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail_next = 0
        self.stall_next = 0
        self.stall_s = 2.0
        self.delay_s = 0.0
        self.status_next: int | None = None
        self.reasoning_split = False  # answer like vLLM with --reasoning-parser
        self.prompts: list[str] = []
        self.bodies: list[dict] = []
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def completion(self, body: dict) -> dict:
        user = body["messages"][-1]["content"]
        steps = [(int(m.group(1)), json.loads(f'"{m.group(2)}"')) for m in _STEP.finditer(user)]
        blocks = user.split("<step index=")[1:]
        bad = next(((k, a) for (k, a), blk in zip(steps, blocks, strict=True) if "[[ERROR]]" in blk), None)
        if bad is None:
            answer, value_tok, alt = '{"answer": "SAFE", "agent": null, "reason": null}', ' "', ' 0'
            lp_value, lp_alt = -0.2, -1.7
        else:
            answer = json.dumps({"answer": bad[0], "agent": bad[1], "reason": "marked error"})
            value_tok, alt, lp_value, lp_alt = f" {bad[0]}", ' "', -0.1, -2.4
        text = f"<think>checked</think>\n<answer>{answer}</answer>"
        pieces = ["<think>", "checked", "</think>", "\n", "<answer>", '{"', "answer", '":', value_tok,
                  answer[len('{"answer": ') + len(value_tok) - 1:], "</answer>"]
        assert "".join(pieces) == text, pieces
        content = []
        for p in pieces:
            top = [{"token": p, "logprob": -0.01}]
            if p == value_tok:
                top = [{"token": value_tok, "logprob": lp_value}, {"token": alt, "logprob": lp_alt}]
            content.append({"token": p, "logprob": top[0]["logprob"], "top_logprobs": top})
        prompt = "".join(m["content"] for m in body["messages"])
        with self.lock:
            cached = max((_lcp(prompt, q) for q in self.prompts), default=0) // 4
            self.prompts.append(prompt)
        message = {"role": "assistant", "content": text}
        if self.reasoning_split:
            message = {"role": "assistant", "reasoning_content": "checked",
                       "content": text.split("</think>", 1)[1]}
        return {"id": "fake", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "message": message,
                             "logprobs": {"content": content} if body.get("logprobs") else None,
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(prompt) // 4, "completion_tokens": len(pieces),
                          "total_tokens": len(prompt) // 4 + len(pieces),
                          "prompt_tokens_details": {"cached_tokens": cached}}}


def _lcp(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    step = 4096
    while i < n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)


def _handler(fake: FakeOpenAI):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, code: int, obj: dict, headers: dict | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": "fake-auditor", "object": "model"}]})
            self._send(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with fake.lock:
                fake.calls += 1
                fake.in_flight += 1
                fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                fake.bodies.append(body)
                fail = fake.fail_next > 0
                fake.fail_next -= fail
                stall = not fail and fake.stall_next > 0
                fake.stall_next -= stall
                status, fake.status_next = fake.status_next, None
            # The call leaves `in_flight` before its answer is written: once the client has the
            # answer it may send its next request, which must not be counted as overlapping.
            try:
                if status is not None:
                    reply = (status, {"error": {"message": "scripted error"}})
                elif fail:
                    reply = (503, {"error": {"message": "overloaded"}}, {"Retry-After": "0"})
                else:
                    if stall:
                        time.sleep(fake.stall_s)
                    if fake.delay_s:
                        time.sleep(fake.delay_s)
                    reply = (200, fake.completion(body))
            finally:
                with fake.lock:
                    fake.in_flight -= 1
            self._send(*reply)

    return H


@pytest.fixture
def fake_openai():
    fake = FakeOpenAI()
    fake.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.server.daemon_threads = True
    th = threading.Thread(target=fake.server.serve_forever, daemon=True)
    th.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


# --------------------------------------------------------------------------- real vLLM (CPU)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A real vLLM CPU OpenAI-compatible server on 127.0.0.1 serving a locally built tiny Qwen2
    (hidden 128: the CPU attention backend needs head_dim >= 32), with prefix caching and
    `--enable-prompt-tokens-details` so usage reports cached tokens, started and stopped by
    `serve.vllm.running_vllm`. The server runs from the venv that scripts/test_vllm.sh creates
    ($VLLM_PYTHON, default .venv-vllm/bin/python). Yields (base_url, served_model_name, log_path)."""
    from serve.config import VllmConfig
    from serve.vllm import VllmStartError, running_vllm
    from aftraj.models import build_tiny_model

    py = Path(os.environ.get("VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
    if not py.exists():
        pytest.fail(f"no vLLM venv python at {py}: run `bash scripts/test_vllm.sh` (it creates it)")
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-vllm"), hidden_size=128)
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    cfg = VllmConfig(profile="cpu", python=str(py), model=str(model_dir), served_model_name="tiny-auditor",
                     port=_free_port(), dtype="float32", max_model_len=32768, block_size=32,
                     gpu_memory_utilization=None, structured_outputs_backend=None, enforce_eager=True,
                     kv_cache_space_gib=int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")))
    try:
        with running_vllm(cfg, log=log, timeout_s=float(os.environ.get("VLLM_START_TIMEOUT", "300"))) as server:
            yield f"{server.url}/v1", "tiny-auditor", log
    except VllmStartError as e:
        pytest.fail(f"vLLM server: {e}; log {log}:\n{e.log_tail}")
    finally:
        print(f"vLLM server log: {log}", file=sys.stderr)
