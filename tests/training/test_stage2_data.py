"""Stage-2 data: every prefix of every train trajectory with its gold verdict (SAFE before k*,
UNSAFE (k*, a*) from k* on), a balanced seeded sample, the shared prompt builder, verl's record
layout; val/test and Who&When refused."""

from __future__ import annotations

import json

import pytest

from aftraj.prompt import render
from aftraj.verdict import gold_verdict
from training.stage2.data import balanced_sample, build_records, prefix_candidates, trl_dataset, write_parquet


def test_every_prefix_with_its_gold_verdict(handmade):
    safe, unsafe, st = prefix_candidates(handmade)
    assert st.n_trajectories == 6 and st.n_safe_trajectories == 1 and st.n_unsafe_trajectories == 5
    assert len(safe) + len(unsafe) == sum(len(t.steps) for t in handmade)
    for i, t in unsafe:
        lb = handmade[i].label
        assert lb.unsafe and t >= lb.decisive_step
    for i, t in safe:
        lb = handmade[i].label
        assert not lb.unsafe or t < lb.decisive_step
    # the boundary on both sides: k* - 1 is SAFE, k* is UNSAFE (run 0 has k* = 2)
    assert (0, 1) in safe and (0, 2) in unsafe and (3, 0) in unsafe   # run 3 has k* = 0


@pytest.mark.parametrize("frac", [0.25, 0.5, 0.75])
def test_balanced_sample_keeps_the_configured_share(frac):
    safe, unsafe = [("s", i) for i in range(100)], [("u", i) for i in range(100)]
    s, u = balanced_sample(safe, unsafe, max_prompts=40, unsafe_fraction=frac, seed=0)
    assert len(s) + len(u) == 40 and len(u) == round(40 * frac)
    assert len(set(s)) == len(s) and len(set(u)) == len(u)
    assert balanced_sample(safe, unsafe, max_prompts=40, unsafe_fraction=frac, seed=0) == (s, u)   # seeded


def test_balanced_sample_shrinks_to_keep_the_share_when_a_pool_is_short():
    s, u = balanced_sample([1] * 100, [2] * 10, max_prompts=60, unsafe_fraction=0.5, seed=1)
    assert (len(s), len(u)) == (10, 10)
    with pytest.raises(ValueError, match="both gold verdicts"):
        balanced_sample([1, 2], [], max_prompts=4, unsafe_fraction=0.5, seed=0)


def test_records_are_verl_rows_rendered_by_the_shared_builder(handmade, tmp_path):
    recs, st = build_records(handmade, max_prompts=10, unsafe_fraction=0.5, seed=0, budget=4096)
    assert len(recs) == 10 and st.n_safe_gold == st.n_unsafe_gold == 5
    by_id = {t.id: t for t in handmade}
    for r in recs:
        x = r["extra_info"]
        traj = by_id[x["traj_id"]]
        assert r["prompt"] == render(traj, x["t"], 4096)
        gold = gold_verdict(traj, x["t"])
        gt = json.loads(r["reward_model"]["ground_truth"])
        assert gt == {"answer": "SAFE" if not gold.alarm else gold.step, "agent": gold.agent if gold.alarm else None}
        assert x["agents"] == list(dict.fromkeys(s.agent for s in traj.steps[: x["t"] + 1]))
        assert r["data_source"] == "aftraj" and x["split"] == "train"
    write_parquet(recs, tmp_path / "train.parquet")
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "train.parquet")
    assert {"prompt", "data_source", "reward_model", "extra_info"} <= set(table.column_names)
    assert table.num_rows == 10
    ds = trl_dataset(recs)
    assert ds.column_names == ["prompt", "ground_truth", "t", "agents", "traj_id"] and len(ds) == 10


def test_val_test_and_who_and_when_never_enter(handmade):
    import dataclasses

    for split in ("val", "test"):
        held = dataclasses.replace(handmade[0], meta={"split": split})
        with pytest.raises(ValueError, match=f"'hand-0' is in the {split} split"):
            prefix_candidates([*handmade[1:], held])
    train = dataclasses.replace(handmade[0], meta={"split": "train"})   # the train side is accepted
    assert prefix_candidates([*handmade[1:], train])[2].n_trajectories == len(handmade)
    ww = dataclasses.replace(handmade[0], source="who_and_when/Hand-Crafted")
    with pytest.raises(ValueError, match="Who&When"):
        prefix_candidates([ww])


def test_loader_drops_val_and_test_by_meta_split(handmade, tmp_path):
    import dataclasses

    from aftraj.schema import write_jsonl
    from training.common import load_training_trajectories

    splits = ["train", "val", "test", "train", "train", "train"]
    trajs = [dataclasses.replace(t, meta={"split": s}) for t, s in zip(handmade, splits, strict=True)]
    write_jsonl(trajs, tmp_path / "corpus.jsonl")
    got, src = load_training_trajectories(str(tmp_path))
    assert [t.id for t in got] == ["hand-0", "hand-3", "hand-4", "hand-5"] and "excluded 2" in src
    prefix_candidates(got)   # accepted


