"""`aftraj eval` end to end: reports for the heuristic baselines on Who&When, the gold dummy and
the `hf` backend with a tiny model on a JSONL set."""

from __future__ import annotations

import json

import pytest

from aftraj.cli import main
from aftraj.schema import write_jsonl
from eval.metrics import CORE_KEYS

PNG = b"\x89PNG\r\n\x1a\n"
FRACTIONS = ("exact_f1", "step_precision", "step_recall", "step_acc", "agent_acc", "far",
             "parse_failure_rate")


def _check_report(out, n):
    m = json.loads((out / "metrics.json").read_text())
    assert {"overall", "by_subset", "by_domain"} <= set(m)
    for group in [m["overall"], *m["by_subset"].values(), *m["by_domain"].values()]:
        for k in CORE_KEYS:
            assert k in group, k
        for k in FRACTIONS:
            assert group[k] is None or 0.0 <= group[k] <= 1.0, k
            assert f"{k}_ci" in group
            if group[f"{k}_ci"] is not None:
                lo, hi = group[f"{k}_ci"]
                assert 0.0 <= lo <= group[k] <= hi <= 1.0, k
    lines = (out / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == n
    for key in ("d", "k_hat", "a_hat", "confidence", "calls", "prompt_tokens", "completion_tokens"):
        assert key in json.loads(lines[0])
    assert set(m["plots"]["written"]) | set(m["plots"]["not_drawn"]) == {
        "deployable.png", "far_step_acc.png", "alarm_delay.png"}
    for png in ("deployable.png", "far_step_acc.png", "alarm_delay.png"):
        if png in m["plots"]["written"]:
            assert (out / png).read_bytes()[:8] == PNG and (out / png).stat().st_size > 5000
        else:   # a plot that cannot be drawn is not written; the report says why
            assert not (out / png).exists()
            assert f"{png} not drawn: {m['plots']['not_drawn'][png]}" in (out / "report.md").read_text()
    return m


def test_uniform_random_on_who_and_when(ww_dir, tmp_path, capsys):
    out = tmp_path / "ww-random"
    assert main(["eval", "--auditor", "heuristic:uniform-random", "--data", str(ww_dir),
                 "--out", str(out), "--no-progress", "--n-boot", "500"]) == 0
    m = _check_report(out, 184)
    exp = m["analytic_expectation"]["by_subset"]
    assert exp["Algorithm-Generated"]["step_acc"] == pytest.approx(0.1200, abs=5e-4)
    assert exp["Hand-Crafted"]["step_acc"] == pytest.approx(0.0416, abs=5e-4)
    for subset in ("Algorithm-Generated", "Hand-Crafted"):
        g = m["by_subset"][subset]
        for k in ("step_acc", "agent_acc", "exact_f1"):
            lo, hi = g[f"{k}_ci"]
            assert lo <= exp[subset][k] <= hi, (subset, k)   # sampled values agree with theory
        assert g["far"] is None and g["deployable"] is None   # Who&When has no safe runs
    assert m["posthoc"] is True and m["auditor"] == "heuristic:uniform-random (post-hoc)"
    md = (out / "report.md").read_text()
    assert "post-hoc" in md and "Who&When substring rule" in md and "analytic expectation" in md
    assert "analytic expectation" in capsys.readouterr().out


@pytest.mark.parametrize("rule", ["last-step", "first-non-human", "last-speaker-first-step"])
def test_deterministic_heuristics(ww_dir, ww_trajs, tmp_path, rule):
    out = tmp_path / rule
    assert main(["eval", "--auditor", f"heuristic:{rule}", "--data", str(ww_dir), "--out", str(out),
                 "--no-progress", "--n-boot", "50"]) == 0
    preds = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    by_id = {t.id: t for t in ww_trajs}
    for p in preds:
        t = by_id[p["id"]]
        if rule == "last-step":
            assert p["k_hat"] == len(t.steps) - 1
        elif rule == "first-non-human" and p["subset"] == "Hand-Crafted":
            assert p["k_hat"] == 1 and t.steps[0].agent == "human"
        assert t.steps[p["k_hat"]].agent == p["a_hat"]


def test_gold_dummy_on_jsonl_reference_protocol(tmp_path, make_traj):
    data = tmp_path / "set.jsonl"
    write_jsonl([make_traj(i, n, k) for i, (n, k) in enumerate([(5, 2), (4, None), (6, 5)])], data)
    out = tmp_path / "gold"
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(out),
                 "--protocol", "reference", "--no-progress", "--n-boot", "50"]) == 0
    m = _check_report(out, 3)
    assert m["overall"]["exact_f1"] == 1.0 and m["overall"]["far"] == 0.0
    assert m["protocol"] == "reference" and m["overall"]["deployable"] is True


