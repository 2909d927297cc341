"""Stage-1 sampling happens only for the pairs that will be trained on (config `max_pairs`),
with a progress bar counting sampled prompts."""

from __future__ import annotations

from aftraj.boundary import boundary_prompts
from training.stage1.preferences import build_preferences, cap_pairs


class _Counting:
    batch_size = 2

    def __init__(self):
        self.seen = 0

    def sample(self, prompts, k):
        from training.stage1.preferences import _tick

        self.seen += len(prompts)
        self.calls = getattr(self, "calls", 0) + 1
        out = []
        for _ in prompts:
            out.append(["nonsense"] * k)
            _tick(self, 1)
        self.ticked = self.on_progress.__self__.n   # the bar's count, read while it is live
        return out


def test_cap_pairs_keeps_whole_pairs_seeded(handmade):
    prompts, _ = boundary_prompts(handmade)
    n = len({p.traj_id for p in prompts})
    assert n == 5
    for cap in (1, 2, 4):
        kept = cap_pairs(prompts, cap, seed=0)
        ids = {p.traj_id for p in kept}
        assert len(ids) == cap                                     # whole runs: pre and post (k* = 0: post only)
        assert kept == [p for p in prompts if p.traj_id in ids]
        assert kept == cap_pairs(prompts, cap, seed=0)            # seeded
    assert cap_pairs(prompts, 5, seed=0) == list(prompts) == cap_pairs(prompts, None, seed=0)
    assert cap_pairs(prompts, 6, seed=0) == list(prompts)


def test_only_capped_prompts_are_sampled_with_a_bar(handmade, capsys):
    prompts, _ = boundary_prompts(handmade)
    s = _Counting()
    kept = cap_pairs(prompts, 2, seed=3)
    records, stats = build_preferences(kept, s, 2, progress=True)
    n = len(kept)
    assert s.seen == n and len(records) == n and stats.n_samples == 2 * n and n < len(prompts)
    assert s.calls == 1 and s.ticked == n and s.on_progress is None   # one call: batching unchanged
    err = capsys.readouterr().err
    assert "stage-1 sampling (K=2)" in err and f"0/{n} " in err and "prompt/s" in err   # counts prompts


def test_max_pairs_in_config_and_trainer(stage1_cfg):
    import json

    from training.stage1.trainer import train

    cfg = stage1_cfg(max_steps=1, save_steps=1, max_pairs=2, samples_per_prompt=1)
    res = train(cfg, progress=False)
    stats = json.loads((res.output_dir / "preference_stats.json").read_text())
    assert stats["pairs"] == {"available": 5, "used": 2, "max_pairs": 2}
    assert 3 <= stats["n_prompts"]["pre"] + stats["n_prompts"]["post"] <= 4