def _imported(traj):
    """`traj` as an adapter imports it: the placeholder SAFE label marked unlabeled."""
    import dataclasses

    from aftraj.boundary import UNLABELED

    return dataclasses.replace(traj, label=UNLABELED, meta={"unlabeled": True}, outcome="unknown")


def test_unlabeled_imported_runs_are_refused_by_name(handmade, tmp_path):
    from aftraj.schema import write_jsonl
    from training.common import load_training_trajectories

    imported = _imported(handmade[1])
    with pytest.raises(ValueError, match="'hand-1'.*no gold label"):
        prefix_candidates([*handmade[:1], imported, *handmade[2:]])
    write_jsonl([*handmade[:1], imported, *handmade[2:]], tmp_path / "train.jsonl")
    with pytest.raises(ValueError, match="'hand-1'.*no gold label"):
        load_training_trajectories(str(tmp_path))
    write_jsonl(handmade, tmp_path / "train.jsonl")   # the labelled side is accepted
    assert len(load_training_trajectories(str(tmp_path))[0]) == len(handmade)


def test_decisive_agent_acting_after_k_star_is_skipped_and_counted(handmade):
    """The gold answer at t = k* must be grounded (a* in steps 0..k*), else it scores malformed."""
    import dataclasses

    from training.reward import compute_score
    from aftraj.verdict import gold_completion

    run = handmade[0]                         # k* = 2
    late = next(s.agent for s in run.steps[3:] if s.agent not in {x.agent for x in run.steps[:3]})
    bad = dataclasses.replace(run, id="late-agent", label=dataclasses.replace(run.label, decisive_agent=late))
    safe, unsafe, st = prefix_candidates([*handmade, bad])
    assert st.skipped_decisive_agent_not_visible == 1 and st.n_unsafe_trajectories == 5
    assert all(i != len(handmade) for i, _ in safe + unsafe)
    # every kept UNSAFE prefix's gold answer earns the full score (grounded)
    recs, _ = build_records([*handmade, bad], max_prompts=100, unsafe_fraction=0.5, seed=0)
    by_id = {t.id: t for t in handmade}
    for r in recs:
        x = r["extra_info"]
        assert x["traj_id"] != "late-agent"
        sc = compute_score("aftraj", gold_completion(by_id[x["traj_id"]], x["t"]), r["reward_model"]["ground_truth"], x)
        assert sc["format"] == 1.0
    with pytest.raises(ValueError, match="all 1 unsafe trajectories were skipped"):
        build_records([handmade[5], bad], max_prompts=10, unsafe_fraction=0.5, seed=0)
    # the unchanged run (a* visible at k*) is kept
    _, _, st = prefix_candidates(handmade)
    assert st.skipped_decisive_agent_not_visible == 0


@pytest.mark.parametrize("max_prompts", [2, 3, 7, 40])
@pytest.mark.parametrize("frac", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_balanced_sample_never_exceeds_max_prompts(max_prompts, frac):
    s, u = balanced_sample(list(range(100)), list(range(100)), max_prompts=max_prompts,
                           unsafe_fraction=frac, seed=0)
    assert len(s) + len(u) == max_prompts and len(s) >= 1 and len(u) >= 1   # the cap, reached exactly
    with pytest.raises(ValueError, match="max_prompts"):   # one prompt cannot hold both verdicts
        balanced_sample(list(range(100)), list(range(100)), max_prompts=1, unsafe_fraction=frac, seed=0)


def test_balanced_sample_loses_no_prompt_to_float_truncation():
    # 0.3 * 10 is 2.9999999999999996 in floats: 10 unsafe at a 0.3 share allow 33 prompts, not 32 or 30
    s, u = balanced_sample(list(range(1000)), list(range(10)), max_prompts=1000, unsafe_fraction=0.3, seed=0)
    assert (len(s), len(u)) == (23, 10)
    # 3 safe at a 0.7 unsafe share allow exactly 10 prompts (3 / (1 - 0.7) is 9.999999999999998 in floats)
    s, u = balanced_sample(list(range(3)), list(range(1000)), max_prompts=1000, unsafe_fraction=0.7, seed=0)
    assert (len(s), len(u)) == (3, 7)


def test_config_refuses_a_single_prompt():
    from training.stage2.config import ConfigError, load_stage2_config

    assert load_stage2_config("configs/stage2/tiny-cpu.yaml", {"max_prompts": 2}).max_prompts == 2
    with pytest.raises(ConfigError, match="max_prompts"):
        load_stage2_config("configs/stage2/tiny-cpu.yaml", {"max_prompts": 1})
