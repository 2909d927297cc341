"""`hf-steps` (eval/auditors/hf_steps.py): one incremental forward per step on the trajectory's KV
cache gives the scores of one forward over the whole run (segments and truncation included); the
calibration stored with a `aftraj train steps` checkpoint is loaded; an ALARM names step t and its
agent, and the reason is generated only on a crossing."""

from __future__ import annotations

import json

import pytest
import torch

from aftraj.prompt import step_decision_ids, step_reading
from aftraj.schema import write_jsonl
from eval.auditors import get_auditor
from training.common import synthetic_trajectories


def _whole_run_scores(model, tok, traj, bounds):
    r = step_reading(tok, traj, **bounds)
    s, a = step_decision_ids(tok)
    with torch.no_grad():
        lps = [torch.log_softmax(model(input_ids=torch.tensor([g.ids])).logits[0].float(), -1) for g in r.segments]
    return [float(lps[si][p, a] - lps[si][p, s]) for si, p in r.scored_at]


@pytest.mark.parametrize("bounds", [{"max_tokens": 4096, "max_step_tokens": 512},
                                    {"max_tokens": 560, "max_step_tokens": 48},
                                    {"max_tokens": 560, "max_step_tokens": 48, "keep_tokens": 100}],
                         ids=["one-segment", "segments", "segments-keeping-steps"])
def test_incremental_scores_equal_one_forward_over_the_run(noisy_tiny, bounds):
    model, tok = noisy_tiny
    aud = get_auditor("hf-steps", model=model, tokenizer=tok, reason="none", threshold=1e9, **bounds)
    for traj in synthetic_trajectories(4, seed=3):
        want = _whole_run_scores(model, tok, traj, bounds)
        got = [aud.audit(traj, t) for t in range(len(traj.steps))]
        assert [r.decision_log_odds for r in got] == pytest.approx(want, abs=1e-4)
        assert all(not r.alarm for r in got)
        # each event feeds only its own step (a new segment: the opening's KV is kept)
        n_open = len(aud.sessions[traj.id].reading.opening)
        assert all(b.cached_tokens in (a.prompt_tokens, n_open) for a, b in zip(got, got[1:], strict=False))
        assert got[0].cached_tokens == 0
        aud.end(traj)
    assert len({round(v, 3) for v in want}) > 1


def test_an_event_feeds_bucketed_shapes_and_leaves_no_pad_in_the_cache(noisy_tiny):
    """Each event's new tokens reach the model padded to FEED_BUCKET (bounded oneDNN shapes); the
    pads leave the cache at once (its length is the reading's), and the scores stay the run's."""
    from eval.auditors.hf_steps import FEED_BUCKET

    model, tok = noisy_tiny
    bounds = {"max_tokens": 560, "max_step_tokens": 48}
    aud = get_auditor("hf-steps", model=model, tokenizer=tok, reason="none", threshold=1e9, **bounds)
    fed = []
    hook = model.model.register_forward_pre_hook(lambda _m, a, kw: fed.append(kw["input_ids"].shape[1]),
                                                 with_kwargs=True)
    traj = synthetic_trajectories(4, seed=3)[0]
    try:
        got = [aud.audit(traj, t).decision_log_odds for t in range(len(traj.steps))]
    finally:
        hook.remove()
    s = aud.sessions[traj.id]
    assert fed and all(n % FEED_BUCKET == 0 for n in fed) and any(n > FEED_BUCKET for n in fed)
    assert s.cache.get_seq_length() == s.fed
    assert got == pytest.approx(_whole_run_scores(model, tok, traj, bounds), abs=1e-4)


def test_a_walk_holds_one_trajectorys_cache_at_a_time(noisy_tiny, monkeypatch):
    from eval.walker import walk

    model, tok = noisy_tiny
    aud = get_auditor("hf-steps", model=model, tokenizer=tok, reason="none", threshold=1e9)
    held, audit = [], aud.audit
    monkeypatch.setattr(aud, "audit", lambda traj, t: held.append(len(aud.sessions)) or audit(traj, t))
    records = walk(aud, synthetic_trajectories(5, seed=3))
    assert len(records) == 5 and held and max(held) <= 1 and not aud.sessions


def test_out_of_order_prefix_rereads_the_run(noisy_tiny):
    model, tok = noisy_tiny
    aud = get_auditor("hf-steps", model=model, tokenizer=tok, reason="none", threshold=1e9)
    traj = synthetic_trajectories(2, seed=4)[0]
    late = aud.audit(traj, len(traj.steps) - 1).decision_log_odds
    early = aud.audit(traj, 1).decision_log_odds                   # a fresh reading, not the cache past t
    assert early == pytest.approx(_whole_run_scores(model, tok, traj, aud.bounds)[1], abs=1e-4)
    assert late == pytest.approx(_whole_run_scores(model, tok, traj, aud.bounds)[-1], abs=1e-4)


def test_alarm_names_step_t_and_its_agent_and_the_reason_comes_only_on_a_crossing(noisy_tiny, monkeypatch):
    model, tok = noisy_tiny
    # a run whose score first passes its earlier maximum at some step t >= 1: the threshold between
    for traj in synthetic_trajectories(6, seed=5):
        scores = _whole_run_scores(model, tok, traj, {"max_tokens": 4096, "max_step_tokens": 512})
        t_cross = next((t for t in range(1, len(scores)) if scores[t] > max(scores[:t]) + 1e-3), None)
        if t_cross is not None:
            break
    assert t_cross is not None
    thr = (scores[t_cross] + max(scores[:t_cross])) / 2
    aud = get_auditor("hf-steps", model=model, tokenizer=tok, threshold=thr, reason_max_new_tokens=8)
    calls = []
    from eval.auditors.hf import HFAuditor

    real = HFAuditor.audit
    monkeypatch.setattr(HFAuditor, "audit", lambda self, tr, t: calls.append(t) or real(self, tr, t))
    res = [aud.audit(traj, t) for t in range(t_cross + 1)]
    assert [r.alarm for r in res] == [False] * t_cross + [True]
    v = res[-1].verdict
    assert (v.step, v.agent) == (t_cross, traj.steps[t_cross].agent) and v.reason
    assert calls == [t_cross]                        # the generative path ran once, on the crossing
    assert res[-1].completion_tokens > 0 and res[0].completion_tokens == 0


