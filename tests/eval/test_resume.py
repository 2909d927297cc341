"""`aftraj eval` writes predictions.jsonl as walks end and `--resume` continues a killed run
(eval/resume.py); bad `--out` / `--auc-start` are refused before anything runs (issue 23)."""

from __future__ import annotations

import json

import pytest

from aftraj.cli import main
from aftraj.schema import write_jsonl


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _comparable(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "latencies_s"}


@pytest.fixture
def noisy_model_dir(noisy_tiny, tmp_path_factory):
    """The context-sensitive tiny model saved as a folder, so `--auditor hf --model DIR` reads it."""
    model, tok = noisy_tiny
    d = tmp_path_factory.mktemp("noisy-tiny")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_an_interrupted_hf_evaluation_resumes_to_the_same_predictions(noisy_model_dir, tmp_path, make_traj,
                                                                      monkeypatch, torch_one_thread):
    from eval.auditors.hf import HFAuditor
    from eval.resume import PredictionLog

    data = tmp_path / "set.jsonl"
    write_jsonl([make_traj(i, n, k) for i, (n, k) in enumerate([(3, 1), (2, None), (4, 2), (3, None), (2, 1)])],
                data)
    common = ["eval", "--auditor", "hf", "--model", str(noisy_model_dir), "--data", str(data),
              "--max-new-tokens", "12", "--max-in-flight", "2", "--no-progress", "--n-boot", "20"]
    assert main(common + ["--out", str(tmp_path / "whole")]) == 0
    whole = _lines(tmp_path / "whole" / "predictions.jsonl")
    assert len({r["trace"][0]["raw"] for r in whole}) > 1     # the model's replies differ: not vacuous

    # a kill after two trajectories, in the middle of writing the third line
    real_write, written = PredictionLog.write, []

    def dying_write(self, rec):
        if len(written) == 2:
            self._f.write(json.dumps(rec)[:40])
            self._f.flush()
            raise KeyboardInterrupt
        written.append(rec["id"])
        real_write(self, rec)

    monkeypatch.setattr(PredictionLog, "write", dying_write)
    out = tmp_path / "cut"
    assert main(common + ["--out", str(out)]) == 130       # Ctrl-C: "interrupted"
    monkeypatch.setattr(PredictionLog, "write", real_write)
    kept = out / "predictions.jsonl"
    text = kept.read_text()
    assert text.count("\n") == 2 and not text.endswith("\n")   # two whole lines and a cut one
    assert [json.loads(x)["id"] for x in text.split("\n")[:2]] == written

    asked = []
    real_batch = HFAuditor.audit_batch
    monkeypatch.setattr(HFAuditor, "audit_batch", lambda self, reqs: asked.extend(t.id for t, _ in reqs)
                        or real_batch(self, reqs))
    assert main(common + ["--out", str(out), "--resume"]) == 0
    assert not set(asked) & set(written)                     # finished walks are not walked again
    resumed = _lines(kept)
    assert [_comparable(r) for r in resumed] == [_comparable(r) for r in whole]
    m = json.loads((out / "metrics.json").read_text())
    assert m["resumed_trajectories"] == 2 and m["n_trajectories"] == 5


def test_resume_with_other_settings_is_refused(tmp_path, make_traj, capsys):
    data = tmp_path / "set.jsonl"
    write_jsonl([make_traj(0, 3, 1), make_traj(1, 2, None)], data)
    out = tmp_path / "o"
    args = ["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(out), "--no-progress",
            "--n-boot", "10"]
    assert main(args) == 0
    assert main(args + ["--resume"]) == 0          # everything already walked: report rewritten
    assert "2 of 2 trajectories already walked, 0 to go" in capsys.readouterr().err
    assert main(args + ["--resume", "--protocol", "reference"]) == 2
    err = capsys.readouterr().err
    assert "protocol='strict'" in err and "protocol='reference'" in err
    (out / "predictions.jsonl").write_text('{"id": "t0"}\nnot json\n{"id": "t1"}\n')
    assert main(args + ["--resume"]) == 2
    assert f"{out / 'predictions.jsonl'}:2: not a prediction record" in capsys.readouterr().err


def test_out_that_is_a_file_fails_before_the_evaluation(tmp_path, make_traj, capsys, monkeypatch):
    import eval.walker

    data = tmp_path / "set.jsonl"
    write_jsonl([make_traj(0, 3, 1)], data)
    f = tmp_path / "report.txt"
    f.write_text("keep me")
    monkeypatch.setattr(eval.walker, "walk", lambda *a, **k: pytest.fail("the walk started"))
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(f), "--no-progress"]) == 2
    assert f"--out {f}: is a file" in capsys.readouterr().err and f.read_text() == "keep me"
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(tmp_path / "o"),
                 "--auc-start", "-1"]) == 2
    assert "--auc-start must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_progress_without_a_terminal_prints_lines_every_few_seconds():
    import io

    from aftraj.console import LineProgress, progress

    now = [0.0]
    buf = io.StringIO()
    bar = LineProgress(100, "eval hf", "call", stream=buf, interval=5.0, clock=lambda: now[0])
    for i in range(90):      # 90 calls, 0.25 s each: 22.5 s
        now[0] += 0.25
        bar.update(1)
        if i == 49:
            bar.total -= 10  # walks ended early: 10 calls no longer needed
    bar.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 5, lines                # at 5, 10, 15, 20 s and the end; not 90
    assert lines[0] == "eval hf: 20/100 call (20 %), 5s elapsed, 4.00 call/s, ETA 20s"
    assert lines[-1].startswith("eval hf: 90/90 call (100 %), 22s elapsed")
    assert type(progress(3, "x", stream=io.StringIO())).__name__ == "LineProgress"   # no TTY
    import time

    beat = io.StringIO()     # a line while nothing finishes (the first batched hf round)
    p = progress(10, "slow", "call", stream=beat, interval=0.2)
    time.sleep(0.9)
    p.close()
    assert len(beat.getvalue().splitlines()) >= 2 and beat.getvalue().startswith("slow: 0/10 call (0 %)")
    silent = io.StringIO()
    p = progress(3, "x", stream=silent, enabled=False)
    p.update(3)
    p.close()
    assert silent.getvalue() == ""
