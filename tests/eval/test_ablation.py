"""The ablation driver (aftraj/drivers/ablation.py; its tests sit beside the eval fixtures they
use) in pieces: config validation, phases run once and resumed, the config guard, checkpoint
selection on val, the table and the goal lines. The whole pipeline runs end to end in
tests/test_demo_quick.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aftraj.errors import UsageError
from aftraj.drivers import ablation as ab
from aftraj.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["quick", "demo", "cpu"])
def test_shipped_configs_load(name):
    cfg = ab.load_config(REPO / "configs" / "ablation" / f"{name}.yaml")
    if cfg.model == "builtin:smollm2-135m":   # a canonical ALARM (~75 SmolLM2 tokens) is never cut
        assert cfg.max_new_tokens >= 128
    assert name == "quick" or cfg.model == "builtin:smollm2-135m"


@pytest.mark.parametrize("key,value,match", [
    ("heldout_sample", 0, "heldout_sample"), ("val_sample", -1, "val_sample"),
    ("stage1_steps", 0, "stage1_steps"), ("stage1_set", ["no_equals"], "stage1_set"),
    ("warmup_config", "configs/warmup/nope.yaml", "warmup_config"), ("colour", 1, "colour"),
    ("model_rows", [], "model_rows"), ("model_rows", ["stage 3"], "model_rows"),
    ("model_rows", ["stage 1", "stage 1"], "model_rows"), ("model_rows", "stage 1", "model_rows"),
    ("probe", "yes", "probe"), ("probe_mixed_precision", "fp16", "probe_mixed_precision")])
def test_bad_config_values_are_named(tmp_path, key, value, match):
    with pytest.raises(ConfigError, match=match):
        ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {key: value})


def test_model_rows_keep_the_table_order():
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                         {"model_rows": ["stage 1 + 2", "raw base"], "threshold_rows": []})
    assert cfg.model_rows == ["raw base", "stage 1 + 2"]
    # the CPU ablation's ladder (issue 21): the warmed base, stage 1, stage 1 + 2, in table order (the
    # every-prefix row gave way to the step-scored row of cpu-steps.yaml; no threshold row is left)
    cpu = ab.load_config(REPO / "configs" / "ablation" / "cpu.yaml")
    assert cpu.model_rows == ["warmed base", "stage 1", "stage 1 + 2"] and cpu.threshold_rows == []
    assert ab.load_config(REPO / "configs" / "ablation" / "cpu-steps.yaml").model_rows == ["step-scored"]
    assert ab.load_config(REPO / "configs" / "ablation" / "cpu.yaml", {"model_rows": list(reversed(ab.MODEL_ROWS))}
                          ).model_rows == list(ab.MODEL_ROWS)


def test_bounds_accept_their_edge(tmp_path):
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                         {"heldout_sample": 1, "val_sample": 0, "stage1_steps": 1})
    assert (cfg.heldout_sample, cfg.val_sample, cfg.stage1_steps) == (1, 0, 1)


def test_a_phase_runs_once_and_a_failure_leaves_no_marker(tmp_path, monkeypatch, capsys):
    r = ab.Runner(tmp_path)
    rec = r.run("ok", ["summary", "who_and_when"])
    assert rec["wall_s"] >= 0 and r.done("ok")["argv"] == ["aftraj", "summary", "who_and_when"]
    # the child's own peak memory (a Python process with the package loaded: tens of MiB, < 4 GiB)
    assert 0.01 < rec["peak_rss_gb"] < 8
    assert re.fullmatch(rf"\[ok\] \d+ s, peak memory {rec['peak_rss_gb']:.1f} GiB", capsys.readouterr().out.splitlines()[-1])
    r.echo = False
    assert "Who" in (tmp_path / "logs" / "ok.log").read_text() or (tmp_path / "logs" / "ok.log").stat().st_size > 0

    def boom(*a, **kw):
        raise AssertionError("a finished phase ran again")
    monkeypatch.setattr(subprocess, "Popen", boom)
    assert r.run("ok", ["summary", "who_and_when"]) == rec          # resumed: skipped
    monkeypatch.undo()
    with pytest.raises(ab.PhaseFailed, match="bad"):
        r.run("bad", ["summary", str(tmp_path / "missing.jsonl")])
    assert r.done("bad") is None


def test_half_written_output_is_cleared_before_a_phase_reruns(tmp_path):
    r = ab.Runner(tmp_path, echo=False)
    stale = tmp_path / "stage1"
    stale.mkdir()
    (stale / "junk").write_text("x")
    r.run("p", ["summary", "who_and_when"], clean=stale)
    assert not stale.exists()


def test_another_config_in_the_same_folder_is_refused(tmp_path):
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml")
    ab.Ablation(cfg, tmp_path, echo=False).check_config()
    ab.Ablation(cfg, tmp_path, echo=False).check_config()            # same config: fine
    other = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {"heldout_sample": 7})
    with pytest.raises(UsageError, match="heldout_sample"):
        ab.Ablation(other, tmp_path, echo=False).check_config()


def test_a_key_added_later_at_its_default_keeps_an_old_run_folder(tmp_path):
    """A run folder saved before `probe` existed resumes when the config holds probe at its
    default (true), and is refused when it does not."""
    import yaml

    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml")
    ab.Ablation(cfg, tmp_path, echo=False).check_config()
    saved = tmp_path / "ablation_config.yaml"
    old = yaml.safe_load(saved.read_text())
    del old["probe"]
    saved.write_text(yaml.safe_dump(old, sort_keys=False))
    ab.Ablation(cfg, tmp_path, echo=False).check_config()            # probe: true, the default
    off = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {"probe": False})
    with pytest.raises(UsageError, match="probe"):
        ab.Ablation(off, tmp_path, echo=False).check_config()


def _fake_run(root: Path, steps: list[int]) -> Path:
    run = root / "stage2"
    for s in steps:
        (run / f"checkpoint-{s}").mkdir(parents=True)
        (run / f"checkpoint-{s}" / "adapter_config.json").write_text("{}")
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    return run


def _fake_val(a: ab.Ablation, run: Path, tag: str, f1, far) -> None:
    d = a.out / "eval" / "val" / f"{run.name}-{tag}"
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps({"overall": {"exact_f1": f1, "far": far,
                                                            "parse_failure_rate": 0.0}}))
    a.r.marker(f"val stage 2 {tag}").write_text(json.dumps({"wall_s": 0.0}))


@pytest.mark.parametrize("scores,expect", [
    # (step2, step4, final) -> chosen
    (((0.2, 0.1), (0.4, 0.3), (0.3, 0.0)), "checkpoint-4"),     # best F1 wins despite a higher FAR
    (((0.4, 0.1), (0.4, 0.3), (0.1, 0.0)), "checkpoint-2"),     # tie on F1: lower FAR
    (((0.4, 0.1), (0.4, 0.1), (0.4, 0.1)), "final"),            # full tie: the later step (final)
    (((None, 0.1), (0.0, 0.2), (None, None)), "checkpoint-2"),  # no alarm at all scores as 0
])
def test_checkpoint_selection_rule(tmp_path, scores, expect):
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {"val_sample": 4})
    a = ab.Ablation(cfg, tmp_path, echo=False)
    run = _fake_run(tmp_path, [2, 4, 6])             # checkpoint-6 = final, merged: not a candidate
    assert [s for s, _ in ab.candidates(run)] == [2, 4, None]
    for tag, (f1, far) in zip(("step2", "step4", "final"), scores, strict=True):
        _fake_val(a, run, tag, f1, far)
    chosen = a.select("stage 2", run)
    assert chosen == run / expect
    sel = json.loads((run / "selection.json").read_text())
    assert sel["chosen"] == str(run / expect) and len(sel["scored"]) == 3
    assert a.select("stage 2", run) == chosen       # cached


def test_without_val_the_final_model_is_taken(tmp_path):
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {"val_sample": 0})
    a = ab.Ablation(cfg, tmp_path, echo=False)
    run = _fake_run(tmp_path, [2, 4])
    assert a.select("stage 2", run) == run / "final"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ab.PhaseFailed, match="no model"):
        a.select("stage 1", empty)


def _group(f1, far, n=10):
    g = {"n": n, "n_safe": n // 2, "n_unsafe": n - n // 2}
    for k, _, _ in ab.COLUMNS:
        g[k], g[f"{k}_ci"] = 0.5, [0.25, 0.75]
    g["exact_f1"], g["far"] = f1, far
    return g


def _summary(f1s: dict, fars: dict) -> dict:
    rows = {r: {"auditor": r, "overall": _group(f1s.get(r, 0.0), fars.get(r, 0.0)),
                "by_domain": {"math": _group(0.1, 0.2, 4), "coding": _group(0.2, 0.1, 6)},
                "calls": 10, "wall_s": 1.0} for r in (*ab.MODEL_ROWS, *ab.BASELINE_ROWS)}
    return {"name": "t", "config": {"seed": 0, "model": "m", "corpus_config": "c", "max_new_tokens": 128,
                                    "n_boot": 100}, "config_path": "configs/ablation/x.yaml",
            "measured_at": "2026-11-30T00:00:00+00:00", "machine": {"cpus": 2, "processor": "x86_64"},
            "wall_s_this_invocation": 60.0, "phases": [{"phase": "corpus", "wall_s": 30.0}],
            "corpus": {"trajectories": 10, "safe": 5, "unsafe": 5, "splits": {"test": 2}}, "warmup": {"steps": 3, "parse_rate": 1.0, "n": 8},
            "preferences": {"n_pairs": 4}, "selection": {"stage 1": {"chosen": "a", "scored": []}},
            "results": {"heldout": rows, "ww": rows},
            "samples": {"heldout": {"n": 10, "n_safe": 5, "n_unsafe": 5}, "ww": {"n": 10, "n_safe": 0, "n_unsafe": 10}}}


def test_goal_lines_check_both_sides():
    s = _summary({"warmed base": 0.2, "heuristic:position-prior": 0.1, "heuristic:length": 0.3,
                  "stage 1": 0.35, "stage 2": 0.25, "stage 1 + 2": 0.1},
                 {"stage 1": 0.10, "stage 2": 0.11, "stage 1 + 2": 0.0})
    lines = ab.goal_lines(s)
    assert ("stage 1: Exact-F1 35.0 vs warmed base 20.0 (above) and best floor heuristic:length 30.0 (above); "
            "FAR 10.0 % (≤ 20 %)") in lines[0]
    assert "(above) and best floor heuristic:length 30.0 (NOT above); FAR 11.0 % (≤ 20 %)" in lines[1]
    assert "(NOT above)" in lines[2] and "FAR 0.0 % (≤ 20 %)" in lines[2]
    s["results"]["heldout"]["stage 2"]["overall"]["far"] = 0.25       # the paper's deployable region: FAR ≤ 20 %
    assert "FAR 25.0 % (> 20 %)" in ab.goal_lines(s)[1]


def test_goal_lines_skip_rows_not_built():
    s = _summary({"warmed base": 0.2, "stage 1": 0.3}, {})
    for k in ("stage 2", "stage 1 + 2", "every prefix", "step-scored"):
        del s["results"]["heldout"][k]
    lines = ab.goal_lines(s)
    assert len(lines) == 1 and lines[0].startswith("- stage 1:")
    del s["results"]["heldout"]["warmed base"]       # not walked: the floors still decide
    assert "vs warmed base not walked and best floor heuristic:position-prior 0.0 (above)" in ab.goal_lines(s)[0]
    del s["results"]["heldout"]["stage 1"]
    assert ab.goal_lines(s) == ["- (no trained row was walked)"]


def test_goal_lines_check_the_parse_rate_of_every_walked_trained_row():
    s = _summary({"every prefix": 0.111, "heuristic:position-prior": 0.054, "heuristic:length": 0.011},
                 {"every prefix": 0.177})
    s["results"]["heldout"]["every prefix"]["overall"]["parse_failure_rate"] = 0.0
    s["results"]["heldout"]["stage 1"]["overall"]["parse_failure_rate"] = 0.06
    lines = {ln.split(":")[0]: ln for ln in ab.goal_lines(s)}
    assert lines["- every prefix"].endswith("best floor heuristic:position-prior 5.4 (above); FAR 17.7 % (≤ 20 %); "
                                            "parse rate 100.0 % (≥ 95 %)")
    assert lines["- stage 1"].endswith("parse rate 94.0 % (< 95 %)")


def test_markdown_holds_every_row_interval_and_domain():
    md = ab.render_markdown(_summary({"stage 1": 0.35}, {}))
    for row in (*ab.MODEL_ROWS, *ab.BASELINE_ROWS):
        assert f"| {row} | 10 |" in md
    assert "35.0 [25, 75]" in md and "domain math" in md and "| math" not in md
    assert "| corpus | 30 | – |" in md and "configs/ablation/x.yaml" in md   # marker without peak memory
    s = _summary({}, {})
    s["phases"] = [{"phase": "warmup", "wall_s": 150.4, "peak_rss_gb": 6.84}]
    assert "| warmup | 150 | 6.8 |" in ab.render_markdown(s)


def test_peak_memory_is_the_childs_own(tmp_path):
    """A child that holds ~300 MiB reports at least that more than one that holds nothing. ru_maxrss
    also counts the parent's image the child starts from, so the children are started from a
    small Python (as the ablation driver is), not from this pytest process."""
    code = "import sys; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096])"
    driver = ("import json, subprocess, sys; from aftraj.drivers.ablation import _run_child; "
              "run = lambda c: _run_child([sys.executable, '-c', c], cwd='.', env=None, stdout=subprocess.DEVNULL); "
              f"print(json.dumps([run({code!r}), run('pass'), run('raise SystemExit(3)')]))")
    out = subprocess.run([sys.executable, "-c", driver], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    (rc, big), (rc0, small), (rc3, _) = json.loads(out.stdout.strip().splitlines()[-1])
    assert rc == rc0 == 0 and rc3 == 3
    assert (big - small) / 2**10 >= 250

def test_probe_section_lists_every_probed_row_with_intervals():
    def g(share, ci, n=4):
        return {"n": n, "share": share, "ci": ci}

    def sub(acc, lo):
        return {"n": 4, "accuracy": acc, "accuracy_ci": None, "mean_log_odds": lo}

    s = _summary({}, {})
    s["probe"] = {
        "warmed base": {"n_runs": 6, "post_beats_twin": g(0.5, [0.25, 0.75]), "post_beats_pre": g(1.0, [1.0, 1.0]),
                        "post_beats_twin_all_pairs": g(0.6, [0.4, 0.8], 5), "kind_unmatched_pairs": 1,
                        "pre": sub(0.0, 1.5), "post": sub(1.0, 2.0), "twin": sub(0.0, 2.0),
                        "by_domain": {"math": g(0.5, None)}},
        "stage 1": {"n_runs": 6, "post_beats_twin": g(0.75, [0.5, 1.0]), "post_beats_pre": g(None, None, 0),
                    "pre": sub(1.0, -1.0), "post": sub(None, None), "twin": sub(0.5, 0.25),
                    "by_domain": {"math": g(0.75, [0.5, 1.0])}},
        "rule: last step not by environment": {"n_runs": 6, "post_beats_twin": g(0.5, [0.5, 0.5]),
                                               "post_beats_pre": g(0.75, None)}}
    s["linear_probe"] = {"warmed base": {"n_train_pairs": 10, "train_accuracy": 1.0, "post_beats_twin": g(0.625, None)}}
    md = ab.render_markdown(s)
    assert "## Learning ladder: decision-token probe on held-out families (6 unsafe runs, val + test)" in md
    # the headline on kind-matched pairs; every pair and the count left out for their kind beside it
    assert ("| warmed base | 4 | 50.0 [25, 75] | 60.0 [40, 80] (1) | 100.0 [100, 100] | 0.0 | 100.0 | 0.0 | "
            "+1.50 / +2.00 / +2.00 |") in md
    assert "| stage 1 | 4 | 75.0 [50, 100] | – (–) | – | 100.0 | – | 50.0 | -1.00 / – / +0.25 |" in md
    assert "| rule: last step not by environment | 4 | 50.0 [50, 50] | – (–) | 75.0 | – | – | – | – |" in md
    assert "| linear probe on warmed base (frozen; fit on 10 train pairs, train acc 100 %) | 4 | 62.5 |" in md
    assert "| stage 1 | 75.0 [50, 100] (n=4) |" in md                      # per domain
    assert "Learning ladder" not in ab.render_markdown(_summary({}, {}))     # no probe, no section


def test_probe_data_holds_the_held_out_runs_and_a_capped_sample_keeps_twins(make_traj, tmp_path):
    import dataclasses

    from aftraj.readers import load_trajectories
    from aftraj.schema import write_jsonl
    from aftraj.boundary import find_twins

    runs = []
    for i in range(6):
        u = make_traj(i, 6, 3)
        runs += [u] if i % 2 else [u, dataclasses.replace(make_traj(i, 6, None), id=f"twin{i}")]
    (tmp_path / "out" / "corpus").mkdir(parents=True)
    write_jsonl(runs[:4], tmp_path / "out" / "corpus" / "val.jsonl")
    write_jsonl(runs[4:], tmp_path / "out" / "corpus" / "test.jsonl")
    full = ab.Ablation(ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {"probe_runs": None}),
                       tmp_path / "out", echo=False).probe_data()
    assert [t.id for t in load_trajectories(full)] == [t.id for t in runs]
    (tmp_path / "out2").mkdir()
    shutil.copytree(tmp_path / "out" / "corpus", tmp_path / "out2" / "corpus")
    capped = load_trajectories(ab.Ablation(ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                                                          {"probe_runs": 2}), tmp_path / "out2",
                                           echo=False).probe_data())
    assert sum(t.label.unsafe for t in capped) == 2 and len(find_twins(capped)) == 2   # runs with twins first


def test_the_driver_runs_its_phases_from_the_repository_root():
    # phases are children with cwd=REPO and the configs' relative paths (configs/corpus/...);
    # the driver moved to aftraj/drivers/ once and REPO pointed at aftraj/
    from aftraj.drivers import ablation

    assert (ablation.REPO / "pyproject.toml").is_file()
    assert (ablation.REPO / "configs" / "corpus" / "demo-small.yaml").is_file()


def test_the_every_prefix_row_trains_from_its_source_and_walks_at_a_val_tuned_threshold(tmp_path, monkeypatch):
    # the phases' commands, not their work: the every-prefix row trains from the warmed base, its
    # threshold comes from a val walk of every prefix, and its test and Who&When walks use it
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                         {"model_rows": ["warmed base", "every prefix"], "threshold_rows": ["every prefix"],
                          "threshold_from": "val walk", "threshold_sample": 5, "probe": False,
                          "linear_probe_rows": []})
    a = ab.Ablation(cfg, tmp_path / "out", echo=False)
    calls = []

    def fake_run(name, argv, *, clean=None):
        calls.append((name, argv))
        if name == "tune threshold every prefix":
            f = Path(argv[argv.index("--out") + 1])
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps({"pick": {"threshold": 2.5}}))
        return {"phase": name, "wall_s": 0.0}
    monkeypatch.setattr(a.r, "run", fake_run)
    monkeypatch.setattr(a, "base_model", lambda: tmp_path / "base")
    monkeypatch.setattr(a, "write_report", lambda models, wall: models)
    models = a.run()
    assert models["every prefix"] == tmp_path / "out" / "prefixes" / "final"
    by = dict(calls)
    train = by["every prefix"]
    assert train[:2] == ["train", "prefixes"] and train[train.index("--model") + 1] == str(tmp_path / "out" / "warmup" / "final")
    assert "stage 1" not in by                                   # nothing trains that no row needs
    val = by["val walk every prefix"]
    assert "--all-prefixes" in val and val[val.index("--split") + 1] == "val" and val[val.index("--sample") + 1] == "5"
    for target in ("heldout", "ww"):
        walk = by[f"eval {target} every prefix"]
        assert walk[walk.index("--decision-threshold") + 1] == "2.5"
        assert "--decision-threshold" not in by[f"eval {target} warmed base"]   # greedy, as before
    assert [n for n, _ in calls].index("tune threshold every prefix") < [n for n, _ in calls].index("eval heldout every prefix")
    with pytest.raises(ConfigError, match="threshold_rows"):
        ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {"model_rows": ["warmed base"],
                                                                      "threshold_rows": ["every prefix"]})
    with pytest.raises(ConfigError, match="prefixes_from"):
        ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {"prefixes_from": "raw base"})
    # from stage 1, stage 1 is built first even when it is not a row
    cfg1 = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                          {"model_rows": ["every prefix"], "prefixes_from": "stage 1", "probe": False, "val_sample": 0,
                           "linear_probe_rows": []})
    b = ab.Ablation(cfg1, tmp_path / "out1", echo=False)
    calls.clear()
    monkeypatch.setattr(b.r, "run", fake_run)
    monkeypatch.setattr(b, "base_model", lambda: tmp_path / "base")
    monkeypatch.setattr(b, "write_report", lambda models, wall: models)
    monkeypatch.setattr(b, "select", lambda row, run: run / "final")
    b.run()
    by = dict(calls)
    assert "stage 1" in by and by["every prefix"][by["every prefix"].index("--model") + 1] == str(tmp_path / "out1" / "stage1" / "final")


def test_the_every_prefix_threshold_can_come_from_its_heldout_rows(tmp_path, monkeypatch):
    # threshold_from: heldout rows: no val walk; `aftraj eval tune-threshold` reads the every-prefix
    # run folder (its held-out val rows), and the walks use what it picks
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                         {"model_rows": ["warmed base", "every prefix"], "threshold_rows": ["every prefix"],
                          "threshold_from": "heldout rows", "probe": False, "linear_probe_rows": []})
    a = ab.Ablation(cfg, tmp_path / "out", echo=False)
    calls = []

    def fake_run(name, argv, *, clean=None):
        calls.append((name, argv))
        if name == "tune threshold every prefix":
            Path(argv[argv.index("--out") + 1]).write_text(json.dumps({"pick": {"threshold": 1.25}}))
        return {"phase": name, "wall_s": 0.0}
    monkeypatch.setattr(a.r, "run", fake_run)
    monkeypatch.setattr(a, "base_model", lambda: tmp_path / "base")
    monkeypatch.setattr(a, "write_report", lambda models, wall: models)
    a.run()
    by = dict(calls)
    assert "val walk every prefix" not in by
    assert by["tune threshold every prefix"][:3] == ["eval", "tune-threshold", str(tmp_path / "out" / "prefixes")]
    for target in ("heldout", "ww"):
        walk = by[f"eval {target} every prefix"]
        assert walk[walk.index("--decision-threshold") + 1] == "1.25"
        # quick.yaml finishes the every-prefix row's decisions canonically, not the others'
        assert walk[walk.index("--decision-finish") + 1] == "canonical"
        assert "--decision-finish" not in by[f"eval {target} warmed base"]
    with pytest.raises(ConfigError, match="canonical_finish_rows"):
        ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                       {"canonical_finish_rows": ["every prefix", "stage one"]})
    with pytest.raises(ConfigError, match="threshold_from"):
        ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {"threshold_from": "test walk"})
    with pytest.raises(ConfigError, match="threshold_from"):
        ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                       {"model_rows": ["stage 1", "every prefix"], "threshold_rows": ["stage 1"],
                        "threshold_from": "heldout rows"})


def test_probe_mixed_precision_reaches_every_probe_and_the_linear_probe(tmp_path, monkeypatch):
    # probe_mixed_precision reaches every probe; cpu.yaml and the default probe in float32
    def probe_calls(over):
        cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                             {"model_rows": ["warmed base"], "threshold_rows": [], "canonical_finish_rows": [], "val_sample": 0,
                              "linear_probe_rows": ["warmed base"], **over})
        a = ab.Ablation(cfg, tmp_path / f"out{len(over)}", echo=False)
        calls = []
        monkeypatch.setattr(a.r, "run", lambda name, argv, *, clean=None: calls.append((name, argv)) or {"phase": name})
        monkeypatch.setattr(a, "base_model", lambda: tmp_path / "base")
        monkeypatch.setattr(a, "probe_data", lambda: tmp_path / "heldout.jsonl")
        monkeypatch.setattr(a, "write_report", lambda models, wall: models)
        a.run()
        return {n: argv for n, argv in calls if n.startswith(("probe", "linear probe"))}

    on = probe_calls({"probe_mixed_precision": "auto"})
    assert set(on) == {"probe warmed base", "linear probe warmed base"}
    assert all(argv[argv.index("--mixed-precision") + 1] == "auto" for argv in on.values())
    assert not any("--mixed-precision" in argv for argv in probe_calls({}).values())
    assert ab.load_config(REPO / "configs" / "ablation" / "cpu.yaml").probe_mixed_precision == "no"   # float32: bf16 moves the ranking (cpu.yaml)


def test_ww_sample_0_walks_no_who_and_when(tmp_path, monkeypatch):
    # ww_sample: 0 (cpu.yaml: two Who&When runs said nothing and cost 12 min): no Who&When walk is
    # run and the report says the sample was not walked
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                         {"model_rows": ["warmed base"], "threshold_rows": [], "canonical_finish_rows": [],
                          "val_sample": 0, "probe": False, "linear_probe_rows": [], "ww_sample": 0})
    a = ab.Ablation(cfg, tmp_path / "out", echo=False)
    calls = []
    monkeypatch.setattr(a.r, "run", lambda name, argv, *, clean=None: calls.append(name) or {"phase": name})
    monkeypatch.setattr(a, "base_model", lambda: tmp_path / "base")
    monkeypatch.setattr(a, "probe_data", lambda: tmp_path / "heldout.jsonl")
    monkeypatch.setattr(a, "write_report", lambda models, wall: models)
    a.run()
    walks = [n for n in calls if n.startswith("eval ")]
    assert walks and all(n.startswith("eval heldout ") for n in walks)
    assert a.targets == ("heldout",)
    s = _summary({}, {})
    del s["results"]["ww"], s["samples"]["ww"]
    md = ab.render_markdown(s)
    assert "Who&When sample: not walked" in md and "## Held-out test sample" in md
    with pytest.raises(ConfigError, match="ww_sample"):
        ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {"ww_sample": -1})
    assert ab.load_config(REPO / "configs" / "ablation" / "cpu.yaml").ww_sample == 0


def test_walk_rows_walk_only_those_rows_and_the_report_names_the_others(tmp_path, monkeypatch):
    # walk_rows (cpu.yaml: stage 1; the free-text walks of the warmed base and
    # stage 1 + 2 scored 0 on 8 runs twice): the others are probed, not walked, and the report says so
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                         {"model_rows": ["warmed base", "stage 1"], "threshold_rows": [], "canonical_finish_rows": [],
                          "val_sample": 0, "linear_probe_rows": [], "ww_sample": 0, "walk_rows": ["stage 1", "stage 2"]})
    assert cfg.walk_rows == ["stage 1", "stage 2"]        # a row not built changes nothing
    a = ab.Ablation(cfg, tmp_path / "out", echo=False)
    calls, argvs = [], {}
    monkeypatch.setattr(a.r, "run", lambda name, argv, *, clean=None: calls.append(name) or argvs.update({name: argv}) or {"phase": name})
    monkeypatch.setattr(a, "base_model", lambda: tmp_path / "base")
    monkeypatch.setattr(a, "probe_data", lambda: tmp_path / "heldout.jsonl")
    monkeypatch.setattr(a, "select", lambda row, run: run / "final")
    monkeypatch.setattr(a, "write_report", lambda models, wall: models)
    models = a.run()
    assert [n for n in calls if n.startswith("probe ")] == ["probe warmed base, stage 1"]   # one phase, every row
    argv = argvs["probe warmed base, stage 1"]          # (the rows' shared bottom layers run once)
    assert argv[argv.index("--model") + 1] == str(tmp_path / "out" / "warmup" / "final")
    assert argv[argv.index("--out") + 1] == str(tmp_path / "out" / "probe" / "warmed_base")
    assert argv[argv.index("--also") + 1:argv.index("--also") + 3] == [str(tmp_path / "out" / "stage1" / "final"),
                                                                      str(tmp_path / "out" / "probe" / "stage_1")]
    assert [n for n in calls if n.startswith("eval ")] == ["eval heldout stage 1", *(f"eval heldout {r}" for r in ab.BASELINE_ROWS)]
    assert a.walked(models) == ["stage 1"]
    s = _summary({}, {})
    s["models"] = {"warmed base": "w", "stage 1": "s"}
    del s["results"]["heldout"]["warmed base"], s["results"]["ww"], s["samples"]["ww"]
    md = ab.render_markdown(s)
    assert "Not walked (`walk_rows`): warmed base;" in md and "| warmed base | 10 |" not in md.split("## Goal")[0]
    for bad, match in ((["stage 3"], "walk_rows"), ("stage 1", "walk_rows")):
        with pytest.raises(ConfigError, match=match):
            ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {"walk_rows": bad})
    with pytest.raises(ConfigError, match="threshold_rows"):       # a tuned threshold needs its walk
        ab.load_config(REPO / "configs" / "ablation" / "cpu.yaml",
                       {"model_rows": ["stage 1", "every prefix"], "threshold_rows": ["every prefix"]})
    cpu = ab.load_config(REPO / "configs" / "ablation" / "cpu.yaml")
    assert (cpu.walk_rows, cpu.heldout_sample) == (["stage 1"], 40)


def _fake_phases(a, tmp_path, monkeypatch, calls):
    def fake_run(name, argv, *, clean=None):
        calls.append((name, argv))
        return {"phase": name, "wall_s": 0.0}
    monkeypatch.setattr(a.r, "run", fake_run)
    monkeypatch.setattr(a, "base_model", lambda: tmp_path / "base")
    monkeypatch.setattr(a, "probe_data", lambda: tmp_path / "heldout.jsonl")
    monkeypatch.setattr(a, "bow_probe", lambda models: None)
    monkeypatch.setattr(a, "write_report", lambda models, wall: models)


def test_every_floor_is_walked_fit_on_train_and_tuned_on_val_and_test_readings_are_counted(tmp_path, monkeypatch):
    # issue 43 items 1 and 5: the five floors are rows of both samples, fit on train with thresholds
    # from val (never test); choices read train and val only; OUT/test_walks.json counts, per row,
    # every phase that read the test split, and a phase done before does not count again
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                         {"model_rows": ["warmed base", "stage 1"], "threshold_rows": [], "canonical_finish_rows": [],
                          "val_sample": 2, "linear_probe_rows": ["warmed base"], "ww_sample": 1})
    a = ab.Ablation(cfg, tmp_path / "out", echo=False)
    calls = []
    _fake_phases(a, tmp_path, monkeypatch, calls)
    monkeypatch.setattr(a, "select", lambda row, run: run / "final")
    a.run()
    by = dict(calls)
    corpus = tmp_path / "out" / "corpus"
    for target in ("heldout", "ww"):
        for row in ab.FLOOR_ROWS:
            spec = by[f"eval {target} {row}"][by[f"eval {target} {row}"].index("--auditor") + 1]
            assert spec.startswith(row)
            if row in ("heuristic:bow", "heuristic:structure"):
                assert f"train={corpus / 'train.jsonl'}" in spec and f"val={corpus / 'val.jsonl'}" in spec
            assert "test.jsonl" not in spec and "split" not in spec
    for name, argv in calls:       # only the walks of the held-out sample and the probes read test
        if "--split" in argv and argv[argv.index("--split") + 1] == "test":
            assert name.startswith("eval heldout "), name
    counts = json.loads((tmp_path / "out" / ab.TEST_WALKS).read_text())
    assert counts["stage 1"] == {"walks": 1, "probes": 1} and counts["heuristic:bow"] == {"walks": 1}
    assert counts["linear probe on warmed base"] == {"probes": 1}
    # a re-run skips the phases done (their markers) and counts nothing again
    for name, _ in calls:
        a.r.marker(name).write_text(json.dumps({"phase": name, "wall_s": 0.0}))
    monkeypatch.undo()
    b = ab.Ablation(cfg, tmp_path / "out", echo=False)
    _fake_phases(b, tmp_path, monkeypatch, [])
    monkeypatch.setattr(b, "select", lambda row, run: run / "final")
    monkeypatch.setattr(b.r, "run", lambda name, argv, *, clean=None: {"phase": name})
    b.run()
    assert json.loads((tmp_path / "out" / ab.TEST_WALKS).read_text()) == counts
    # the report prints the counts
    s = _summary({}, {})
    s["test_walks"] = {"stage 1": {"walks": 2, "probes": 1}}
    md = ab.render_markdown(s)
    assert "- stage 1: 2 walk(s) of test, 1 probe pass(es) over val + test" in md
    assert "- heuristic:bow: not counted (walked before the driver kept a count)" in md


def _write_preds(d: Path, rows: list[tuple[str, str, bool, int | None]]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "predictions.jsonl", "w") as f:
        for i, gold, alarmed, k in rows:
            f.write(json.dumps({"id": i, "gold": gold, "k_star": 2 if gold == "UNSAFE" else None, "a_star": "A",
                                "alarmed": alarmed, "d": k, "k_hat": k, "a_hat": "A", "n_steps": 5}) + "\n")


def test_model_rows_are_compared_with_the_best_floor_by_a_paired_bootstrap(tmp_path):
    ids = [(f"u{i}", "UNSAFE") for i in range(6)] + [(f"s{i}", "SAFE") for i in range(6)]
    model = [(i, g, g == "UNSAFE", 2 if g == "UNSAFE" else None) for i, g in ids]          # every k* found
    lexical = [(i, g, i in ("u0", "u1"), 2 if i in ("u0", "u1") else None) for i, g in ids]   # 2 of 6
    prior = [(i, g, True, 0) for i, g in ids]                                                    # never right
    dirs = {"stage 1": tmp_path / "s1", "heuristic:lexical": tmp_path / "lex", "heuristic:position-prior": tmp_path / "pp",
            "rules": tmp_path / "rules"}
    for row, rows in (("stage 1", model), ("heuristic:lexical", lexical), ("heuristic:position-prior", prior),
                      ("rules", prior)):
        _write_preds(dirs[row], rows)
    metrics = {"stage 1": {"overall": {"exact_f1": 1.0}}, "heuristic:lexical": {"overall": {"exact_f1": 0.5}},
               "heuristic:position-prior": {"overall": {"exact_f1": 0.0}}, "rules": {"overall": {"exact_f1": 0.9}}}
    vs = ab.vs_best_floor(dirs, metrics, n_boot=200, seed=0)
    assert vs["floor"] == "heuristic:lexical" and set(vs["rows"]) == {"stage 1"}     # rules is no floor
    d = vs["rows"]["stage 1"]["exact_f1"]
    assert d["diff"] == pytest.approx(1.0 - 2 * 2 / (2 + 6)) and d["ci"][0] > 0
    lines = ab.vs_floor_lines(vs)
    assert "heuristic:lexical" in lines[0] and lines[-1].startswith("| stage 1 | +50.0 [")
    s = _summary({"stage 1": 1.0, "heuristic:lexical": 0.5}, {})
    s["vs_best_floor"] = {"heldout": vs}
    assert "paired +50.0 [" in ab.goal_lines(s)[0] and "lower bound above 0" in ab.goal_lines(s)[0]
    assert "Paired differences against the best floor here, heuristic:lexical" in ab.render_markdown(s)


def test_ablation_floors_prints_the_floors_table_of_a_corpus(demo_build, tmp_path, capsys):
    from aftraj.cli import main

    out = tmp_path / "floors.json"
    assert main(["ablation", "floors", "--data", str(demo_build.out), "--ww", "who_and_when", "--n-boot", "50",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "## val" in text and "## test" in text and "Who&When" in text and "Step-Acc Hand-Crafted" in text
    assert "bag of words of step k*" in text
    res = json.loads(out.read_text())
    for split in ("val", "test", "ww"):
        assert tuple(res[split]) == ab.FLOOR_ROWS
    assert res["test"]["heuristic:bow"]["tuning"]["source"] == "val"
    assert main(["ablation", "floors", "--data", str(tmp_path / "nowhere")]) == 2
    assert main(["ablation", "--out", str(tmp_path / "x")]) == 2          # --config is still required


def test_the_step_scored_row_trains_on_its_source_walks_with_hf_steps_and_is_not_probed(tmp_path, monkeypatch):
    # the phases' commands: from the raw base nothing else trains (no warm-up), the walks are
    # `hf-steps` at the checkpoint's own calibration (no threshold phase), and the probe (which
    # reads the normal prompt) leaves the row out
    cfg = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                         {"model_rows": ["step-scored"], "threshold_rows": [], "canonical_finish_rows": [],
                          "linear_probe_rows": [], "steps_config": "configs/steps/tiny-cpu.yaml",
                          "steps_set": ["max_unsafe_runs=4"]})
    a = ab.Ablation(cfg, tmp_path / "out", echo=False)
    calls = []

    def fake_run(name, argv, *, clean=None):
        calls.append((name, argv))
        return {"phase": name, "wall_s": 0.0}
    monkeypatch.setattr(a.r, "run", fake_run)
    monkeypatch.setattr(a, "base_model", lambda: tmp_path / "base")
    monkeypatch.setattr(a, "write_report", lambda models, wall: models)
    models = a.run()
    assert models == {"step-scored": tmp_path / "out" / "steps" / "final"}
    by = dict(calls)
    assert "warmup" not in by and "stage 1" not in by and not any(n.startswith("probe") for n in by)
    train = by["step-scored"]
    assert train[:2] == ["train", "steps"] and train[train.index("--model") + 1] == str(tmp_path / "base")
    assert train[train.index("--config") + 1] == "configs/steps/tiny-cpu.yaml" and "max_unsafe_runs=4" in train
    for target in ("heldout", "ww"):
        walk = by[f"eval {target} step-scored"]
        assert walk[walk.index("--auditor") + 1] == "hf-steps" and "--decision-threshold" not in walk
        assert walk[walk.index("--model") + 1] == str(tmp_path / "out" / "steps" / "final")
    # from the warmed base the warm-up runs first
    cfg2 = ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                          {"model_rows": ["step-scored"], "steps_from": "warmed base", "threshold_rows": [],
                           "canonical_finish_rows": [], "linear_probe_rows": []})
    assert ab.Ablation(cfg2, tmp_path / "o2", echo=False).needs_warmup
    with pytest.raises(ConfigError, match="steps_from"):
        ab.load_config(REPO / "configs" / "ablation" / "quick.yaml", {"steps_from": "stage 2"})
    with pytest.raises(ConfigError, match="threshold_rows"):
        ab.load_config(REPO / "configs" / "ablation" / "quick.yaml",
                       {"model_rows": ["step-scored"], "threshold_rows": ["step-scored"], "canonical_finish_rows": []})


def test_markdown_says_how_each_kind_of_row_decides():
    s = _summary({}, {})
    s["config"].update(model_rows=["step-scored"], step_reason_tokens=64)
    md = ab.render_markdown(s)
    assert "the step-scored row by the threshold stored with its checkpoint (a reason of at most 64 tokens" in md
    assert "greedy" not in md                     # no generative row walked: no greedy budget claimed
    s["config"].update(model_rows=["stage 1", "step-scored"], step_reason_tokens=0)
    md = ab.render_markdown(s)
    assert f"generative rows greedy, {s['config']['max_new_tokens']} new tokens; the step-scored row" in md
    assert "(no reason generated)" in md