def test_a_trained_checkpoint_carries_its_calibration(tiny_model_dir, tmp_path):
    """`aftraj train steps` with a held-out split: the rows are the auditor's own scores, the
    threshold is chosen on them and stored in final/, and the auditor walks with it."""
    from aftraj.drivers.steps import run
    from training.steps.cli import add_arguments
    import argparse

    d = tmp_path / "corpus"
    d.mkdir()
    write_jsonl(synthetic_trajectories(6, seed=0), d / "train.jsonl")
    write_jsonl(synthetic_trajectories(5, seed=9), d / "val.jsonl")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--config", "configs/steps/tiny-cpu.yaml", "--data", str(d), "--out", str(tmp_path / "run"),
                         "--model", str(tiny_model_dir), "--set", "heldout_split=val", "--set", "num_epochs=1",
                         "--no-progress"])
    assert run(args) == 0
    cal = json.loads((tmp_path / "run" / "final" / "steps_calibration.json").read_text())
    assert cal["max_far"] == 0.2 and cal["val"]["n_runs"] == 5 and (cal["val"]["far"] or 0) <= 0.2
    rows = [json.loads(x) for x in (tmp_path / "run" / "heldout_steps.jsonl").read_text().splitlines()]
    val = synthetic_trajectories(5, seed=9)
    assert len(rows) == sum(len(t.steps) for t in val)                # every step of every held-out run
    aud = get_auditor("hf-steps", model=str(tmp_path / "run" / "final"), reason="none")
    assert aud.threshold == cal["threshold"] and "uncalibrated" not in aud.label
    reading = json.loads((tmp_path / "run" / "final" / "steps_reading.json").read_text())
    assert reading["max_tokens"] == 2048 and aud.bounds["max_tokens"] == 2048
    assert aud.mixed_precision == reading["mixed_precision"] == "no"     # scored as calibrated
    for traj in val[:2]:
        got = [aud.audit(traj, t).decision_log_odds for t in range(len(traj.steps))]
        want = [r["log_odds"] for r in rows if r["id"] == traj.id]
        assert got == pytest.approx(want, abs=2e-4)


def test_bad_calibration_file_is_a_clear_error(tiny_model_dir, tmp_path):
    import shutil

    m = tmp_path / "m"
    shutil.copytree(tiny_model_dir, m)
    (m / "steps_calibration.json").write_text(json.dumps({"threshold": "high"}))
    with pytest.raises(ValueError, match=r"steps_calibration.json: field 'threshold' must be a finite number"):
        get_auditor("hf-steps", model=str(m))


def test_the_walks_max_new_tokens_bounds_the_reason_and_zero_skips_it(noisy_tiny, monkeypatch):
    model, tok = noisy_tiny
    traj = synthetic_trajectories(1, seed=5)[0]
    assert get_auditor("hf-steps", model=model, tokenizer=tok, max_new_tokens=12).reason_max_new_tokens == 12
    assert get_auditor("hf-steps", model=model, tokenizer=tok, max_new_tokens=1024).reason_max_new_tokens == 256
    aud = get_auditor("hf-steps", model=model, tokenizer=tok, max_new_tokens=0, threshold=-1e9)
    from eval.auditors.hf import HFAuditor

    monkeypatch.setattr(HFAuditor, "audit", lambda *a: pytest.fail("no reason is generated at --max-new-tokens 0"))
    r = aud.audit(traj, 0)
    assert r.alarm and r.completion_tokens == 0 and "threshold" in r.verdict.reason


def test_an_owned_model_under_bf16_keeps_its_linears_in_bf16_with_the_same_scores(tiny_model_dir):
    """`bf16_linears`: a model the auditor loaded itself, read under bf16 autocast, stores its
    decoder's linear weights in bf16 once (autocast would cast them every event): the same
    log-odds as the float32 weights under autocast; norms, embeddings and the head stay float32."""
    from aftraj.models import load_model_and_tokenizer as load_model

    traj = synthetic_trajectories(1, seed=6)[0]
    owned = get_auditor("hf-steps", model=str(tiny_model_dir), reason="none", threshold=1e9, mixed_precision="bf16")
    dtypes = {n: p.dtype for n, p in owned.model.named_parameters()}
    assert any(d == torch.bfloat16 for n, d in dtypes.items() if "layers." in n and n.endswith("proj.weight"))
    assert all(d == torch.float32 for n, d in dtypes.items() if "norm" in n or "embed" in n or "lm_head" in n)
    model, tok = load_model(str(tiny_model_dir), dtype="float32")
    shared = get_auditor("hf-steps", model=model, tokenizer=tok, reason="none", threshold=1e9, mixed_precision="bf16")
    assert all(p.dtype == torch.float32 for p in shared.model.parameters())    # not its model: untouched
    got = [owned.audit(traj, t).decision_log_odds for t in range(len(traj.steps))]
    want = [shared.audit(traj, t).decision_log_odds for t in range(len(traj.steps))]
    assert got == pytest.approx(want, abs=1e-4)
