"""An every-prefix run's held-out rows read as a walk (eval/prefix_rows.py): the threshold the walk's
own rule picks on them, the post-vs-twin control (content-blind scores are one half), and
`aftraj eval tune-threshold RUN` on a `aftraj train prefixes` run folder."""

import json

import pytest

from aftraj.schema import write_jsonl
from eval.prefix_rows import heldout_threshold, heldout_twins


def _heldout_runs():
    """Two unsafe runs, each with its verified-safe twin (identical but step k*'s content), and
    one other safe run."""
    from aftraj.schema import Label, Step, Trajectory

    def run(i, n, k, rid):
        agents = ["user", "Solver", "Verifier"]
        steps = [Step(index=j, agent=agents[0] if j == 0 else agents[1 + j % 2], kind="message",
                      content=f"step {j} of run {i}" + (" wrong" if j == k else "")) for j in range(n)]
        label = (Label("SAFE", "verified_safe") if k is None else
                 Label("UNSAFE", "injected", decisive_step=k, decisive_agent=steps[k].agent, reason="bad"))
        return Trajectory(id=rid, family_id=f"f{i}", domain="math", source="test", task="t", steps=steps, label=label)

    return [run(0, 6, 3, "u0"), run(0, 6, None, "w0"), run(1, 5, 2, "u1"), run(1, 5, None, "w1"),
            run(2, 5, None, "s2")]


def _rows(trajs, score):
    return [{"id": t.id, "t": i, "alarm": t.label.unsafe and i == t.label.decisive_step,
             "step_agent": t.steps[i].agent, "log_odds_before": 0.0, "log_odds_after": score(t, i)}
            for t in trajs for i in range(t.label.decisive_step + 1 if t.label.unsafe else len(t.steps))]


def test_heldout_rows_give_the_walk_threshold_and_the_twin_control():
    trajs = _heldout_runs()
    by_id = {t.id: t for t in trajs}
    # content: high at the decisive step only, on the unsafe run (its twin's k* row stays low)
    rows = _rows(trajs, lambda t, i: 3.0 if t.label.unsafe and i == t.label.decisive_step else -1.0)
    content = heldout_twins(rows, by_id, "log_odds_after")
    assert content["post_beats_twin"]["n"] == 2 and content["post_beats_twin"]["share"] == 1.0
    assert content["post_beats_pre"]["share"] == 1.0
    th = heldout_threshold(rows, by_id, "log_odds_after")
    assert th["threshold"] == 3.0 and th["exact_f1"] == 1.0 and th["far"] == 0.0 and th["within_far"]
    assert th["n_runs"] == 5 and th["n_unsafe"] == 2
    # content-blind (the position alone): the twin ties the post prefix, one half by construction
    blind_rows = _rows(trajs, lambda t, i: float(i))
    blind = heldout_twins(blind_rows, by_id, "log_odds_after")
    assert blind["post_beats_twin"]["share"] == 0.5 and blind["post_beats_pre"]["share"] == 1.0
    # later-is-worse alarms on the longer safe runs too: within FAR <= 20 % it can only never alarm
    never = heldout_threshold(blind_rows, by_id, "log_odds_after")
    assert never["exact_f1"] == 0.0 and never["far"] == 0.0
    with pytest.raises(ValueError, match="'nope'"):
        heldout_threshold([{**rows[0], "id": "nope"}], by_id, "log_odds_after")


def test_tune_threshold_reads_an_every_prefix_runs_heldout_rows(tmp_path, capsys):
    from aftraj.cli import main

    trajs = _heldout_runs()
    corpus, run = tmp_path / "corpus", tmp_path / "run"
    corpus.mkdir()
    run.mkdir()
    write_jsonl(trajs, corpus / "val.jsonl")
    (run / "config.json").write_text(json.dumps({"data": str(corpus), "heldout_split": "val"}))
    rows = _rows(trajs, lambda t, i: 3.0 if t.label.unsafe and i == t.label.decisive_step else -1.0)
    (run / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "tune-threshold", str(run), "--out", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("threshold 3.0: Exact-F1 1.0, FAR 0.0")
    assert "post beats twin on 2 held-out pairs: 1.000" in out and "before training: 0.500" in out
    assert json.loads((tmp_path / "t.json").read_text())["pick"]["threshold"] == 3.0
    # a row of a run the held-out split lacks, a run without heldout_split: errors naming the file
    (run / "heldout.jsonl").write_text(json.dumps({**rows[0], "id": "nope"}) + "\n")
    assert main(["eval", "tune-threshold", str(run)]) == 2
    assert "'nope'" in capsys.readouterr().err
    (run / "config.json").write_text(json.dumps({"data": str(corpus), "heldout_split": None}))
    assert main(["eval", "tune-threshold", str(run)]) == 2
    assert "config.json" in capsys.readouterr().err
