"""The `openai` policy and judge backends over real HTTP. The default suite runs them against a
small fake OpenAI-compatible server on 127.0.0.1 (started here) that answers with the nonsense
a tiny model writes: malformed and unknown tool calls, empty replies, junk JSON, HTTP errors,
a broken body. The pipeline must record reasons and never crash."""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from aftraj.corpus.build import build_corpus
from aftraj.corpus.config import EndpointConfig, config_from_dict
from aftraj.corpus.diagnose import OpenAIJudge
from aftraj.corpus.inject import corrupt, targets
from aftraj.corpus.policies import OpenAIPolicy, parse_agent_reply
from aftraj.corpus.rollout import PolicyError, run_rollout
from aftraj.corpus.tasks import generate_tasks
from aftraj.corpus.templates import TEMPLATES
from aftraj.schema import Label, Trajectory

AGENT_REPLIES = [
    {"content": 'CALL compute {"expression": "2+2"'},                       # broken JSON
    {"content": 'CALL teleport {"to": "mars"}'},                             # unknown tool
    {"content": None, "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "search", "arguments": "not json{"}}]},
    {"content": "lorem ipsum dolor sit amet"},
    {"content": ""},
    {"content": 'CALL lookup {"doc_id": 7}'},                                # wrong argument type
    {"content": 'CALL search {"query": "founder"}'},
    {"content": 'CALL compute {"expression": "3*4"}'},
    {"content": "APPROVE CORRECT 12"},
    {"content": "FINAL ANSWER: 42"},
    "http500",
    {"content": "```python\ndef f(:\n```\nFINAL ANSWER: see above"},
]
JUDGE_REPLIES = [
    '[{"step": 1, "agent": "MathSolver", "failure_type": "computation_slip", "reason": "r", "fix": "FINAL ANSWER: 1", '
    '"confidence": 9}, {"step": "two"}, {"agent": "x"}]',
    "I think it was step 3.",
    '{"step_exists": true, "substantive_error": "yes"}',
    '{"step_exists": true, "substantive_error": true, "decisive_causality": true, "earliest": true}',
    '{"coherent": "sure"}',
    "[]",
]


class _Handler(BaseHTTPRequestHandler):
    agent = itertools.count()
    judge = itertools.count()

    def log_message(self, *a):
        pass

    def _send(self, code, body: bytes):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(req)
        if self.path != "/v1/chat/completions":
            return self._send(404, b'{"error": "not found"}')
        system = req["messages"][0]["content"]
        if "broken body" in req["messages"][-1]["content"]:
            return self._send(200, b"<html>not json</html>")
        if system.startswith("You diagnose") or system.startswith("You verify") or system.startswith("Does every"):
            text = JUDGE_REPLIES[next(self.judge) % len(JUDGE_REPLIES)]
            msg = {"role": "assistant", "content": text}
        else:
            r = AGENT_REPLIES[next(self.agent) % len(AGENT_REPLIES)]
            if r == "http500":
                return self._send(500, b'{"error": "overloaded"}')
            msg = {"role": "assistant", **r}
        self._send(200, json.dumps({"id": "x", "object": "chat.completion", "model": req["model"],
                                    "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]}).encode())


@pytest.fixture(scope="module")
def fake_openai():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.requests = []
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def _endpoint(url, **kw):
    return EndpointConfig(backend="openai", model="tiny", base_url=url, max_tokens=64, timeout_s=10, retries=1, **kw)


@pytest.mark.parametrize("domain", list(TEMPLATES))
def test_one_rollout_per_template_survives_nonsense(domain, fake_openai, sandbox):
    srv, url = fake_openai
    _Handler.agent = itertools.count()   # every template meets the same run of nonsense
    tpl, task = TEMPLATES[domain], generate_tasks(domain, 1, 0)[0]
    r = run_rollout(tpl, task, OpenAIPolicy(_endpoint(url)), seed=0, sandbox=sandbox, max_steps=14)
    assert r.termination in ("completed", "step_limit", "tool_error", "cancelled")
    assert not r.success and r.check_reason and r.backend == "openai" and r.model == "tiny"
    steps = [t.to_step(i, "x") for i, t in enumerate(r.turns)]
    Trajectory(id="x", family_id="f", domain=domain, source="t", task="q", steps=steps, label=Label("SAFE", "verified_safe"))
    assert any("malformed tool call" in n or "tool error" in n for n in r.notes), r.notes
    assert all(q["temperature"] == 0.0 and q["model"] == "tiny" for q in srv.requests)


def test_reply_parsing_keeps_raw_text_and_reasons():
    tpl = TEMPLATES["math"]
    t = parse_agent_reply(tpl, "MathSolver", {"content": 'CALL compute {"expression": "1+'})
    assert t.kind == "tool_call" and t.error.startswith("arguments are not JSON") and t.arguments["_raw"]
    t = parse_agent_reply(tpl, "Verifier", {"content": 'CALL lookup {"doc_id": "d1"}'})
    assert "may not call 'lookup'" in t.error
    t = parse_agent_reply(tpl, "MathSolver", {"content": 'CALL compute ["1+1"]'})
    assert t.error == "arguments must be a JSON object"
    t = parse_agent_reply(tpl, "Verifier", {"content": "FINAL ANSWER: 3"})
    assert t.kind == "message"   # only the lead may finish
    t = parse_agent_reply(tpl, "MathSolver", {"content": None})
    assert t.kind == "message" and t.content == ""


def test_endpoint_failures_cancel_with_a_reason(fake_openai, sandbox):
    _, url = fake_openai
    tpl, task = TEMPLATES["math"], generate_tasks("math", 1, 0)[0]
    down = _endpoint("http://127.0.0.1:9/v1")
    r = run_rollout(tpl, task, OpenAIPolicy(down), seed=0, sandbox=sandbox)
    assert r.termination == "cancelled" and "policy error" in r.notes[0] and "failed" in r.notes[0]
    broken = task.__class__(**{**task.__dict__, "prompt": "broken body"})
    r = run_rollout(tpl, broken, OpenAIPolicy(_endpoint(url)), seed=0, sandbox=sandbox)
    assert r.termination == "cancelled" and "malformed response" in r.notes[0]
    with pytest.raises(PolicyError):
        OpenAIPolicy(down).next_turn(tpl, task, [tpl.request_turn(task)], seed=0)


def test_judge_parses_or_records(fake_openai, sandbox):
    _, url = fake_openai
    tpl, task = TEMPLATES["math"], generate_tasks("math", 1, 0)[0]
    r = run_rollout(tpl, task, OpenAIPolicy(_endpoint(url)), seed=0, sandbox=sandbox, max_steps=8)
    judge = OpenAIJudge(_endpoint(url))
    seen_err, seen_cands = False, False
    for _ in range(len(JUDGE_REPLIES)):
        cands, err = judge.propose(tpl, task, r)
        seen_err |= err is not None
        seen_cands |= bool(cands)
        assert all(1 <= c.confidence <= 5 for c in cands)
    assert seen_err and seen_cands


def test_text_corruptions_of_free_form_turns(fake_openai, sandbox):
    _, url = fake_openai
    tpl, task = TEMPLATES["agentic"], generate_tasks("agentic", 1, 0)[0]
    r = run_rollout(tpl, task, OpenAIPolicy(_endpoint(url)), seed=0, sandbox=sandbox, max_steps=16)
    n = 0
    for e in ("computation_slip", "fabricated_tool_result", "wrong_tool_argument", "premature_termination"):
        for k in targets(tpl, task, r.turns, e):
            bad = corrupt(tpl, task, r.turns, k, e)
            assert bad is not None and not bad.same_as(r.turns[k])
            n += 1
    assert n > 0


def test_build_with_openai_policy_and_judge(fake_openai, tmp_path):
    _, url = fake_openai
    m = tmp_path / "math500.jsonl"
    m.write_text(json.dumps({"problem": "What is 6*7?", "answer": "42", "unique_id": "t/1"}) + "\n")
    cfg = config_from_dict({
        "name": "fake-openai", "max_steps": 10, "tasks": {"math": 2, "coding": 1, "agentic": 1},
        "public_pools": [{"kind": "math500", "path": str(m)}],
        "policy": {"backend": "openai", "model": "tiny", "base_url": url, "max_tokens": 64, "retries": 1},
        "judge": {"backend": "openai", "model": "tiny", "base_url": url, "max_tokens": 64, "retries": 0},
        "curation": {"coherence": "judge"}, "sandbox": {"timeout_s": 2.0},
    })
    res = build_corpus(cfg, tmp_path / "out")
    rej = res.records["rejections"]
    assert rej and all(x["reason"] and x["predicate"] for x in rej)
    failed = [x for x in rej if x["reason"].startswith("failed run")]
    assert len(res.records["diagnoses"]) == len(failed) >= 1
    assert all(d["reason"] for d in res.records["diagnoses"])
    assert any(d.get("proposer_error") or any(c.get("verifier_error") for c in d["candidates"])
               for d in res.records["diagnoses"])
    assert (tmp_path / "out" / "stats.json").is_file() and (tmp_path / "out" / "stats.md").is_file()


def test_build_with_an_unreachable_endpoint_fails_naming_the_connection_error(tmp_path, capsys):
    """A closed port: the build stops non-zero and names the connection error (it used to cancel
    every rollout and exit 0 with an empty corpus)."""
    import socket

    import yaml

    from aftraj.cli import main

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ep = {"backend": "openai", "model": "tiny", "base_url": f"http://127.0.0.1:{port}/v1",
          "max_tokens": 64, "retries": 1, "timeout_s": 5}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"name": "down", "max_steps": 10,
                                   "tasks": {"math": 1, "coding": 0, "agentic": 0},
                                   "policy": ep, "judge": {"backend": "scripted"}}))
    rc = main(["corpus", "build", "--config", str(cfg), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot be reached" in err and "ConnectError" in err and str(port) in err
    assert not (tmp_path / "out" / "corpus.jsonl").exists()
