"""The `openai` auditor against a real vLLM CPU server (marker `vllm`: bash scripts/test_vllm.sh).

Walks 5 Who&When trajectories prefix by prefix through vLLM's OpenAI-compatible server (prefix
caching on) and reports the fraction of prompt tokens served from the cache: with the prompt
builder's prefix-stable layout most prompt tokens after the first call are cached.
"""

from __future__ import annotations

import json
import os

import pytest

from eval.auditors import get_auditor
from eval.metrics import summarize
from eval.report import write_report
from eval.walker import WalkConfig, walk

pytestmark = pytest.mark.vllm


def test_walk_who_and_when_through_vllm(vllm_server, ww_trajs, tmp_path):
    url, name, log = vllm_server
    trajs = [t for t in ww_trajs if t.meta["subset"] == "Algorithm-Generated"][:5]
    with get_auditor("openai", endpoint=url, concurrency=2, timeout=300, retries=2,
                     max_new_tokens=8) as aud:
        assert aud.api_model == name                      # discovered from /v1/models
        preds = walk(aud, trajs, WalkConfig(max_in_flight=5), progress=False)
    m = summarize(preds, n_boot=0)
    calls = sum(p["calls"] for p in preds)
    prompt = sum(p["prompt_tokens"] for p in preds)
    cached = sum(p["cached_tokens"] for p in preds)
    line = (f"vllm_walk trajectories={len(preds)} calls={calls} prompt_tokens={prompt} "
            f"cached_tokens={cached} cached_fraction={cached / prompt:.3f} "
            f"latency_p50_s={m['latency_p50_s']:.3f} latency_p95_s={m['latency_p95_s']:.3f}")
    print("\n" + line)
    out = os.environ.get("VLLM_REPORT_DIR")
    if out:
        write_report(preds, out, meta={"auditor": aud.label, "posthoc": False, "protocol": "strict",
                                       "data": "who_and_when (5 Algorithm-Generated runs)"}, n_boot=200)
        with open(os.path.join(out, "vllm_walk.txt"), "w") as f:
            f.write(line + "\n")
    # a random tiny model writes no verdict: every prefix is walked, every call a parse failure
    assert calls == sum(len(t.steps) for t in trajs)
    assert all(p["completion_tokens"] >= p["calls"] for p in preds)
    assert m["parse_failure_rate"] == 1.0
    # the real check: vLLM's prefix cache serves most prompt tokens of a prefix-stable walk
    assert cached / prompt > 0.5, line
    first = preds[0]["trace"][0]
    assert json.dumps(first)  # records are JSON-serialisable as written to predictions.jsonl
