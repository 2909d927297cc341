"""A live gateway for the hook tests: the real FastAPI app served by uvicorn on 127.0.0.1 in a
thread, with a scripted auditor (an httpx MockTransport standing in for vLLM) that alarms at the
first shown step holding a trigger string, blaming that step's agent."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest

KEY = "adapters-test-key"
_STEP = re.compile(r'<step index=(\d+) agent="((?:[^"\\]|\\.)*)"')


class TriggerAuditor:
    def __init__(self, trigger: str):
        self.trigger, self.calls = trigger, 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        user = json.loads(request.content)["messages"][-1]["content"]
        steps = [(int(m.group(1)), json.loads(f'"{m.group(2)}"')) for m in _STEP.finditer(user)]
        blocks = user.split("<step index=")[1:]
        bad = next(((k, a) for (k, a), b in zip(steps, blocks) if self.trigger in b), None)
        ans = ({"answer": "SAFE", "agent": None, "reason": None} if bad is None else
               {"answer": bad[0], "agent": bad[1], "reason": f"{self.trigger} is wrong"})
        return httpx.Response(200, json={
            "choices": [{"message": {"role": "assistant",
                                     "content": f"<think>checked</think><answer>{json.dumps(ans)}</answer>"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5}})


@pytest.fixture
def live_gateway(tmp_path):
    """make(trigger) -> (base_url, api_key, auditor): a gateway on a free local port."""
    pytest.importorskip("uvicorn")
    import uvicorn

    from serve.config import ApiKey, AuditorConfig, GatewayConfig, hash_key
    from serve.router import build_app
    from serve.service import GatewayService

    servers = []

    def make(trigger: str):
        auditor = TriggerAuditor(trigger)
        cfg = GatewayConfig(ledger_url=f"sqlite:///{tmp_path / f'ledger{len(servers)}.db'}",
                            api_keys=(ApiKey("t", hash_key(KEY)),),
                            auditor=AuditorConfig(backend="openai", base_url="http://auditor.test/v1",
                                                  model="auditor", deadline_s=5.0, tokenizer="approx"))
        app = build_app(GatewayService(cfg, transport=httpx.MockTransport(auditor)))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        t0 = time.monotonic()
        while not server.started:
            if time.monotonic() - t0 > 30:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.05)
        servers.append(server)
        return f"http://127.0.0.1:{port}", KEY, auditor

    yield make
    for s in servers:
        s.should_exit = True