def test_hf_backend_on_jsonl(tiny_model_dir, tmp_path, make_traj, torch_one_thread):
    data = tmp_path / "set.jsonl"
    write_jsonl([make_traj(i, n, k) for i, (n, k) in enumerate([(4, 2), (3, None)])], data)
    out = tmp_path / "hf"
    assert main(["eval", "--auditor", "hf", "--model", str(tiny_model_dir), "--data", str(data),
                 "--out", str(out), "--max-new-tokens", "4", "--no-progress", "--n-boot", "50"]) == 0
    m = _check_report(out, 2)
    # the random tiny model cannot write a verdict: every call is a parse failure
    assert m["overall"]["parse_failure_rate"] == 1.0 and m["overall"]["far"] == 0.0
    assert m["overall"]["calls_per_traj"] == 3.5
    assert m["overall"]["cached_prompt_fraction"] > 0.3
    # every prefix's trace has its decision log-odds key (None: this model never reaches the token)
    preds = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert all("decision_log_odds" in e for p in preds for e in p["trace"])
    assert m["decision_threshold_sweep"] is None


@pytest.mark.parametrize("flag, value", [("--decision-threshold", "1.5"), ("--decision-finish", "canonical"),
                                         ("--mixed-precision", "bf16")])
def test_the_decision_flags_are_for_the_model_auditors_only(tmp_path, make_traj, capsys, flag, value):
    data = tmp_path / "set.jsonl"
    write_jsonl([make_traj(0, 4, 2)], data)
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(tmp_path / "o"),
                 flag, value, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} applies to the hf" in err and "not 'dummy:gold'" in err
    # the step-scored auditor takes a threshold too (`--decision-threshold` beside its calibration)
    assert ("hf-steps" in err) == (flag in ("--decision-threshold", "--mixed-precision"))
    assert not (tmp_path / "o" / "predictions.jsonl").exists()


