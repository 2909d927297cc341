"""eval/run.py: the one evaluation `evaluate(EvalConfig) -> EvalResult` that `aftraj eval` maps its
flags onto, its user errors (UsageError, one line from the CLI), and the model card written only
with `--update-model-card`."""

from __future__ import annotations

import json

import pytest

from aftraj.cli import main
from aftraj.errors import UsageError
from aftraj.schema import write_jsonl
from eval.run import EvalConfig, evaluate


def _data(tmp_path, make_traj):
    data = tmp_path / "set.jsonl"
    write_jsonl([make_traj(i, n, k) for i, (n, k) in enumerate([(5, 2), (4, None), (6, 5)])], data)
    return data


def test_evaluate_writes_the_reports_and_returns_the_metrics(tmp_path, make_traj):
    data = _data(tmp_path, make_traj)
    res = evaluate(EvalConfig(auditor="dummy:gold", data=str(data), out=tmp_path / "o", n_boot=20,
                              progress=False, command="test"))
    assert res.metrics["overall"]["exact_f1"] == 1.0 and res.metrics["overall"]["n"] == 3
    assert json.loads((tmp_path / "o" / "metrics.json").read_text())["overall"] == res.metrics["overall"]
    assert [p["id"] for p in res.predictions] == ["t0", "t1", "t2"] and res.all_calls_failed is None
    assert res.metrics["provenance"]["command"] == "test"


@pytest.mark.parametrize("kw, match", [
    ({"auditor": "nope"}, r"^unknown auditor 'nope'; available: "),
    ({"sample": 0}, r"^--sample must be >= 1, got 0$"),
    ({"max_in_flight": 0}, r"max_in_flight"),
    ({"auc_start": -1}, r"^--auc-start must be >= 0"),
    ({"limit": 0}, r"^--limit must be >= 1, got 0$"),
    ({"resume": True, "overwrite": True}, r"^--resume and --overwrite exclude each other"),
    ({"protocol": "lenient"}, r"protocol"),
    ({"split": "val"}, r"^--split val: .* has no splits"),
])
def test_evaluate_raises_usage_errors_naming_the_flag(tmp_path, make_traj, kw, match):
    data = _data(tmp_path, make_traj)
    with pytest.raises(UsageError, match=match):   # the config's own checks fail as it is built
        evaluate(EvalConfig(**{"auditor": "dummy:gold", "data": str(data), "out": tmp_path / "o", **kw}))
    assert not (tmp_path / "o" / "metrics.json").exists()


def test_the_cli_prints_one_line_for_a_user_error(tmp_path, make_traj, capsys):
    data = _data(tmp_path, make_traj)
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(tmp_path / "o"),
                 "--sample", "0"]) == 2
    assert capsys.readouterr().err == "aftraj eval: --sample must be >= 1, got 0\n"
    assert main(["eval", "--data", str(data), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == "aftraj eval: --auditor is required\n"


def test_the_model_card_changes_only_with_the_flag(tmp_path, make_traj, capsys):
    from training.model_card import write_model_card

    data = _data(tmp_path, make_traj)
    ck = tmp_path / "ck"
    write_model_card(ck, stage="stage 1 (BPPO)", base_model="tiny", base_model_path=None, data="d",
                     config={}, steps=1)
    before = (ck / "README.md").read_text()
    argv = ["eval", "--auditor", "dummy:gold", "--model", str(ck), "--data", str(data), "--no-progress",
            "--n-boot", "10"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert (ck / "README.md").read_text() == before and "model card updated" not in capsys.readouterr().out
    assert main([*argv, "--out", str(tmp_path / "b"), "--update-model-card"]) == 0
    assert f"model card updated: {ck / 'README.md'}" in capsys.readouterr().out
    assert f"`{tmp_path / 'b'}`" in (ck / "README.md").read_text()
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(tmp_path / "c"),
                 "--update-model-card"]) == 2
    assert "--update-model-card needs --model" in capsys.readouterr().err


def test_compare_is_a_subcommand_with_its_own_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "compare", "--help"])
    assert e.value.code == 0 and "RUN_DIR" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:      # at least one run
        main(["eval", "compare", "--out", "x"])
    assert e.value.code == 2
