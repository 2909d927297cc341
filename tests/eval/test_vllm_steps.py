"""`vllm-steps` (eval/auditors/vllm_steps.py): against an OpenAI-compatible completions endpoint
that runs the tiny model on the prompt ids it is sent (an httpx mock transport, no socket), the
client's scores are `hf-steps`'s; each event's prompt extends the last one token for token (what a
prefix-caching server reuses); a decision token outside the top log-probs is bounded and said so."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from eval.auditors import get_auditor
from training.common import synthetic_trajectories


class FakeCompletions:
    """POST /v1/completions with token-id prompts: the model's next-token top log-probs, keyed
    `token_id:N` as vLLM's return_tokens_as_token_ids gives them; GET /v1/models."""

    def __init__(self, model, top=None):
        self.model, self.top, self.prompts = model, top, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "auditor"}]})
        body = json.loads(request.content)
        ids = body["prompt"]
        assert body["max_tokens"] == 1 and body["return_tokens_as_token_ids"] is True
        self.prompts.append(ids)
        with torch.no_grad():
            lp = torch.log_softmax(self.model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
        k = min(self.top or body["logprobs"], lp.shape[-1])
        v, i = torch.topk(lp, k)
        top = {f"token_id:{int(j)}": float(x) for x, j in zip(v, i, strict=True)}
        prev = self.prompts[-2] if len(self.prompts) > 1 else []
        cached = len(prev) if ids[:len(prev)] == prev else 0
        return httpx.Response(200, json={
            "choices": [{"text": "", "logprobs": {"top_logprobs": [top]}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 1,
                      "prompt_tokens_details": {"cached_tokens": cached}}})


@pytest.fixture
def folder(noisy_tiny, tmp_path):
    model, tok = noisy_tiny
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_client_scores_equal_hf_steps_and_prompts_extend(noisy_tiny, folder):
    model, tok = noisy_tiny
    server = FakeCompletions(model)
    client = get_auditor("vllm-steps", endpoint="http://vllm:8000/v1", model=str(folder), reason="none",
                         threshold=1e9, top_logprobs=1024, transport=httpx.MockTransport(server))
    local = get_auditor("hf-steps", model=model, tokenizer=tok, reason="none", threshold=1e9,
                        **client.bounds)
    assert client.api_model == "auditor"
    for traj in synthetic_trajectories(3, seed=11):
        start = len(server.prompts)
        got = [client.audit(traj, t) for t in range(len(traj.steps))]
        want = [local.audit(traj, t).decision_log_odds for t in range(len(traj.steps))]
        assert [r.decision_log_odds for r in got] == pytest.approx(want, abs=1e-4)
        mine = server.prompts[start:]
        assert all(b[:len(a)] == a for a, b in zip(mine, mine[1:], strict=False))      # each extends the last
        # each call after the first reused the whole prompt before it (the last prompt precedes no call)
        assert all(r.cached_tokens == len(a) for r, a in zip(got[1:], mine, strict=False))
        client.end(traj)
    client.close()


def test_a_decision_token_outside_the_top_is_bounded_and_said(noisy_tiny, folder):
    model, _ = noisy_tiny
    client = get_auditor("vllm-steps", endpoint="http://vllm:8000/v1", model=str(folder), reason="none",
                         threshold=1e9, transport=httpx.MockTransport(FakeCompletions(model, top=1)))
    traj = synthetic_trajectories(1, seed=12)[0]
    r = client.audit(traj, 0)
    assert r.raw and r.raw.startswith("bounded:") and r.decision_log_odds is not None
    client.close()


def test_a_reply_without_logprobs_is_an_error_not_a_verdict(noisy_tiny, folder):
    def bad(request):
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "auditor"}]})
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    client = get_auditor("vllm-steps", endpoint="http://vllm:8000/v1", model=str(folder), reason="none",
                         transport=httpx.MockTransport(bad))
    r = client.audit(synthetic_trajectories(1, seed=13)[0], 0)
    assert r.verdict is None and r.error_kind == "malformed" and "top log-probs" in r.error
    client.close()
