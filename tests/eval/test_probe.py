"""The boundary probe (eval/probe.py): post-beats-twin and the content-blind rules from a scorer,
the hf scorer's decision-token log-odds by hand, and `aftraj probe` end to end on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from eval.probe import CONTENT_BLIND_RULES, hf_scorer, probe

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _with_twin(make_traj, i: int, n: int, k: int):
    """An unsafe run and its verified-safe twin (same family and steps but step k's content)."""
    import dataclasses

    unsafe = make_traj(i, n, k)
    twin = dataclasses.replace(make_traj(i, n, None), id=f"twin{i}")
    return [unsafe, twin]


def _reads_content(messages, t, alarm):
    """+1 when the prompt shows the planted error, -1 otherwise: a model that reads content."""
    return {"decision": 1.0 if "[[ERROR]]" in messages[1]["content"] else -1.0}


def test_post_beats_twin_is_met_by_content_and_half_by_content_blind_rules(make_traj):
    trajs = [*_with_twin(make_traj, 0, 6, 3), *_with_twin(make_traj, 1, 5, 2), make_traj(2, 5, 0),
             make_traj(3, 4, None)]
    res = probe(trajs, _reads_content, budget=None, count_tokens=len, n_boot=200)
    s = res["summary"]
    assert s["n_runs"] == 3 and s["twin"]["n"] == 2 and s["pre"]["n"] == 2 and s["post"]["n"] == 3
    assert s["post_beats_twin"]["share"] == 1.0 and s["post_beats_twin"]["n"] == 2
    assert s["post_beats_pre"]["share"] == 1.0
    assert s["post"]["accuracy"] == s["pre"]["accuracy"] == s["twin"]["accuracy"] == 1.0
    # every content-blind rule scores exactly one half on post vs twin, by construction
    assert set(res["rules"]) == set(CONTENT_BLIND_RULES)
    for name, r in res["rules"].items():
        assert r["post_beats_twin"]["share"] == 0.5, name
    # ... while the position rule passes post-beats-pre outright: that figure does not measure content
    assert res["rules"]["rule: later prefix, more alarm"]["post_beats_pre"]["share"] == 1.0
    # a scorer that ignores content gets one half too; one that inverts content gets 0
    blind = probe(trajs, lambda m, t, a: {"decision": float(t)}, budget=None, count_tokens=len, n_boot=0)
    assert blind["summary"]["post_beats_twin"]["share"] == 0.5
    inv = probe(trajs, lambda m, t, a: {"decision": -_reads_content(m, t, a)["decision"]}, budget=None,
                count_tokens=len, n_boot=0)
    assert inv["summary"]["post_beats_twin"]["share"] == 0.0
    assert s["by_domain"]["math"]["n"] == 2


def test_each_prompt_competes_with_its_canonical_alarm(make_traj):
    seen = []

    def record(messages, t, alarm):
        seen.append((t, alarm))
        return {"decision": 0.0}

    unsafe, twin = _with_twin(make_traj, 0, 6, 3)
    probe([unsafe, twin], record, budget=None, count_tokens=len, n_boot=0)
    (t_pre, pre), (t_post, post), (t_twin, tw) = seen
    assert (t_pre, t_post, t_twin) == (2, 3, 3)
    assert (pre.step, pre.agent) == (2, unsafe.steps[2].agent)          # the latest agent step before k*
    assert (post.step, post.agent) == (3, unsafe.steps[3].agent) == (tw.step, tw.agent)
    assert post.reason == f"{unsafe.steps[3].agent} made the decisive error at step 3."   # templated


def test_hf_scorer_gives_the_decision_tokens_log_odds(noisy_tiny):
    from aftraj.verdict import canonical_completion, canonical_verdict
    from aftraj.tokens import chat_prompt_ids, completion_ids, first_divergence

    model, tok = noisy_tiny
    messages = [{"role": "system", "content": "audit"}, {"role": "user", "content": "step 0: hello"}]
    alarm = canonical_verdict(2, 1, "Solver")
    got = hf_scorer(model, tok)(messages, 2, alarm)
    p = chat_prompt_ids(tok, messages)
    s, _ = completion_ids(tok, canonical_completion(2))
    a, _ = completion_ids(tok, canonical_completion(2, 1, "Solver"))
    d = first_divergence(s, a)
    assert d is not None and s[:d] == a[:d]

    def lp(c):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c])).logits[0].float()
        return torch.log_softmax(logits, -1)[torch.arange(len(p) - 1, len(p) + len(c) - 1), torch.tensor(c)]

    ls, la = lp(s), lp(a)
    assert got["decision"] == pytest.approx(float(la[d] - ls[d]), abs=1e-4)
    assert got["full"] == pytest.approx(float(la.sum() - ls.sum()), abs=1e-3)
    fast = hf_scorer(model, tok, full=False)(messages, 2, alarm)
    assert set(fast) == {"decision"} and fast["decision"] == pytest.approx(got["decision"], abs=1e-4)


