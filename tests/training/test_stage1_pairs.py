"""Boundary pairs and preferences: prompts differ exactly by step k*, gold labels, canonical
completions parse back, sample classification, stand-in counts, samplers (HF and endpoint)."""

from __future__ import annotations

import json

import pytest

from aftraj.boundary import boundary_pair, boundary_prompts
from aftraj.prompt import render_step, split_rendered
from aftraj.verdict import ParseFailure, Verdict, format_completion, parse_verdict, verdict_outcome
from training.stage1.preferences import (HFSampler, OpenAISampler, build_preferences, canonical_wrong,
                                         classify)


def test_pair_prompts_differ_exactly_by_step_kstar(handmade):
    for traj in handmade:
        pair = boundary_pair(traj)
        if not traj.label.unsafe or traj.label.decisive_step == 0:
            continue
        pre, post = pair
        k = traj.label.decisive_step
        assert (pre.subset, pre.t, post.subset, post.t) == ("pre", k - 1, "post", k)
        assert pre.messages[0] == post.messages[0]                        # same system prompt
        u_pre, u_post = pre.messages[1]["content"], post.messages[1]["content"]
        body_pre = u_pre[: u_pre.rindex("</trajectory>")]
        body_post = u_post[: u_post.rindex("</trajectory>")]
        assert body_post == body_pre + render_step(traj.steps[k])        # exactly one more step
        assert [s["index"] for s in split_rendered(u_post)] == list(range(k + 1))
        assert pre.gold == Verdict("SAFE", think=pre.gold.think)
        assert (post.gold.decision, post.gold.step, post.gold.agent) == ("UNSAFE", k, traj.label.decisive_agent)


def test_kstar_zero_gives_post_only_and_safe_gives_nothing(handmade):
    trajs = {t.id: t for t in handmade}
    assert [p.subset for p in boundary_pair(trajs["hand-3"])] == ["post"]
    assert boundary_pair(trajs["hand-5"]) == []
    prompts, stats = boundary_prompts(handmade)
    assert (stats.n_unsafe, stats.n_safe_skipped, stats.k0_post_only, stats.n_pre, stats.n_post) == (5, 1, 1, 4, 5)
    assert len(prompts) == 9


def test_who_and_when_is_refused(ww_trajs):
    with pytest.raises(ValueError, match="Who&When"):
        boundary_prompts(ww_trajs[:1])


def test_canonical_completions_parse_back_to_their_verdicts(handmade):
    prompts, _ = boundary_prompts(handmade)
    for p in prompts:
        gold = parse_verdict(format_completion(p.gold), p.t)
        assert (gold.decision, gold.step, gold.agent) == (p.gold.decision, p.gold.step, p.gold.agent)
        assert classify(format_completion(p.gold), p.gold, p.t) == "correct"
        wrong = canonical_wrong(p)
        assert classify(format_completion(wrong), p.gold, p.t) == "wrong_decision"
        assert parse_verdict(format_completion(wrong), p.t).decision == ("UNSAFE" if p.subset == "pre" else "SAFE")


def test_classify_outcomes():
    gold = Verdict("UNSAFE", step=2, agent="Coder", reason="r")
    ans = lambda a, g, r: f'<think>x</think><answer>{json.dumps({"answer": a, "agent": g, "reason": r})}</answer>'  # noqa: E731
    assert classify(ans(2, " coder ", "bad"), gold, 3) == "correct"     # agent trimmed, case-folded
    assert classify(ans(1, "Coder", "bad"), gold, 3) == "wrong_step"
    assert classify(ans(2, "Tester", "bad"), gold, 3) == "wrong_agent"
    assert classify(ans("SAFE", None, None), gold, 3) == "wrong_decision"
    assert classify("UNSAFE at 2", gold, 3) == "parse_failure:missing_answer"
    assert classify(ans(5, "Coder", "bad"), gold, 3) == "parse_failure:step_out_of_range"


class FakeSampler:
    """Returns fixed completions, by prompt subset: correct for post, wrong for pre."""

    def __init__(self, prompts):
        self.prompts = prompts

    def sample(self, messages, k):
        out = []
        for p in self.prompts:
            if p.subset == "post":
                out.append([format_completion(p.gold), "garbage"][:k])
            else:
                out.append([format_completion(p.gold)] * k)   # all correct: rejected needs a stand-in
        return out


