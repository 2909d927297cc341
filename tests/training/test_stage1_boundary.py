"""The amended boundary pairs (DESIGN §5, 2026-12-01): the pre subset blames an agent step, the twin
subset, one wording, the decision-token term, the unpadded per-pair step, and a decision that the
loss can reach (two pairs overfit on the tiny model)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from aftraj.boundary import (POST, PRE, TWIN, boundary_pair, boundary_prompts, find_twins, is_twin,
                             latest_agent_step)
from aftraj.schema import Label, Step, Trajectory
from aftraj.verdict import canonical_completion, format_completion


def _run(i: int, k: int | None, *, family: str = "fam", bad: bool = True, env_before: bool = True) -> Trajectory:
    agents = ["user", "Solver", "environment", "Checker", "environment", "Solver"]
    kinds = ["message", "tool_call", "tool_result", "message", "tool_result", "final_answer"]
    steps = []
    for j, (a, kd) in enumerate(zip(agents, kinds, strict=True)):
        content = f"step {j}: value {j * 7}"
        if k is not None and j == k and bad:
            content = f"step {j}: value {j * 7 + 1} (wrong)"
        steps.append(Step(index=j, agent=a, kind=kd, content=content, tool="calc" if kd != "message" and
                          kd != "final_answer" else None))
    label = (Label("SAFE", "verified_safe") if k is None else
             Label("UNSAFE", "injected", decisive_step=k, decisive_agent=agents[k], reason="free text"))
    return Trajectory(id=f"r{i}", family_id=family, domain="math", source="handmade", task="add",
                      steps=steps, label=label, outcome="success" if k is None else "failure")


def test_pre_rejected_blames_the_latest_agent_step_never_environment():
    unsafe = _run(0, 5)                     # step 4 is an environment tool result
    pre, post = boundary_pair(unsafe)
    assert pre.subset == PRE and pre.t == 4 and latest_agent_step(unsafe, 4) == 3
    assert (pre.wrong.decision, pre.wrong.step, pre.wrong.agent) == ("UNSAFE", 3, "Checker")
    assert post.subset == POST and post.wrong.decision == "SAFE"
    assert (post.gold.step, post.gold.agent) == (5, "Solver")


def test_twin_subset_is_the_safe_twins_prefix_with_a_false_alarm_rejected():
    unsafe, safe = _run(0, 5), _run(1, None)
    other = dataclasses.replace(_run(2, None), family_id="other")
    assert is_twin(unsafe, safe) and not is_twin(unsafe, other)
    assert find_twins([unsafe, safe, other]) == {"r0": safe}
    prompts, stats = boundary_prompts([unsafe, safe, other], twins=True)
    assert [p.subset for p in prompts] == [PRE, POST, TWIN] and stats.n_twin == 1
    tw = prompts[2]
    assert tw.prompt_traj_id == "r1" and tw.traj_id == "r0" and tw.t == 5
    assert tw.gold.decision == "SAFE" and (tw.wrong.step, tw.wrong.agent) == (5, "Solver")
    # post and twin prompts differ only in step k*'s content
    a, b = prompts[1].messages[1]["content"], tw.messages[1]["content"]
    assert a != b and a.replace("value 36 (wrong)", "value 35") == b
    # not a twin: a different agent at k*, or a difference before k*
    early = _run(3, 5)
    early = dataclasses.replace(early, steps=[early.steps[0], dataclasses.replace(early.steps[1], content="x"),
                                              *early.steps[2:]])
    assert not is_twin(early, safe)
    assert boundary_prompts([unsafe, safe], twins=False)[1].n_twin == 0


def test_one_wording_for_pairs_warmup_and_gold():
    import random

    from training.warmup.data import draw_verdict

    unsafe = _run(0, 5)
    pre, post = boundary_pair(unsafe)
    assert format_completion(post.gold) == canonical_completion(5, 5, "Solver")
    assert format_completion(pre.wrong) == canonical_completion(4, 3, "Checker")
    assert format_completion(post.wrong) == canonical_completion(5)
    assert "free text" not in format_completion(post.gold)           # the label's reason is no target
    rng = random.Random(0)
    seen = {format_completion(draw_verdict(rng, unsafe, 3, 0.5)) for _ in range(20)}
    assert seen == {canonical_completion(3), canonical_completion(3, 3, "Checker")}


def test_max_post_tokens_skips_long_runs_and_counts_them():
    runs = [_run(0, 5), _run(1, 1, family="f2")]
    _, stats = boundary_prompts(runs, max_post_tokens=10 ** 6)
    assert stats.over_budget_skipped == 0
    from aftraj.boundary import prompt_tokens

    short = prompt_tokens(runs[1], 1)
    prompts, stats = boundary_prompts(runs, max_post_tokens=short)
    assert stats.over_budget_skipped == 1 and {p.traj_id for p in prompts} == {"r1"}


# --------------------------------------------------------------------------- the unpadded step

def _tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa"), tok


def test_pair_token_logps_equals_scoring_each_sequence_alone(tiny_model_dir):
    from aftraj.scoring import pair_token_logps

    model, _ = _tiny(tiny_model_dir)
    model.eval()
    prompt, comps = [5, 9, 11, 30, 2, 7], [[40, 41, 42, 43], [40, 50]]
    got = pair_token_logps(model, prompt, comps)
    for c, g in zip(comps, got, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + c])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(g, want, atol=1e-5)


def _records():
    unsafe, safe = _run(0, 5), _run(1, None)
    prompts, _ = boundary_prompts([unsafe, safe], twins=True)
    return [{"traj_id": p.traj_id, "subset": p.subset, "t": p.t, "messages": p.messages,
             "chosen": format_completion(p.gold), "rejected": format_completion(p.wrong)} for p in prompts]


@pytest.mark.parametrize("over", [dict(), dict(decision_coef=1.0, margin_tokens=6, nll_coef=0.5)])
def test_per_pair_step_gives_the_padded_steps_loss_and_gradient(tiny_model_dir, stage1_cfg, over):
    from training.stage1.data import collate, tokenize_records
    from training.stage1.trainer import _micro_step, _per_pair_step, precompute_reference

    model, tok = _tiny(tiny_model_dir)
    pairs, _ = tokenize_records(_records(), tok, max_prompt_tokens=4096, max_completion_tokens=256)
    assert [p.subset for p in pairs] == ["pre", "post", "twin"]
    assert all(p.decision_at is not None for p in pairs)

    class Acc:   # the single-process accelerator surface precompute_reference uses
        num_processes, process_index, device = 1, 0, torch.device("cpu")

        @staticmethod
        def gather(x):
            return x

        @staticmethod
        def autocast():   # Accelerator(mixed_precision="no"): float32
            return contextlib.nullcontext()

    cfgs = {b: stage1_cfg(batching=b, weight_twin=0.5, per_device_batch_size=3, **over)
            for b in ("padded", "per_pair")}
    refs = {b: precompute_reference(model, pairs, tok.pad_token_id, 3, Acc, margin_tokens=c.margin_tokens,
                                    per_pair=b == "per_pair") for b, c in cfgs.items()}
    assert torch.allclose(refs["padded"], refs["per_pair"], atol=1e-4)
    batch = collate(pairs, tok.pad_token_id, refs["padded"] + 0.25)   # policy != reference
    model.zero_grad()
    loss_a, m_a = _micro_step(cfgs["padded"], model, model, None, batch)
    loss_a.backward()
    grads_a = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss_b, m_b = _per_pair_step(cfgs["per_pair"], model, model, None, pairs, batch, lambda x: x.backward())
    assert loss_b.item() == pytest.approx(loss_a.item(), abs=1e-5)
    assert set(m_a) == set(m_b) and "dpo_twin" in m_a
    if over:
        assert "decision_ce" in m_a and m_b["decision_ce"].item() == pytest.approx(m_a["decision_ce"].item(), abs=1e-5)
    for ga, p in zip(grads_a, model.parameters(), strict=True):
        assert torch.allclose(ga, p.grad, atol=1e-5, rtol=1e-3)


@pytest.mark.slow
def test_decision_term_makes_two_pairs_flip_their_decision(tiny_model_dir, stage1_cfg, tmp_path):
    """The issue's overfit check: with the decision-token term on, two pairs (one run's pre and
    post prompts) are fit in <= 30 steps: SAFE wins the decision token on pre, ALARM on post."""
    from aftraj.schema import write_jsonl
    from eval.probe import decision_log_odds
    from training.stage1.trainer import train

    data = tmp_path / "data"
    data.mkdir()
    write_jsonl([_run(0, 5)], data / "train.jsonl")
    model, tok = _tiny(tiny_model_dir)
    pre, post = boundary_pair(_run(0, 5))

    def odds(m):
        return [decision_log_odds(m, tok, p.messages, p.t, p.wrong if p.subset == PRE else p.gold) for p in (pre, post)]

    before = odds(model)
    assert (before[0] > 0) == (before[1] > 0)       # the random model does not tell them apart
    cfg = stage1_cfg(data=str(data), max_steps=30, per_device_batch_size=2, decision_coef=1.0,
                     batching="per_pair", learning_rate=3e-3, lr_scheduler="constant", save_steps=30,
                     allow_many_epochs=True, output_dir=str(tmp_path / "run"))
    res = train(cfg, progress=False)
    from transformers import AutoModelForCausalLM

    after = odds(AutoModelForCausalLM.from_pretrained(res.final_dir))
    assert after[0] < 0 < after[1], (before, after)