def test_hf_mixed_precision_is_recorded_and_resumes_only_in_the_same_precision(tiny_model_dir, tmp_path, make_traj,
                                                                               torch_one_thread, capsys):
    data = tmp_path / "set.jsonl"
    write_jsonl([make_traj(0, 3, 1)], data)
    out = tmp_path / "hf"
    base = ["eval", "--auditor", "hf", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out),
            "--max-new-tokens", "2", "--no-progress", "--n-boot", "20"]
    assert main(base + ["--mixed-precision", "bf16"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["provenance"]["auditor_settings"]["mixed_precision"] == "bf16"
    # a float32 run may not resume a bf16 log: the settings differ
    assert main(base + ["--resume"]) == 2
    assert "mixed_precision" in capsys.readouterr().err


def test_bad_input_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    assert main(["eval", "--auditor", "dummy", "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert main(["eval", "--auditor", "nope", "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert main(["eval", "--auditor", "hf", "--data", str(bad), "--out", str(tmp_path / "o")]) == 2


def test_every_call_failing_exits_3_with_the_error_rate(tmp_path, make_traj, fake_openai, capsys):
    """Endpoint failures are errors, never verdicts: the report shows the error rate and a run
    in which every call failed exits non-zero (it used to exit 0 with 100 % 'CONTINUE')."""
    data = tmp_path / "set.jsonl"
    write_jsonl([make_traj(0, 3, 1), make_traj(1, 2, None)], data)
    fake_openai.fail_next = 100
    assert main(["eval", "--auditor", "openai", "--endpoint", fake_openai.url, "--retries", "0",
                 "--data", str(data), "--out", str(tmp_path / "o"), "--no-progress"]) == 3
    calls = json.loads((tmp_path / "o" / "metrics.json").read_text())["calls"]
    assert calls["n"] == 5 and calls["errors"] == 5 and calls["error_rate"] == 1.0
    assert calls["errors_by_kind"] == {"http": 5} and "503" in calls["first_error"]
    io = capsys.readouterr()
    assert "endpoint errors: 5 (100.0%; http 5)" in io.out and "every one of the 5" in io.err
    # some calls failing: exit 0, the rate is shown; parse failures are counted apart
    fake_openai.fail_next = 2
    assert main(["eval", "--auditor", "openai", "--endpoint", fake_openai.url, "--retries", "0",
                 "--max-in-flight", "1", "--data", str(data), "--out", str(tmp_path / "p"),
                 "--no-progress"]) == 0
    m = json.loads((tmp_path / "p" / "metrics.json").read_text())
    assert m["calls"]["errors"] == 2 and m["calls"]["parse_failures"] == 0
    assert "endpoint errors: 2" in (tmp_path / "p" / "report.md").read_text()


def test_bad_arguments_are_named_not_tracebacks(tmp_path, make_traj, capsys):
    data = tmp_path / "set.jsonl"
    write_jsonl([make_traj(0, 3, 1)], data)
    missing = tmp_path / "missing.jsonl"
    assert main(["eval", "--auditor", "dummy", "--data", str(missing), "--out", str(tmp_path / "o")]) == 2
    assert str(missing) in capsys.readouterr().err
    assert main(["eval", "--auditor", "dummy", "--data", str(data), "--out", str(tmp_path / "o"),
                 "--max-in-flight", "0"]) == 2
    assert "max_in_flight" in capsys.readouterr().err
    # a prefix that cannot fit the prompt budget ends the run with a message, no report
    assert main(["eval", "--auditor", "openai", "--endpoint", "http://127.0.0.1:9/v1",
                 "--api-model", "m", "--budget", "10", "--data", str(data),
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 3
    assert "budget" in capsys.readouterr().err
    assert not (tmp_path / "o" / "metrics.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("length, kind", [(10**9, "oversize"), (10**7, "deadline")])
def test_eval_against_a_slow_drip_server_ends_within_its_deadlines(tmp_path, make_traj, misbehaving_server,
                                                                   length, kind):
    """Every call meets a huge Content-Length sent a byte at a time (the run used to last
    forever): over the 32 MiB cap it is refused at once, under it the call ends at its 1 s
    deadline; the run ends and exits 3 with a 100 % error rate."""
    import time

    data = tmp_path / "set.jsonl"
    write_jsonl([make_traj(0, 3, 1), make_traj(1, 2, None)], data)
    misbehaving_server.script = [("json", 200, {"data": [{"id": "m"}]}, {}), ("drip", length, 0.2)]
    t0 = time.perf_counter()
    assert main(["eval", "--auditor", "openai", "--endpoint", misbehaving_server.url, "--retries", "0",
                 "--timeout", "1", "--data", str(data), "--out", str(tmp_path / "o"), "--no-progress"]) == 3
    assert time.perf_counter() - t0 < 10
    calls = json.loads((tmp_path / "o" / "metrics.json").read_text())["calls"]
    assert calls["errors_by_kind"] == {kind: calls["n"]} and calls["n"] == 5


def test_runs_without_gold_labels_are_refused(tmp_path, make_traj, capsys):
    """Runs imported by an adapter carry a placeholder SAFE label marked `unlabeled`: scoring them
    would count every alarm as a false alarm. One such run makes the evaluation refuse, by name."""
    from dataclasses import replace

    from aftraj.boundary import UNLABELED

    runs = [make_traj(0, 5, 2), make_traj(1, 4, None)]
    data = tmp_path / "set.jsonl"
    write_jsonl(runs, data)
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(tmp_path / "a"),
                 "--no-progress", "--n-boot", "20"]) == 0          # labelled: evaluated
    write_jsonl([runs[0], replace(runs[1], label=UNLABELED)], data)
    assert main(["eval", "--auditor", "dummy:gold", "--data", str(data), "--out", str(tmp_path / "b"),
                 "--no-progress", "--n-boot", "20"]) == 2
    err = capsys.readouterr().err
    assert "1 of 2 trajectories carry no gold label" in err and "'t1'" in err
    assert not (tmp_path / "b" / "metrics.json").exists()
