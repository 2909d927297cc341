"""Every-prefix decision training (training/prefixes): the rows a run gives, the packed forward
the rows are read from (equal to the hf auditor's own prompt and decision tokens), and a run
that learns the decision on its training prefixes and exports a model the eval loads."""

import json

import pytest
import torch

from aftraj.prompt import render
from aftraj.schema import write_jsonl
from aftraj.tokens import TEMPLATE_MARGIN, tokenizer_counter
from training.common import synthetic_trajectories
from training.prefixes.config import load_prefixes_config
from training.prefixes.trainer import prefix_run, select_runs, train


def _cap_for(traj, t, tok) -> int:
    """The least max_prompt_tokens whose budget (`prompt_budget`: less TEMPLATE_MARGIN) holds
    prefix t's full render, counted as render() counts it."""
    count = tokenizer_counter(tok)
    return sum(count(m["content"]) for m in render(traj, t)) + TEMPLATE_MARGIN


def test_rows_of_unsafe_and_safe_runs_match_what_the_hf_auditor_reads(tiny_model_dir, tiny_tokenizer):
    from aftraj.scoring import packed_logits
    from eval.auditors.hf import HFAuditor

    trajs = synthetic_trajectories(8, seed=0)
    unsafe = next(t for t in trajs if t.label.unsafe and t.label.decisive_step >= 2)
    safe = next(t for t in trajs if not t.label.unsafe)
    k = unsafe.label.decisive_step
    r = prefix_run(unsafe, tiny_tokenizer, 4096)
    assert r.ts == list(range(k + 1)) and r.alarm == [False] * k + [True]
    s = prefix_run(safe, tiny_tokenizer, 4096)
    assert s.ts == list(range(len(safe.steps))) and not any(s.alarm)
    aud = HFAuditor(str(tiny_model_dir), max_new_tokens=8)
    logits = packed_logits(aud.model, r.pack)
    for i, t in enumerate(r.ts):
        start, safe_tok, alarm_tok = aud.decision_tokens(unsafe, t)
        ids, _ = aud.prompt_ids(unsafe, t)
        assert (r.safe_tok[i], r.alarm_tok[i]) == (safe_tok, alarm_tok)
        with torch.no_grad():
            alone = aud.model(input_ids=torch.tensor([ids + start]), use_cache=False).logits[0, -1]
        torch.testing.assert_close(logits[i], alone, atol=1e-4, rtol=1e-4)
    # the cap goes through the one budget rule: a cap whose budget cannot hold k*'s full prompt
    # drops the unsafe run; a safe run keeps the prefixes whose full prompts it holds
    n_k = _cap_for(unsafe, k, tiny_tokenizer)
    assert prefix_run(unsafe, tiny_tokenizer, n_k - 1) is None
    assert prefix_run(unsafe, tiny_tokenizer, n_k).ts == r.ts
    short = prefix_run(safe, tiny_tokenizer, _cap_for(safe, 1, tiny_tokenizer) - 1)
    assert short is not None and short.ts == [0]


def test_twins_come_first_among_safe_runs(tiny_tokenizer):
    from aftraj.boundary import find_twins

    cfg = load_prefixes_config("configs/prefixes/tiny-cpu.yaml", {"max_prompt_tokens": 4096})
    trajs = synthetic_trajectories(12, seed=0)
    twins = {t.id for t in find_twins(trajs).values()}
    runs, n = select_runs(trajs, tiny_tokenizer, cfg, (None, 1))
    safe_ids = [r.traj_id for r in runs if not any(r.alarm)]
    assert n["safe"] == 1 and len(safe_ids) == 1
    if twins:
        assert safe_ids[0] in twins and n["twins"] == 1


