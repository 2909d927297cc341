"""What an evaluation leaves behind: the test split by default on data with splits, provenance
in metrics.json, every raw completion in predictions.jsonl, the parse-failure rate on the
console, plots only where they can be drawn, and `aftraj eval compare`."""

from __future__ import annotations

import csv
import json
import re

import pytest

from aftraj.cli import main
from aftraj.schema import write_jsonl
from eval.auditors import AuditResult, Auditor, register_auditor
from eval.provenance import prompt_template_hash

PNG = b"\x89PNG\r\n\x1a\n"


@register_auditor("test-thinker")
class _Thinker(Auditor):
    """Answers with a full <think> block; every third call is malformed."""

    def audit(self, traj, t):
        from aftraj.verdict import parse_verdict

        raw = (f"<think>step {t} of {traj.id}: long reasoning " + "x" * 400 + "</think>"
               '<answer>{"answer": "SAFE", "agent": null, "reason": null}</answer>')
        if t % 3 == 2:
            raw = "<think>unfinished"
        return AuditResult(parse_verdict(raw, t), t=t, raw=raw)


def _split_set(tmp_path, make_traj):
    trajs = []
    for i, (n, k, split) in enumerate([(5, 2, "train"), (4, None, "train"), (6, 3, "val"),
                                       (5, 1, "test"), (4, None, "test"), (6, 5, "test")]):
        t = make_traj(i, n, k)
        trajs.append(type(t)(**{**{f: getattr(t, f) for f in t.__dataclass_fields__},
                                "meta": {"split": split}}))
    path = tmp_path / "set.jsonl"
    write_jsonl(trajs, path)
    return path


def _preds(out):
    return [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]


def test_test_split_is_the_default_and_split_chooses(tmp_path, make_traj):
    data = _split_set(tmp_path, make_traj)
    out = tmp_path / "r"
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(out),
                 "--no-progress", "--n-boot", "20"]) == 0
    assert [p["id"] for p in _preds(out)] == ["t3", "t4", "t5"]
    m = json.loads((out / "metrics.json").read_text())
    assert m["split"] == "test" and m["n_trajectories"] == 3
    for split, ids in (("train", ["t0", "t1"]), ("val", ["t2"]), ("all", [f"t{i}" for i in range(6)])):
        assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(out),
                     "--no-progress", "--n-boot", "20", "--split", split, "--overwrite"]) == 0
        assert [p["id"] for p in _preds(out)] == ids


def test_split_on_data_without_splits_is_an_error(tmp_path, make_traj, capsys):
    data = tmp_path / "nosplit.jsonl"
    write_jsonl([make_traj(0, 4, 1)], data)
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(tmp_path / "o"),
                 "--no-progress", "--split", "test"]) == 2
    assert "has no splits" in capsys.readouterr().err
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(tmp_path / "o"),
                 "--no-progress", "--n-boot", "10"]) == 0   # whole data set, no error


def test_provenance_raw_completions_and_parse_failure_line(tmp_path, make_traj, capsys):
    data = _split_set(tmp_path, make_traj)
    out = tmp_path / "think"
    assert main(["eval", "--auditor", "test-thinker", "--data", str(data), "--out", str(out),
                 "--no-progress", "--n-boot", "20", "--max-new-tokens", "77", "--budget", "4000"]) == 0
    console = capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    prov = m["provenance"]
    assert prov["package_version"] and re.fullmatch(r"[0-9a-f]{40}", prov["git"]["commit"] or "0" * 40)
    assert prov["command"].startswith("aftraj eval ") and "--max-new-tokens 77" in prov["command"]
    assert "--budget 4000" in prov["command"] and "--auditor test-thinker" in prov["command"]
    assert prov["auditor_settings"]["max_new_tokens"] == 77 and prov["auditor_settings"]["budget"] == 4000
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", prov["date_utc"])
    assert prov["prompt_template_sha256"] == prompt_template_hash() and len(prov["prompt_template_sha256"]) == 64
    calls = [c for p in _preds(out) for c in p["trace"]]
    assert all(c["raw"].startswith("<think>") for c in calls)
    assert any(len(c["raw"]) > 400 and "</think>" in c["raw"] for c in calls)   # never cut
    n_fail = sum(c["parse_failure"] is not None for c in calls)
    assert n_fail and all(c["raw"] == "<think>unfinished" for c in calls if c["parse_failure"])
    rate = n_fail / len(calls)
    assert m["overall"]["parse_failure_rate"] == pytest.approx(rate)
    assert f"parse failures: {n_fail} ({100 * rate:.1f}%)" in console   # eval.report.call_line
    assert "Provenance" in (out / "report.md").read_text()