def test_cli_probe_writes_probe_json(tiny_model_dir, make_traj, tmp_path, capsys):
    from aftraj.cli import main
    from aftraj.schema import write_jsonl

    trajs = [make_traj(i, 5, k) for i, k in enumerate((2, None, 1))] + _with_twin(make_traj, 3, 5, 2)
    for t in trajs:
        t.meta["split"] = "test"
    write_jsonl(trajs, tmp_path / "test.jsonl")
    rc = main(["probe", "--model", str(tiny_model_dir), "--data", str(tmp_path / "test.jsonl"),
               "--out", str(tmp_path / "p"), "--n-boot", "50"])
    assert rc == 0
    res = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert res["summary"]["n_runs"] == 3 and res["summary"]["post_beats_twin"]["n"] == 1
    assert set(res["rules"]) == set(CONTENT_BLIND_RULES)
    assert res["model"] == str(tiny_model_dir)
    from eval.auditors.hf import HFAuditor                           # the hf auditor's default budget
    assert res["budget"] == HFAuditor(model=str(tiny_model_dir), max_new_tokens=128).budget > 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["n_runs"] == 3 and printed["split"] == "test" and "post_beats_twin" in printed


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


def test_cli_linear_probe_with_too_few_twin_pairs_is_a_user_error(tiny_model_dir, make_traj, tmp_path, capsys):
    # one train twin pair cannot fit a probe: a one-line error that says what to do (exit 2), not a
    # traceback asking for a bug report (the GPU ablation's CPU check met it on a 24-task corpus)
    from aftraj.cli import main
    from aftraj.schema import write_jsonl

    write_jsonl(_with_twin(make_traj, 0, 5, 2), tmp_path / "train.jsonl")
    held = _with_twin(make_traj, 1, 5, 3)
    for t in held:
        t.meta["split"] = "test"
    write_jsonl(held, tmp_path / "test.jsonl")
    assert main(["probe", "--model", str(tiny_model_dir), "--data", str(tmp_path / "test.jsonl"),
                 "--linear-train", str(tmp_path / "train.jsonl"), "--out", str(tmp_path / "lp")]) == 2
    err = capsys.readouterr().err
    assert "at least 2 twin pairs in train and 1 held out, found 1 and 1" in err and "Traceback" not in err


def test_cli_probe_under_bf16_autocast_scores_near_float32(tiny_model_dir, make_traj, tmp_path, monkeypatch):
    # --mixed-precision bf16: every scoring forward runs under bf16 autocast (float32 weights), the
    # decision log-odds stay close to float32's, and probe.json says which precision it used
    from aftraj.cli import main
    from aftraj.schema import write_jsonl
    import aftraj.scoring as scoring

    trajs = _with_twin(make_traj, 0, 5, 2) + _with_twin(make_traj, 1, 6, 3)
    for t in trajs:
        t.meta["split"] = "test"
    write_jsonl(trajs, tmp_path / "test.jsonl")
    real, seen = scoring.pair_token_logps, []

    def spy(*a, **kw):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real(*a, **kw)

    monkeypatch.setattr(scoring, "pair_token_logps", spy)
    res = {}
    for mp in ("no", "bf16"):
        seen.clear()
        assert main(["probe", "--model", str(tiny_model_dir), "--data", str(tmp_path / "test.jsonl"),
                     "--out", str(tmp_path / mp), "--n-boot", "20", "--mixed-precision", mp]) == 0
        res[mp] = json.loads((tmp_path / mp / "probe.json").read_text())
        assert seen and all(seen) == (mp == "bf16") and any(seen) == (mp == "bf16")
        assert res[mp]["mixed_precision"] == mp
    a, b = ([r["post"]["decision"] for r in res[mp]["runs"]] for mp in ("no", "bf16"))
    assert len(a) == 2 and a == pytest.approx(b, abs=0.1)


