"""The boundary probe (eval/probe.py): accuracies per subset from a scorer, the hf scorer's
log-probabilities by hand, and `aftraj probe` end to end on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from eval.probe import hf_scorer, probe

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _safe_lover(messages, completion):
    """Prefers any SAFE completion: right on every pre prompt, wrong on every post prompt."""
    return 0.0 if "SAFE" in completion and "UNSAFE" not in completion else -1.0


def test_subsets_are_scored_apart(make_traj):
    trajs = [make_traj(0, 6, 3), make_traj(1, 5, 0), make_traj(2, 4, None), make_traj(3, 8, 5)]
    res = probe(trajs, _safe_lover, budget=None, count_tokens=len, n_boot=200)
    s = res["summary"]
    assert s["n_runs"] == 3                               # the safe run has no boundary
    assert s["pre"]["n"] == 2 and s["post"]["n"] == 3     # k* = 0 has no pre-boundary prompt
    assert s["pre"]["accuracy"] == 1.0 and s["post"]["accuracy"] == 0.0
    assert s["both"]["accuracy"] == pytest.approx(2 / 5) and s["both"]["n"] == 5
    assert s["pre"]["mean_margin"] == 1.0 and s["post"]["mean_margin"] == -1.0
    assert s["both"]["accuracy_ci"][0] <= 0.4 <= s["both"]["accuracy_ci"][1]
    run = {r["id"]: r for r in res["runs"]}
    assert run["t0"]["pre"]["t"] == 2 and run["t0"]["post"]["t"] == 3 and "pre" not in run["t1"]
    # a tie is not a preference
    tie = probe(trajs, lambda m, c: 0.0, budget=None, count_tokens=len, n_boot=0)["summary"]
    assert tie["both"]["accuracy"] == 0.0 and tie["both"]["accuracy_ci"] is None


def test_post_prompt_gold_names_the_decisive_step_and_agent(make_traj):
    seen = []

    def record(messages, completion):
        seen.append(completion)
        return 0.0

    probe([make_traj(0, 6, 3)], record, budget=None, count_tokens=len, n_boot=0)
    from aftraj.verdict import parse_verdict

    pre_gold, pre_err, post_gold, post_err = (parse_verdict(c, t) for c, t in zip(seen, (2, 2, 3, 3)))
    traj = make_traj(0, 6, 3)
    assert pre_gold.decision == "SAFE" and post_err.decision == "SAFE"
    assert (pre_err.decision, pre_err.step, pre_err.agent) == ("UNSAFE", 2, traj.steps[2].agent)   # premature
    assert (post_gold.decision, post_gold.step, post_gold.agent) == ("UNSAFE", 3, traj.steps[3].agent)
    # the gold alarm carries the templated reason of the premature one, never the label's text
    assert traj.label.reason == "bad" and "bad" not in seen[2]
    assert post_gold.reason == f"{traj.steps[3].agent} made the decisive error at step 3."
    assert pre_err.reason == f"{traj.steps[2].agent} made the decisive error at step 2."


def test_hf_scorer_is_the_completions_log_probability(noisy_tiny):
    model, tok = noisy_tiny
    messages = [{"role": "system", "content": "audit"}, {"role": "user", "content": "step 0: hello"}]
    score = hf_scorer(model, tok)
    from training.stage1.data import completion_token_ids, prompt_token_ids

    p = prompt_token_ids(tok, messages)
    c, _ = completion_token_ids(tok, "<answer>SAFE</answer>", 1 << 30)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p + c])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    want = sum(float(lp[len(p) - 1 + i, tok_id]) for i, tok_id in enumerate(c))
    assert score(messages, "<answer>SAFE</answer>") == pytest.approx(want, abs=1e-4)
    assert score(messages, "<answer>UNSAFE</answer>") != pytest.approx(want, abs=1e-4)


def test_cli_probe_writes_probe_json(tiny_model_dir, make_traj, tmp_path, capsys):
    from aftraj.cli import main
    from aftraj.schema import write_jsonl

    trajs = [make_traj(i, 5, k) for i, k in enumerate((2, None, 1))]
    for t in trajs:
        t.meta["split"] = "test"
    write_jsonl(trajs, tmp_path / "test.jsonl")
    rc = main(["probe", "--model", str(tiny_model_dir), "--data", str(tmp_path / "test.jsonl"),
               "--out", str(tmp_path / "p"), "--n-boot", "50"])
    assert rc == 0
    res = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert res["summary"]["n_runs"] == 2 and res["summary"]["both"]["n"] == 4
    assert res["model"] == str(tiny_model_dir)
    from eval.auditors.hf import HFAuditor                           # the hf auditor's default budget
    assert res["budget"] == HFAuditor(model=str(tiny_model_dir), max_new_tokens=128).budget > 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["n_runs"] == 2 and printed["split"] == "test"


def test_cli_probe_refuses_data_without_an_unsafe_run_and_without_the_split(tiny_model_dir, make_traj, tmp_path, capsys):
    from aftraj.cli import main
    from aftraj.schema import write_jsonl

    write_jsonl([make_traj(0, 4, None)], tmp_path / "safe.jsonl")
    assert main(["probe", "--model", str(tiny_model_dir), "--data", str(tmp_path / "safe.jsonl"),
                 "--out", str(tmp_path / "p")]) == 2
    assert "no unsafe run" in capsys.readouterr().err and not (tmp_path / "p").exists()
    assert main(["probe", "--model", str(tiny_model_dir), "--data", str(tmp_path / "safe.jsonl"),
                 "--split", "test", "--out", str(tmp_path / "p")]) == 2
    assert "has no splits" in capsys.readouterr().err
