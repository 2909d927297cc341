"""One prompt budget and one chat-template tokenisation (issue 26 item 3): for the same tokenizer
and `max_prompt_tokens`, stage 1, stage 2, the warm-up, the hf auditor and the gateway render every
prefix with `aftraj.tokens.prompt_budget(max_prompt_tokens)` counted by `tokenizer_counter`, and
read it as the ids `chat_prompt_ids` gives. The runs are long enough that the bound is exercised
(bounded views), and a render without the margin would differ, so a stage with another budget fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aftraj.prompt import render
from aftraj.schema import Label, Step, Trajectory, write_jsonl
from aftraj.tokens import (TEMPLATE_MARGIN, PromptBudgetError, chat_prompt_ids, completion_ids, prompt_budget,
                           template_overhead, tokenizer_counter)

REPO = Path(__file__).resolve().parents[1]
MAX_PROMPT = 1000                       # every stage's max_prompt_tokens in this test
N_STEPS, K = 14, 3                      # long steps: prefixes from t = 2 pass the budget, their summaries fit it;
                                        # at t = 2, 3 (pre, post) a render without the margin differs
_WORDS = ("alpha", "beta", "gamma", "delta", "value", "check", "result", "sum")


def _content(i: int, j: int) -> str:
    return f"run {i} step {j}: " + " ".join(_WORDS[(i + j + n) % len(_WORDS)] for n in range(100))


def _runs() -> list[Trajectory]:
    """Three unsafe runs (k* = K) and a safe one, N_STEPS steps each: their late prefixes pass the budget."""
    out = []
    for i, k in enumerate((K, K, K, None)):
        agents = ["user"] + ["Solver" if j % 2 else "Checker" for j in range(1, N_STEPS)]
        steps = [Step(index=j, agent=a, kind="message", content=_content(i, j)) for j, a in enumerate(agents)]
        label = (Label(verdict="SAFE", label_source="verified_safe") if k is None else
                 Label(verdict="UNSAFE", label_source="injected", decisive_step=k, decisive_agent=agents[k],
                       reason=f"{agents[k]} is wrong at step {k}."))
        out.append(Trajectory(id=f"long-{i}", family_id=f"fam-{i}", domain="math", source="handmade",
                              task=f"Task {i}: check the values.", steps=steps, label=label,
                              outcome="success" if k is None else "failure", meta={"split": "train"}))
    return out


@pytest.fixture(scope="module")
def setting(tiny_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("budget")
    trajs = _runs()
    write_jsonl(trajs, tmp / "train.jsonl")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return {"tok": tok, "trajs": {t.id: t for t in trajs}, "data": tmp / "train.jsonl", "tmp": tmp,
            "budget": prompt_budget(MAX_PROMPT), "count": tokenizer_counter(tok)}


def _want(s, traj: Trajectory, t: int) -> list[dict]:
    """The one rule's prompt for prefix t."""
    return render(traj, t, s["budget"], count_tokens=s["count"])


def _bound_matters(s, cases) -> None:
    """Some prompt was bounded, and some would differ without the margin (so the test can fail)."""
    assert any("<coverage>" in m[1]["content"] for _, _, m in cases)
    assert any(render(tr, t, MAX_PROMPT, count_tokens=s["count"]) != m for tr, t, m in cases)


# --------------------------------------------------------------------------- the rule itself

def test_the_rule_and_the_tokenisation(setting):
    tok = setting["tok"]
    assert setting["budget"] == MAX_PROMPT - TEMPLATE_MARGIN == prompt_budget(MAX_PROMPT, tok)
    assert 0 < template_overhead(tok) <= TEMPLATE_MARGIN
    msgs = _want(setting, setting["trajs"]["long-0"], 12)
    assert chat_prompt_ids(tok, msgs) == list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                                                      return_dict=True)["input_ids"])
    ids, cut = completion_ids(tok, "SAFE", 1)
    assert cut and len(ids) == 1 and completion_ids(tok, "SAFE")[0][-1] == tok.eos_token_id
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        prompt_budget(TEMPLATE_MARGIN)

    class Wide:                                       # a template wider than the margin is refused
        name_or_path = "wide"

        def apply_chat_template(self, messages, **kw):
            return "x" * 40

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text)))}
    with pytest.raises(PromptBudgetError, match="adds 40 tokens"):
        prompt_budget(MAX_PROMPT, Wide())


# --------------------------------------------------------------------------- each stage

def test_stage1_renders_and_tokenises_by_the_rule(setting, tiny_model_dir):
    from training.stage1.config import load_stage1_config
    from training.stage1.data import tokenize_records
    from training.stage1.preferences import sample_preferences

    out = setting["tmp"] / "stage1"
    cfg = load_stage1_config(REPO / "configs" / "stage1" / "tiny-cpu.yaml",
                             {"model": str(tiny_model_dir), "data": str(setting["data"]), "output_dir": str(out),
                              "samples_per_prompt": 0, "max_prompt_tokens": MAX_PROMPT, "report_to": []})
    sample_preferences(cfg, progress=False)
    records = [json.loads(x) for x in (out / "preferences.jsonl").read_text().splitlines()]
    cases = [(setting["trajs"][r["prompt_traj_id"]], r["t"], r["messages"]) for r in records]
    assert cases and all(m == _want(setting, tr, t) for tr, t, m in cases)
    _bound_matters(setting, cases)
    pairs, _ = tokenize_records(records, setting["tok"], max_prompt_tokens=MAX_PROMPT, max_completion_tokens=64)
    assert [p.prompt_ids for p in pairs] == [chat_prompt_ids(setting["tok"], r["messages"]) for r in records]