def test_plots_that_cannot_be_drawn_are_not_written(tmp_path, make_traj):
    data = tmp_path / "unsafe_only.jsonl"
    write_jsonl([make_traj(i, 5, 2) for i in range(4)], data)
    out = tmp_path / "o"
    out.mkdir()
    (out / "deployable.png").write_bytes(PNG)   # a stale plot from an earlier run
    assert main(["eval", "--auditor", "dummy:safe", "--data", str(data), "--out", str(out),
                 "--no-progress", "--n-boot", "20"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["plots"]["written"] == [] and set(m["plots"]["not_drawn"]) == {
        "deployable.png", "far_step_acc.png", "alarm_delay.png"}
    assert not list(out.glob("*.png"))
    md = (out / "report.md").read_text()
    assert "deployable.png not drawn: FAR cannot be measured" in md
    assert "alarm_delay.png not drawn: no unsafe trajectory raised an alarm" in md


def test_compare_writes_table_and_plot(tmp_path, make_traj):
    data = _split_set(tmp_path, make_traj)
    runs = []
    for spec in ("dummy:gold", "dummy:safe"):
        out = tmp_path / spec.replace(":", "-")
        assert main(["eval", "--auditor", spec, "--data", str(data), "--out", str(out),
                     "--no-progress", "--n-boot", "50", "--split", "all"]) == 0
        runs.append(out)
    cmp = tmp_path / "cmp"
    assert main(["eval", "compare", *map(str, runs), "--out", str(cmp)]) == 0
    rows = list(csv.DictReader(open(cmp / "compare.csv")))
    assert [r["run"] for r in rows] == ["dummy:gold", "dummy:safe"]
    gold = json.loads((runs[0] / "metrics.json").read_text())["overall"]
    assert float(rows[0]["exact_f1"]) == gold["exact_f1"] == 1.0
    assert float(rows[1]["step_acc"]) == 0.0 and rows[0]["n"] == "6"
    assert float(rows[0]["far_ci_low"]) == gold["far_ci"][0]
    md = (cmp / "compare.md").read_text()
    assert "| dummy:gold |" in md and "| dummy:safe |" in md and "100.00 %" in md
    assert "![compare](compare.png)" in md and "did not use the same data" not in md
    assert (cmp / "compare.png").read_bytes()[:8] == PNG and (cmp / "compare.png").stat().st_size > 5000


def test_compare_refuses_a_folder_without_metrics(tmp_path, capsys):
    # a user error: one line naming the folder, exit 2 (aftraj.cli's rule), never a traceback
    assert main(["eval", "compare", str(tmp_path), "--out", str(tmp_path / "c")]) == 2
    assert f"{tmp_path}: no metrics.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:    # `compare` is a subcommand: argparse names the choices
        main(["eval", "cmp", str(tmp_path), "--out", str(tmp_path / "c")])
    assert e.value.code == 2 and "invalid choice: 'cmp'" in capsys.readouterr().err
    assert main(["eval", "--out", str(tmp_path / "c")]) == 2
    assert "--auditor is required" in capsys.readouterr().err


def test_progress_bar_counts_auditor_calls(monkeypatch, make_traj):
    """The bar moves with every call (an hf walk of one long trajectory no longer sits at 0/N
    trajectories) and its total shrinks to the calls made when an ALARM ends a walk early."""

    from eval.auditors import get_auditor
    from eval.walker import WalkConfig, max_calls, walk

    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n, self.kw, self.postfix = total, 0, kw, None
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def set_postfix_str(self, s, refresh=True):
            self.postfix = s

        def refresh(self):
            pass

        def close(self):
            pass

    import aftraj.console

    monkeypatch.setattr(aftraj.console, "progress", lambda total, desc, unit, **kw: Bar(total, unit=unit, **kw))
    trajs = [make_traj(0, 6, 2), make_traj(1, 5, None), make_traj(2, 40, 30)]
    aud = get_auditor("dummy:gold")
    assert [max_calls(aud, t, WalkConfig()) for t in trajs] == [6, 5, 40]
    preds = walk(aud, trajs, WalkConfig(), progress=True)
    bar = bars[-1]
    assert bar.kw["unit"] == "call" and bar.n == sum(p["calls"] for p in preds) == 3 + 5 + 31
    assert bar.total == bar.n and bar.postfix == "3/3 trajectories"
    assert max_calls(get_auditor("heuristic:last-step"), trajs[2], WalkConfig()) == 1