def _overfit_run(tmp_path, tiny_model_dir, **over):
    """30 epochs on 8 synthetic runs, scored on those same runs (heldout_split: train)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(synthetic_trajectories(8, seed=0), corpus / "train.jsonl")
    return train(load_prefixes_config("configs/prefixes/tiny-cpu.yaml", {
        "model": str(tiny_model_dir), "data": str(corpus), "output_dir": str(tmp_path / "run"),
        "num_epochs": 30, "learning_rate": 3e-3, "runs_per_step": 8, "heldout_split": "train", **over}))


@pytest.mark.slow
def test_a_run_learns_the_decision_on_every_training_prefix_and_exports(tmp_path, tiny_model_dir):
    # the overfit check: scored on its own training runs (heldout_split: train), the ALARM rows
    # end above the SAFE rows (AUC 0.94 measured; the untrained model: 0.5)
    res = _overfit_run(tmp_path, tiny_model_dir)
    first, last = res.history[0], res.history[-1]
    assert abs(first["log_odds_alarm_rows"] - first["log_odds_safe_rows"]) < 0.5
    assert last["log_odds_alarm_rows"] - last["log_odds_safe_rows"] > 1.0 and last["loss"] < first["loss"]
    data = json.loads((tmp_path / "run" / "data.json").read_text())
    assert data["rows"] > data["alarm_rows"] == 6 and data["packed_tokens"] < data["unpacked_tokens"]
    assert data["heldout"]["before"]["auc"] < 0.6 and data["heldout"]["after"]["auc"] > 0.9
    assert data["device"] == ("cuda" if torch.cuda.is_available() else "cpu")   # a GPU where there is one
    rows = [json.loads(x) for x in (tmp_path / "run" / "heldout.jsonl").read_text().splitlines()]
    assert len(rows) == data["rows"] and {"log_odds_before", "log_odds_after", "step_agent"} <= set(rows[0])
    # the export is a whole model the hf auditor loads, with the trained top layer
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    after = AutoModelForCausalLM.from_pretrained(res.final_dir)
    top = len(after.model.layers) - 1
    assert not torch.equal(after.model.layers[top].mlp.up_proj.weight, before.model.layers[top].mlp.up_proj.weight)
    assert torch.equal(after.model.layers[0].mlp.up_proj.weight, before.model.layers[0].mlp.up_proj.weight)


@pytest.mark.slow
def test_bf16_autocast_covers_the_training_capture_and_steps_not_the_heldout_scoring(tmp_path, tiny_model_dir,
                                                                                      monkeypatch):
    # mixed_precision: bf16 (the CPU configs' "auto" on an AVX512-BF16 CPU): the training runs'
    # capture and every step run under bf16 autocast with float32 weights and features, and the run
    # still learns; the held-out rows (capture and scoring: a measurement) run in float32
    import aftraj.scoring as scoring

    real, seen = scoring.packed_logits, []

    def spy(model, pack, **kw):
        seen.append((torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16,
                     torch.is_grad_enabled(), kw.get("embeds") is not None))
        return real(model, pack, **kw)

    monkeypatch.setattr(scoring, "packed_logits", spy)
    res = _overfit_run(tmp_path, tiny_model_dir, mixed_precision="bf16")
    assert res.data["mixed_precision"] == "bf16"
    # heldout_split: train scores the same 8 runs: capture train (8), capture held out (8), steps, scoring (8)
    captures = [bf for bf, grad, emb in seen if not grad and not emb]
    steps = [bf for bf, grad, emb in seen if grad]
    scoring_ = [bf for bf, grad, emb in seen if not grad and emb]
    assert len(captures) == 16 and captures[:8] == [True] * 8 and captures[8:] == [False] * 8
    assert steps and all(steps)
    assert len(scoring_) == 8 and not any(scoring_)
    assert res.data["heldout"]["after"]["auc"] > 0.9
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(res.final_dir).dtype == torch.float32


def test_mixed_precision_off_runs_float32(tmp_path, tiny_model_dir, monkeypatch):
    import aftraj.scoring as scoring

    real, seen = scoring.packed_logits, []
    monkeypatch.setattr(scoring, "packed_logits",
                        lambda model, pack, **kw: (seen.append(torch.is_autocast_enabled("cpu")), real(model, pack, **kw))[1])
    res = _overfit_run(tmp_path, tiny_model_dir, num_epochs=1)
    assert res.data["mixed_precision"] == "no" and seen and not any(seen)


@pytest.mark.gpu
def test_a_run_learns_on_a_gpu(tmp_path, tiny_model_dir):
    """The overfit check on CUDA: features, masks and targets on the GPU (no device mix-up), the
    same learning as on the CPU, the export loads on the CPU."""
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA GPU"
    res = _overfit_run(tmp_path, tiny_model_dir)
    assert res.data["device"] == "cuda" and res.data["peak_gpu_gib"] > 0
    assert res.data["heldout"]["after"]["auc"] > 0.9
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(res.final_dir).device.type == "cpu"


def test_a_cap_that_leaves_no_unsafe_run_is_a_usage_error_naming_it(tmp_path, tiny_model_dir):
    from aftraj.errors import UsageError

    cfg = load_prefixes_config("configs/prefixes/tiny-cpu.yaml", {
        "model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"), "max_prompt_tokens": 40})
    with pytest.raises(UsageError, match="max_prompt_tokens=40"):
        train(cfg)


def test_safe_runs_have_their_own_prompt_cap(tiny_tokenizer):
    """max_safe_prompt_tokens lets a safe run train the late prefixes a walk reads, while the
    unsafe runs keep max_prompt_tokens."""
    trajs = synthetic_trajectories(12, seed=0)
    full = {r.traj_id: r for r in select_runs(trajs, tiny_tokenizer, load_prefixes_config(
        "configs/prefixes/tiny-cpu.yaml", {"max_prompt_tokens": 4096}))[0]}
    safe = next(r for r in full.values() if not any(r.alarm) and len(r.ts) >= 3)
    unsafe = next(r for r in full.values() if any(r.alarm) and len(r.ts) >= 2)
    by_id = {t.id: t for t in trajs}
    cap = _cap_for(by_id[safe.traj_id], 1, tiny_tokenizer)        # room for the safe run's first two prefixes
    n_unsafe = _cap_for(by_id[unsafe.traj_id], unsafe.ts[-1], tiny_tokenizer)
    over = {"max_prompt_tokens": max(cap, n_unsafe), "max_safe_prompt_tokens": cap}
    runs = {r.traj_id: r for r in select_runs(trajs, tiny_tokenizer, load_prefixes_config(
        "configs/prefixes/tiny-cpu.yaml", over))[0]}
    assert runs[safe.traj_id].ts == safe.ts[:2]
    assert runs[unsafe.traj_id].ts == unsafe.ts
    over["max_safe_prompt_tokens"] = 4096
    runs = {r.traj_id: r for r in select_runs(trajs, tiny_tokenizer, load_prefixes_config(
        "configs/prefixes/tiny-cpu.yaml", over))[0]}
    assert runs[safe.traj_id].ts == safe.ts


@pytest.mark.parametrize("over, key", [({"finetune": "lora"}, "finetune"), ({"alarm_weight": "more"}, "alarm_weight"),
                                       ({"attn_implementation": "flash_attention_2"}, "attn_implementation"),
                                       ({"max_safe_runs": -1}, "max_safe_runs"),
                                       ({"max_safe_prompt_tokens": 0}, "max_safe_prompt_tokens"),
                                       ({"max_safe_prompt_tokens": 32}, "max_safe_prompt_tokens"),
                                       ({"max_prompt_tokens": 32}, "max_prompt_tokens"),
                                       ({"twin_weight": -1}, "twin_weight"),
                                       ({"mixed_precision": "fp8"}, "mixed_precision")])
def test_bad_configs_name_the_key(over, key):
    from aftraj.config import ConfigError

    with pytest.raises(ConfigError, match=key):
        load_prefixes_config("configs/prefixes/tiny-cpu.yaml", over)


def _with_twins(n: int):
    """`n` synthetic runs plus, for each unsafe one, a verified-safe twin: the same family and
    steps but step k*'s content (so only k*'s content tells the run from its twin)."""
    import dataclasses

    from aftraj.schema import Label

    trajs = synthetic_trajectories(n, seed=0)
    twins = []
    for t in trajs:
        if t.label.unsafe:
            k = t.label.decisive_step
            steps = [*t.steps[:k], dataclasses.replace(t.steps[k], content=f"checked: all consistent ({t.id})"),
                     *t.steps[k + 1:]]
            twins.append(dataclasses.replace(t, id=f"{t.id}-twin", steps=steps, label=Label("SAFE", "verified_safe")))
    return trajs + twins


def test_twin_groups_share_a_step_and_without_pairs_the_steps_are_unchanged(tiny_tokenizer):
    import random

    from aftraj.boundary import find_twins
    from training.prefixes.trainer import epoch_batches, step_groups, twin_pairs

    trajs = _with_twins(8)
    cfg = load_prefixes_config("configs/prefixes/tiny-cpu.yaml", {"max_prompt_tokens": 4096})
    runs, _ = select_runs(trajs, tiny_tokenizer, cfg)
    pairs = twin_pairs(runs, find_twins(trajs))
    assert len(pairs) == 6                              # every unsafe run has its twin
    for i, j, ri, rj in pairs:
        assert runs[i].alarm[ri] and runs[j].ts[rj] == runs[i].ts[ri] and runs[j].traj_id == f"{runs[i].traj_id}-twin"
    groups = step_groups(len(runs), pairs)
    assert sorted(m for g in groups for m in g) == list(range(len(runs)))
    for i, j, _, _ in pairs:
        assert any(i in g and j in g for g in groups)
    for b in epoch_batches(groups, 3, random.Random(0)):
        assert sum(len(g) for g in b) >= 2
    # no pairs: one run a group, and the same steps as slicing a shuffled order (earlier runs replay)
    plain = step_groups(len(runs), [])
    assert plain == [[i] for i in range(len(runs))]
    order = list(range(len(runs)))
    random.Random(0).shuffle(order)
    assert [[g[0] for g in b] for b in epoch_batches(plain, 4, random.Random(0))] == \
        [order[s:s + 4] for s in range(0, len(order), 4)]


@pytest.mark.slow
def test_the_twin_term_moves_the_run_above_its_twin_at_k(tmp_path, tiny_model_dir):
    """The same short run with and without the twin term: with it, the log-odds at k* of the run
    end above its twin's on more pairs and by a wider margin (the cross-entropy alone treats the
    twin's k* as one SAFE row among many)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(_with_twins(8), corpus / "train.jsonl")
    res = {}
    for w in (0.0, 4.0):
        res[w] = train(load_prefixes_config("configs/prefixes/tiny-cpu.yaml", {
            "model": str(tiny_model_dir), "data": str(corpus), "output_dir": str(tmp_path / f"run{w}"),
            "num_epochs": 6, "learning_rate": 3e-3, "runs_per_step": 4, "heldout_split": "train",
            "twin_weight": w}))
    assert res[0.0].data["twin_pairs"] == 0 and res[4.0].data["twin_pairs"] == 6
    assert not any("twin_margin" in h for h in res[0.0].history)
    assert sum(h.get("twin_pairs", 0) for h in res[4.0].history) == 6 * 6      # every pair, every epoch

    def margins(run):
        rows = {(x["id"], x["t"]): x["log_odds_after"]
                for x in map(json.loads, (run.output_dir / "heldout.jsonl").read_text().splitlines())}
        return [v - rows[(i + "-twin", t)] for (i, t), v in rows.items()
                if not i.endswith("-twin") and (i + "-twin", t) in rows and
                t == max(tt for ii, tt in rows if ii == i)]
    with_term, without = margins(res[4.0]), margins(res[0.0])
    assert len(with_term) == len(without) == 6
    assert sum(m > 0 for m in with_term) == 6
    assert sum(with_term) / 6 > sum(without) / 6 + 0.5