def test_preferences_use_samples_and_count_stand_ins(handmade):
    prompts, _ = boundary_prompts(handmade)
    records, stats = build_preferences(prompts, FakeSampler(prompts), 2)
    assert len(records) == len(prompts)
    assert stats.n_samples == 2 * len(prompts)
    assert stats.chosen_canonical == {"pre": 0, "post": 0}
    # the post samples' wrong one is garbage: by default a parse failure is never rejected
    assert stats.rejected_canonical == {"pre": 4, "post": 5}
    assert stats.sample_outcomes == {"correct": 13, "parse_failure:missing_answer": 5}
    for r, p in zip(records, prompts, strict=True):
        assert classify(r["chosen"], p.gold, p.t) == "correct"
        assert classify(r["rejected"], p.gold, p.t) != "correct"
        assert r["rejected_source"] == "canonical"
    none, st0 = build_preferences(prompts, None, 0)
    assert st0.chosen_canonical == {"pre": 4, "post": 5} and st0.rejected_canonical == {"pre": 4, "post": 5}
    assert [r["chosen"] for r in none] == [format_completion(p.gold) for p in prompts]


def test_hf_sampler_generates_k_samples_per_prompt(tiny_model_dir, handmade):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts, _ = boundary_prompts(handmade[:2])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    s = HFSampler(model, tok, max_new_tokens=5, batch_size=2, seed=3)
    a = s.sample([p.messages for p in prompts], 3)
    assert [len(x) for x in a] == [3] * len(prompts) and all(isinstance(t, str) for x in a for t in x)
    assert s.sample([p.messages for p in prompts], 3) == a        # seeded: reproducible


@pytest.mark.slow
def test_openai_sampler_posts_chat_completions():
    import httpx

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body["n"], body["model"], request.headers.get("authorization")))
        return httpx.Response(200, json={"choices": [{"message": {"content": f"c{i}"}} for i in range(body["n"])]})

    s = OpenAISampler("http://vllm:8000/v1", "base", api_key="k", transport=httpx.MockTransport(handler))
    got = s.sample([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], 2)
    assert got == [["c0", "c1"], ["c0", "c1"]]
    assert seen[0] == ("/v1/chat/completions", 2, "base", "Bearer k")

    bad = OpenAISampler("http://vllm:8000/v1", "base",
                        transport=httpx.MockTransport(lambda r: httpx.Response(500, text="boom")))
    with pytest.raises(RuntimeError, match="500"):
        bad.sample([[{"role": "user", "content": "a"}]], 1)


def test_training_data_never_holds_val_or_test_families(handmade, tmp_path):
    """A corpus folder exported without per-split files holds only corpus.jsonl, whose records
    carry meta.split: stage 1 must read the train split of it, never the held-out families."""
    from dataclasses import replace

    from aftraj.schema import write_jsonl
    from training.common import load_training_trajectories

    splits = ["train", "test", "train", "val", "train", "train"]
    write_jsonl([replace(t, meta={**t.meta, "split": s}) for t, s in zip(handmade, splits, strict=True)], tmp_path / "corpus.jsonl")
    for spec in (tmp_path, tmp_path / "corpus.jsonl"):
        trajs, src = load_training_trajectories(str(spec))
        assert [t.id for t in trajs] == ["hand-0", "hand-2", "hand-4", "hand-5"]
        assert "2 val/test" in src


def test_canonical_premature_alarm_blames_the_last_shown_steps_agent(handmade):
    """Agents user, Manager, search_agent, Manager, search_agent; k* = 4: the pre prompt shows
    steps 0..3 and its canonical wrong verdict is an alarm at step 3, whose agent is Manager."""
    from dataclasses import replace

    traj = handmade[2]
    traj = replace(traj, label=replace(traj.label, decisive_step=4, decisive_agent="search_agent"))
    pre, _ = boundary_pair(traj)
    wrong = canonical_wrong(pre)
    assert (wrong.step, wrong.agent) == (3, traj.steps[3].agent) == (3, "Manager")


# --------------------------------------------------------------------------- issue 11: contrasting pairs

def _answer(decision, agent=None, reason=None):
    return (f'<think>x</think><answer>{json.dumps({"answer": decision, "agent": agent, "reason": reason})}'
            "</answer>")


class ScriptedSampler:
    """Returns, for each prompt, the completions `fn(prompt)` (k of them, cycled)."""

    def __init__(self, prompts, fn):
        self.prompts, self.fn = prompts, fn

    def sample(self, messages, k):
        return [[self.fn(p)[i % len(self.fn(p))] for i in range(k)] for p in self.prompts]