def test_stage2_renders_and_tokenises_by_the_rule(setting, tiny_model_dir):
    from training.stage2.config import load_stage2_config
    from training.stage2.data import build_stage2_data, check_prompt_lengths

    cfg = load_stage2_config(REPO / "configs" / "stage2" / "tiny-cpu.yaml",
                             {"model": str(tiny_model_dir), "data": str(setting["data"]),
                              "output_dir": str(setting["tmp"] / "stage2"), "max_prompt_tokens": MAX_PROMPT,
                              "max_prompts": 40})
    stats = build_stage2_data(cfg, setting["tok"], setting["tmp"] / "stage2" / "data")
    records = [json.loads(x) for x in (setting["tmp"] / "stage2" / "data" / "records.jsonl").read_text().splitlines()]
    cases = [(setting["trajs"][r["extra_info"]["traj_id"]], r["extra_info"]["t"], r["prompt"]) for r in records]
    assert cases and all(m == _want(setting, tr, t) for tr, t, m in cases)
    _bound_matters(setting, cases)
    longest = max(len(chat_prompt_ids(setting["tok"], r["prompt"])) for r in records)
    assert stats["longest_prompt_tokens"] == longest == check_prompt_lengths(records, setting["tok"], MAX_PROMPT)


def test_warmup_renders_and_tokenises_by_the_rule(setting, tiny_model_dir):
    from training.warmup.config import load_warmup_config
    from training.warmup.trainer import warmup_items

    cfg = load_warmup_config(REPO / "configs" / "warmup" / "tiny-cpu.yaml",
                             {"model": str(tiny_model_dir), "data": str(setting["data"]),
                              "output_dir": str(setting["tmp"] / "warmup"), "max_prompt_tokens": MAX_PROMPT,
                              "max_steps": 10, "batch_size": 4})
    examples, items, _ = warmup_items(cfg, setting["tok"])
    cases = [(setting["trajs"][e["traj_id"]], e["t"], e["messages"]) for e in examples]
    assert all(m == _want(setting, tr, t) for tr, t, m in cases)
    _bound_matters(setting, cases)
    assert [p for p, _ in items] == [chat_prompt_ids(setting["tok"], e["messages"]) for e in examples]


def _hf(tiny_model_dir, tok):
    from eval.auditors.hf import HFAuditor, context_length

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    context = context_length(model, tok)
    # no --budget: the auditor's own budget is the one rule for a templated prompt of context - max_new_tokens
    return HFAuditor(model=model, tokenizer=tok, max_new_tokens=context - MAX_PROMPT)


def test_hf_auditor_budget_and_ids_are_the_rule(setting, tiny_model_dir):
    aud = _hf(tiny_model_dir, setting["tok"])
    assert aud.budget == setting["budget"]
    traj = setting["trajs"]["long-1"]
    cases = [(traj, t, _want(setting, traj, t)) for t in range(len(traj.steps))]
    _bound_matters(setting, cases)
    for _, t, m in cases:
        assert aud.prompt_ids(traj, t)[0] == chat_prompt_ids(setting["tok"], m), t


def test_gateway_renders_by_the_rule_and_the_hf_ids_are_what_it_sent(setting, tiny_model_dir, tmp_path):
    import httpx
    from fastapi.testclient import TestClient

    from serve.config import ApiKey, AuditorConfig, GatewayConfig, hash_key
    from serve.router import build_app
    from serve.service import GatewayService

    bodies = []

    def auditor(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "no"},
                                                      "finish_reason": "stop"}]})

    cfg = GatewayConfig(ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}", api_keys=(ApiKey("a", hash_key("k")),),
                        auditor=AuditorConfig(backend="openai", base_url="http://vllm.test/v1", model="auditor",
                                              budget=setting["budget"], tokenizer=str(tiny_model_dir)))
    head = {"Authorization": "Bearer k"}
    with TestClient(build_app(GatewayService(cfg, transport=httpx.MockTransport(auditor)))) as c:
        r = c.post("/v1/runs", json={"run_id": "r", "task": "check the values", "agents": ["Solver", "Checker"]},
                   headers=head)
        assert r.status_code == 201, r.text
        for j in range(1, N_STEPS):
            ev = {"event_id": f"r/{j}", "seq": j, "kind": "message", "agent": "Solver" if j % 2 else "Checker",
                  "payload": {"content": _content(0, j)}}
            assert c.post("/v1/runs/r/events", json={"events": [ev]}, headers=head).status_code < 300
        svc = c.app.state.service
        traj = svc.trajectory(svc.runs["a/r"])
    cases = [(traj, t, b["messages"]) for t, b in enumerate(bodies)]
    assert len(cases) == len(traj.steps) and all(m == _want(setting, tr, t) for tr, t, m in cases)
    _bound_matters(setting, cases)
    aud = _hf(tiny_model_dir, setting["tok"])
    for tr, t, m in cases:
        assert aud.prompt_ids(tr, t)[0] == chat_prompt_ids(setting["tok"], m), t