def test_prompts_scored_in_turn_share_their_beginning_and_score_as_alone(noisy_tiny, monkeypatch):
    # a run's pre, post and twin prompts share the template and steps 0..k*-1: one scorer runs each
    # from where it leaves the one before (aftraj.scoring.PrefixCache) and scores what it scores alone
    from aftraj.verdict import canonical_verdict

    model, tok = noisy_tiny
    steps = " ".join(f"step {i}: agent said {i * 7} things about the plan." for i in range(6))
    prompts = [[{"role": "system", "content": "audit"}, {"role": "user", "content": steps + tail}]
               for tail in (" stop", " step 6: it broke.", " step 6: it worked.", " stop")]
    alarm = canonical_verdict(2, 1, "Solver")
    ran = []
    real = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: (ran.append(kw["input_ids"].shape[1]), real(*a, **kw))[1])
    shared, shared_fast = hf_scorer(model, tok), hf_scorer(model, tok, full=False)
    got = [shared(m, 2, alarm) for m in prompts] + [shared_fast(m, 2, alarm) for m in prompts]
    n_shared = sum(ran)
    ran.clear()
    alone = [hf_scorer(model, tok)(m, 2, alarm) for m in prompts] + [hf_scorer(model, tok, full=False)(m, 2, alarm)
                                                                      for m in prompts]
    assert n_shared < 0.6 * sum(ran)                       # the shared beginning ran once a scorer
    for g, a in zip(got, alone, strict=True):
        assert g.keys() == a.keys()
        for k in g:
            assert g[k] == pytest.approx(a[k], abs=1e-4)
    assert got[0]["decision"] == pytest.approx(got[3]["decision"], abs=1e-5)   # the kept cache is intact


def test_models_sharing_their_bottom_layers_score_as_each_alone(noisy_tiny, make_traj):
    # the ablation's warmed base, stage 1 and every-prefix rows differ only in their top layers: the
    # shared layers run once a prompt, each model runs its top layers on their output, and every
    # model's scores equal its own full pass; a model that differs below runs alone
    import copy

    from eval.probe import shared_layers, shared_trunk_scorers

    model, tok = noisy_tiny
    n = len(model.model.layers)
    top, below = copy.deepcopy(model), copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in [*top.model.layers[-1].parameters(), top.model.norm.weight]:
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
        for p in below.model.layers[0].parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    assert (shared_layers(model, model), shared_layers(model, top), shared_layers(model, below)) == (n, n - 1, 0)

    trajs = [t for i, k in enumerate((2, 3)) for t in _with_twin(make_traj, i, 5, k)] + [make_traj(5, 4, 1)]
    kw = dict(budget=None, count_tokens=lambda s: len(tok(s, add_special_tokens=False)["input_ids"]), n_boot=20)
    ran = []
    real = model.forward
    model.forward = lambda *a, **k: (ran.append(k["input_ids"].shape[1]), real(*a, **k))[1]
    scorers, tops = shared_trunk_scorers([model, top, below], tok)
    assert tops == [0, 1, 0]
    got = [probe(trajs, s, **kw)["runs"] for s in scorers]
    n_shared = sum(ran)
    ran.clear()
    alone = [probe(trajs, hf_scorer(m, tok), **kw)["runs"] for m in (model, top, below)]
    assert n_shared == sum(ran)                 # the first model's pass is the only full one of the group
    for g_runs, a_runs in zip(got, alone, strict=True):
        assert len(g_runs) == len(a_runs) == 3
        for gr, ar in zip(g_runs, a_runs, strict=True):
            for sub in ("pre", "post", "twin"):
                if sub in ar:
                    assert gr[sub]["decision"] == pytest.approx(ar[sub]["decision"], abs=1e-4)
                    assert gr[sub]["full"] == pytest.approx(ar[sub]["full"], abs=1e-3)
    assert got[1][0]["post"]["decision"] != pytest.approx(got[0][0]["post"]["decision"], abs=1e-3)  # not vacuous


def test_cli_probe_also_writes_each_models_probe_json(tiny_model_dir, make_traj, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aftraj.cli import main
    from aftraj.schema import write_jsonl

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        m.model.layers[-1].mlp.down_proj.weight.mul_(3.0)
    m.save_pretrained(tmp_path / "top")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "top")
    trajs = _with_twin(make_traj, 0, 5, 2) + [make_traj(1, 5, 1)]
    write_jsonl(trajs, tmp_path / "d.jsonl")
    rc = main(["probe", "--model", str(tiny_model_dir), "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "a"),
               "--also", str(tmp_path / "top"), str(tmp_path / "b"), "--n-boot", "20"])
    assert rc == 0
    a, b = (json.loads((tmp_path / x / "probe.json").read_text()) for x in "ab")
    assert a["model"] == str(tiny_model_dir) and a["shared_trunk"] is None
    assert b["model"] == str(tmp_path / "top") and b["shared_trunk"]["top_layers"] == 1
    assert a["summary"]["n_runs"] == b["summary"]["n_runs"] == 2
    alone = tmp_path / "alone"
    assert main(["probe", "--model", str(tmp_path / "top"), "--data", str(tmp_path / "d.jsonl"), "--out", str(alone),
                 "--n-boot", "20"]) == 0
    c = json.loads((alone / "probe.json").read_text())
    assert [r["post"]["decision"] for r in b["runs"]] == pytest.approx([r["post"]["decision"] for r in c["runs"]], abs=1e-4)
