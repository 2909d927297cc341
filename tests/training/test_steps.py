"""Step-scored decision training (training/steps, `aftraj train steps`): the rows a run gives,
the padded forward they are read from, the loss at step 1 against its closed form from
independent forwards of each cut run, every trainable parameter moving, resume equal to an
uninterrupted run, and the held-out rows + calibration the auditor loads."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from aftraj.prompt import step_decision_ids, step_reading
from aftraj.schema import Label, write_jsonl
from training.common import synthetic_trajectories
from training.steps.config import load_steps_config
from training.steps.trainer import row_logits, select_runs, step_run, train

TINY = "configs/steps/tiny-cpu.yaml"


def with_twins(trajs):
    """`trajs` plus a verified-safe twin for each unsafe run with k* >= 1 (same family, the same
    steps before k*, the same agent at k*, another content there)."""
    out = list(trajs)
    for t in trajs:
        lb = t.label
        if lb.unsafe and lb.decisive_step >= 1:
            k = lb.decisive_step
            steps = list(t.steps)
            steps[k] = dataclasses.replace(steps[k], content=steps[k].content + " (checked: correct)")
            out.append(dataclasses.replace(t, id=t.id + "-twin", steps=steps, outcome="success",
                                           label=Label(verdict="SAFE", label_source="verified_safe")))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("steps-corpus")
    write_jsonl(with_twins(synthetic_trajectories(6, seed=0)), d / "train.jsonl")
    write_jsonl(with_twins(synthetic_trajectories(4, seed=7)), d / "val.jsonl")
    return d


def cfg_of(tmp_path, tiny_model_dir, corpus, **kw):
    base = {"model": str(tiny_model_dir), "data": str(corpus), "output_dir": str(tmp_path / "run"),
            "runs_per_step": 3, "num_epochs": 2}
    return load_steps_config(TINY, {**base, **kw})


def test_rows_of_unsafe_and_safe_runs(tiny_tokenizer, tiny_model_dir, corpus, tmp_path):
    cfg = cfg_of(tmp_path, tiny_model_dir, corpus)
    trajs = synthetic_trajectories(6, seed=0)
    unsafe = next(t for t in trajs if t.label.unsafe and 1 <= t.label.decisive_step < len(t.steps) - 1)
    safe = next(t for t in trajs if not t.label.unsafe)
    k = unsafe.label.decisive_step
    r = step_run(unsafe, tiny_tokenizer, cfg)                    # after_kstar: skip
    assert [t for _, _, t, _ in r.rows] == list(range(k + 1))
    assert [y for *_, y in r.rows] == [False] * k + [True]
    sticky = step_run(unsafe, tiny_tokenizer, dataclasses.replace(cfg, after_kstar="alarm"))
    assert [y for *_, y in sticky.rows] == [t >= k for t in range(len(unsafe.steps))]
    whole = step_run(unsafe, tiny_tokenizer, cfg, every_step=True)   # held-out: the walk reads to the end
    assert [y for *_, y in whole.rows] == [t == k for t in range(len(unsafe.steps))]
    s = step_run(safe, tiny_tokenizer, cfg)
    assert [t for _, _, t, _ in s.rows] == list(range(len(safe.steps))) and not any(y for *_, y in s.rows)
    # the rows sit at the tags of the reading the auditor reads
    rd = step_reading(tiny_tokenizer, unsafe, k, **cfg.reading())
    assert r.segs == [seg.ids for seg in rd.segments] and [p for _, p, _, _ in r.rows] == rd.segments[0].tags


def test_padded_forward_equals_each_run_alone(tiny_tokenizer, tiny_model_dir, corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = cfg_of(tmp_path, tiny_model_dir, corpus, max_tokens=600, max_step_tokens=64)
    runs, _ = select_runs(with_twins(synthetic_trajectories(6, seed=0)), tiny_tokenizer, cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    group = runs[:3]
    assert len({len(s) for r in group for s in r.segs}) > 1            # the rows are padded
    assert any(len(r.segs) > 1 for r in runs)                          # and some runs have 2 segments
    with torch.no_grad():
        together = row_logits(model, group, padded=True)
        for r, lg in zip(group, together, strict=True):
            torch.testing.assert_close(lg, row_logits(model, [r])[0], atol=1e-4, rtol=1e-4)
        multi = next(r for r in runs if len(r.segs) > 1)
        alone = row_logits(model, [multi])[0]
        for (si, pos, _, _), row in zip(multi.rows, alone, strict=True):
            ref = model(input_ids=torch.tensor([multi.segs[si][:pos + 1]])).logits[0, -1]
            torch.testing.assert_close(row, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bucket", [1, 16, 64])
def test_the_trunk_equals_a_plain_forward_with_shapes_bucketed(tiny_tokenizer, tiny_model_dir, corpus, tmp_path, bucket):
    """Trunk rows (bottom reused over shared beginnings, sequences padded to `bucket`, rows to 8)
    equal a plain forward at every tag, and only bucketed shapes reach the model."""
    from transformers import AutoModelForCausalLM

    from training.steps.trainer import Trunk

    cfg = cfg_of(tmp_path, tiny_model_dir, corpus, max_tokens=600, max_step_tokens=64)
    runs, _ = select_runs(with_twins(synthetic_trajectories(6, seed=0)), tiny_tokenizer, cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    trunk = Trunk(model, 1, bucket=bucket)
    lengths = []
    hook = model.model.layers[-1].register_forward_pre_hook(
        lambda _m, a, kw: lengths.append((a[0] if a else kw["hidden_states"]).shape[1]), with_kwargs=True)
    with torch.no_grad():
        got = trunk.row_logits(runs)
    hook.remove()
    assert trunk.reused > 0                                          # twins and the opening were shared
    assert lengths and all(n % bucket == 0 for n in lengths)
    with torch.no_grad():
        for r, lg in zip(runs, got, strict=True):
            assert lg.shape[0] == len(r.rows)
            for (si, pos, _, _), row in zip(r.rows, lg, strict=True):
                ref = model(input_ids=torch.tensor([r.segs[si][:pos + 1]])).logits[0, -1]
                torch.testing.assert_close(row, ref, atol=1e-4, rtol=1e-4)


def test_step_one_loss_is_its_closed_form(tiny_tokenizer, tiny_model_dir, corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    from aftraj.boundary import find_twins
    from aftraj.readers import load_trajectories

    cfg = cfg_of(tmp_path, tiny_model_dir, corpus, max_steps=1, twin_weight=1.5)
    res = train(cfg)
    first = res.history[0]
    trajs = {t.id: t for t in load_trajectories(corpus / "train.jsonl", "jsonl")}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    safe_tok, alarm_tok = step_decision_ids(tiny_tokenizer)

    def logp(traj, t):          # the run cut after step t, alone: the last token is step t's tag
        ids = step_reading(tiny_tokenizer, traj, t, **cfg.reading()).segments[-1].ids
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)

    def rows(traj):
        lb = traj.label
        last = lb.decisive_step if lb.unsafe else len(traj.steps) - 1
        return [(t, lb.unsafe and t == lb.decisive_step) for t in range(last + 1)]

    all_rows = [y for tr in trajs.values() for _, y in rows(tr)]
    w_alarm = (len(all_rows) - sum(all_rows)) / sum(all_rows)
    batch = [trajs[i] for i in first["runs"]]
    w_total = sum(w_alarm if y else 1.0 for tr in batch for _, y in rows(tr))
    ce = sum((w_alarm if y else 1.0) * -float(logp(tr, t)[alarm_tok if y else safe_tok])
             for tr in batch for t, y in rows(tr)) / w_total
    twin_of = find_twins(list(trajs.values()))
    pairs = [(u, twin_of[u.id]) for u in batch if u.id in twin_of and twin_of[u.id] in batch]
    assert pairs, "the first step holds no twin pair: the closed form would not test the twin term"
    twin = 0.0
    for u, s in pairs:
        k = u.label.decisive_step
        lu, ls = logp(u, k), logp(s, k)
        m = float((lu[alarm_tok] - lu[safe_tok]) - (ls[alarm_tok] - ls[safe_tok]))
        twin += 1.5 * math.log1p(math.exp(-m)) / len(pairs)
    assert first["loss"] == pytest.approx(ce + twin, rel=1e-4, abs=1e-5)
    # the frozen bottom ran from shared beginnings (the template and system prompt, a twin's steps)
    assert res.data["trunk_tokens_reused"] > res.data["trunk_tokens_run"] / 10
    assert res.final_dir is None and res.data["steps"] == 1          # stopped by max_steps: no export


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_every_trainable_parameter_changes_and_resume_equals_an_uninterrupted_run(
        tiny_model_dir, corpus, tmp_path):
    whole = train(cfg_of(tmp_path / "a", tiny_model_dir, corpus))
    assert whole.data["steps"] == whole.data["steps_planned"] >= 4
    base, after = _weights(tiny_model_dir), _weights(whole.final_dir)
    top = f"model.layers.{sum(1 for k in base if k.endswith('self_attn.q_proj.weight')) - 1}."
    trainable = [k for k in base if k.startswith(top) or k == "model.norm.weight"]
    assert trainable
    for k in base:
        moved = not torch.equal(base[k], after[k])
        assert moved == (k in trainable), k
    # interrupted after 2 steps (a checkpoint), then resumed: the same weights and losses
    part = train(cfg_of(tmp_path / "b", tiny_model_dir, corpus, save_steps=2, max_steps=2))
    assert part.final_dir is None and (part.output_dir / "checkpoint" / "trainer.json").is_file()
    rest = train(cfg_of(tmp_path / "b", tiny_model_dir, corpus, save_steps=2), resume=True)
    assert [h["loss"] for h in rest.history] == pytest.approx([h["loss"] for h in whole.history], rel=1e-5)
    resumed = _weights(rest.final_dir)
    for k in after:
        torch.testing.assert_close(resumed[k], after[k], atol=1e-6, rtol=1e-6)
    lines = (rest.output_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, whole.data["steps"] + 1))


def test_resume_without_a_checkpoint_is_a_clear_error(tiny_model_dir, corpus, tmp_path):
    from aftraj.errors import UsageError

    with pytest.raises(UsageError, match="no checkpoint to resume from"):
        train(cfg_of(tmp_path, tiny_model_dir, corpus), resume=True)


def test_config_rejects_bad_values():
    from aftraj.config import ConfigError

    with pytest.raises(ConfigError, match="after_kstar"):
        load_steps_config(TINY, {"after_kstar": "safe"})
    with pytest.raises(ConfigError, match="max_step_tokens"):
        load_steps_config(TINY, {"max_tokens": 512, "max_step_tokens": 400})