def test_never_parsing_base_gives_well_formed_wrong_rejected(handmade):
    """A base policy that never parses: every rejected parses to a verdict that is wrong."""
    prompts, _ = boundary_prompts(handmade)
    records, stats = build_preferences(prompts, ScriptedSampler(prompts, lambda p: ["garbage", "<answer>{"]), 2)
    for r, p in zip(records, prompts, strict=True):
        v = parse_verdict(r["rejected"], p.t)
        assert not isinstance(v, ParseFailure)
        assert verdict_outcome(v, p.gold) != "correct"
        assert r["rejected_source"] == "canonical" and r["chosen_source"] == "canonical"
    assert stats.rejected_by_class == {
        s: {"sample:wrong_decision": 0, "sample:wrong_step": 0, "sample:wrong_agent": 0,
            "sample:parse_failure": 0, "canonical": n} for s, n in (("pre", 4), ("post", 5))}
    assert stats.chosen_by_source == {"pre": {"sample": 0, "canonical": 4},
                                      "post": {"sample": 0, "canonical": 5}}


def test_well_formed_wrong_sample_is_rejected_by_class_preference(handmade):
    """wrong_decision beats wrong_step beats wrong_agent beats the canonical stand-in."""
    prompts, _ = boundary_prompts(handmade)

    def fn(p):
        if p.subset == "pre":      # gold SAFE: an alarm at step p.t is a wrong decision
            return ["garbage", _answer(p.t, "Someone", "bad"), format_completion(p.gold)]
        g = p.gold                 # gold UNSAFE(k*, a*): wrong agent first, then a wrong step
        wrong_step = _answer(g.step - 1, g.agent, "bad") if g.step > 0 else _answer(g.step, "Nobody", "bad")
        return ["garbage", _answer(g.step, "Nobody", "bad"), wrong_step]

    records, stats = build_preferences(prompts, ScriptedSampler(prompts, fn), 3)
    n_step = sum(1 for p in prompts if p.subset == "post" and p.gold.step > 0)
    n_post = sum(1 for p in prompts if p.subset == "post")
    for r, p in zip(records, prompts, strict=True):
        assert r["rejected_source"] == "sample"
        want = "wrong_decision" if p.subset == "pre" else ("wrong_step" if p.gold.step > 0 else "wrong_agent")
        assert r["rejected_class"] == want
        assert classify(r["rejected"], p.gold, p.t) == want
    assert stats.rejected_by_class["pre"] == {"sample:wrong_decision": 4, "sample:wrong_step": 0,
                                              "sample:wrong_agent": 0, "sample:parse_failure": 0,
                                              "canonical": 0}
    assert stats.rejected_by_class["post"] == {"sample:wrong_decision": 0, "sample:wrong_step": n_step,
                                               "sample:wrong_agent": n_post - n_step,
                                               "sample:parse_failure": 0, "canonical": 0}
    assert stats.chosen_by_source == {"pre": {"sample": 4, "canonical": 0},
                                      "post": {"sample": 0, "canonical": n_post}}
    assert stats.rejected_canonical == {"pre": 0, "post": 0}


def test_parse_failure_rejected_only_when_the_flag_asks(handmade):
    prompts, _ = boundary_prompts(handmade)
    sampler = ScriptedSampler(prompts, lambda p: [format_completion(p.gold), "garbage"])
    off_records, off = build_preferences(prompts, sampler, 2)
    on_records, on = build_preferences(prompts, sampler, 2, rejected_parse_failures=True)
    assert all(r["rejected_source"] == "canonical" for r in off_records)
    assert all(r["rejected"] == "garbage" and r["rejected_class"] == "parse_failure:missing_answer"
               for r in on_records)
    assert on.rejected_by_class == {
        s: {"sample:wrong_decision": 0, "sample:wrong_step": 0, "sample:wrong_agent": 0,
            "sample:parse_failure": n, "canonical": 0} for s, n in (("pre", 4), ("post", 5))}
    assert off.rejected_by_class["pre"]["canonical"] == 4 and off.rejected_by_class["post"]["canonical"] == 5
    # a well-formed wrong sample still beats a parse failure with the flag on
    s2 = ScriptedSampler(prompts, lambda p: ["garbage", format_completion(canonical_wrong(p))])
    recs, st = build_preferences(prompts, s2, 2, rejected_parse_failures=True)
    assert all(r["rejected_class"] == "wrong_decision" for r in recs)
    assert st.rejected_by_class["pre"]["sample:wrong_decision"] == 4


def test_stage1_config_flag_defaults_off():
    from training.stage1.config import Stage1Config
    assert Stage1Config(max_steps=1).rejected_parse_failures is False
    assert Stage1Config(max_steps=1, rejected_parse_failures=True).rejected_parse_failures is True