def test_capped_safe_runs_are_the_twins_of_the_unsafe_runs_taken(tiny_tokenizer):
    trajs = _with_twins(8)
    unsafe = [t for t in trajs if t.label.unsafe]
    others = [t for t in trajs if not t.label.unsafe]
    trajs = unsafe + others[::-1]                       # the twins of the last unsafe runs come first
    cfg = load_prefixes_config("configs/prefixes/tiny-cpu.yaml", {"max_prompt_tokens": 4096})
    runs, n = select_runs(trajs, tiny_tokenizer, cfg, (2, 2))
    ids = [r.traj_id for r in runs]
    assert ids[:2] == [unsafe[0].id, unsafe[1].id] and n["twins"] == 2
    assert set(ids[2:]) == {f"{unsafe[0].id}-twin", f"{unsafe[1].id}-twin"}


def test_an_unquoted_no_is_named_with_the_quoting_fix(tmp_path, capsys):
    # `--set mixed_precision=no`: YAML reads `no` as False; the error names the file and the key
    # and says to quote it (2026-12-03: "must be str, got bool False" left the user guessing)
    from aftraj.cli import main

    assert main(["train", "prefixes", "--config", "configs/prefixes/tiny-cpu.yaml", "--out", str(tmp_path / "o"),
                 "--set", "mixed_precision=no"]) == 2
    err = capsys.readouterr().err
    assert "configs/prefixes/tiny-cpu.yaml" in err and "mixed_precision" in err and 'quote it' in err
    assert not (tmp_path / "o").exists()
