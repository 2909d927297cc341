"""lm-eval's conventions in `aftraj eval` (issue 47 item 5): the auditors listed from the registry
with their documented arguments, the floors' `train=PATH` in --help and in the error, `--model
builtin:NAME`, no silent overwrite of an output folder, a per-call cache that a resume reads
(a kill in the middle of the walks keeps the calls made), warnings for inert flags (and not
recording them as applied), `--sample N` above the data's size said, and `validation` for `val`."""

from __future__ import annotations

import json
import shutil

import pytest

from aftraj.cli import main
from aftraj.schema import write_jsonl


@pytest.fixture
def data(tmp_path, make_traj):
    path = tmp_path / "set.jsonl"
    write_jsonl([make_traj(i, n, k) for i, (n, k) in enumerate([(5, 2), (4, None), (6, 3), (4, None), (5, 1)])],
                path)
    return path


def _args(data, out, *extra):
    return ["eval", "--data", str(data), "--out", str(out), "--no-progress", "--n-boot", "10", *extra]


def test_list_auditors_comes_from_the_registry_with_arguments(capsys, monkeypatch):
    from eval.auditors import Auditor, _REGISTRY, available_auditors

    class Probe(Auditor):
        """A test auditor, listed because it is registered.

        - `fast`: a made-up argument."""

        name = "zz-probe"
        arguments = (("zz-probe:fast", "answers at once"),)

    available_auditors()                       # discovered first, then one more registered
    monkeypatch.setitem(_REGISTRY, "zz-probe", Probe)
    assert main(["eval", "--list-auditors"]) == 0
    out = capsys.readouterr().out
    for name in available_auditors():
        assert f"\n{name}  [" in "\n" + out, name
    assert "A test auditor, listed because it is registered." in out and "zz-probe:fast: answers at once" in out
    assert "heuristic:length,train=PATH" in out                    # the floors' syntax, from their docs
    assert "rules  [online; --layout/--parser do not apply]" in out
    assert "dummy:gold" in out and "openai:binary-search" in out and "hf:PATH" in out
    assert main(["eval", "--list-auditors", "floor"]) == 0
    whole = capsys.readouterr().out
    assert "train=PATH" in whole and "Content-blind floors" in whole
    assert main(["eval", "--list-auditors", "nope"]) == 2
    assert "unknown auditor 'nope'" in capsys.readouterr().err


def test_floor_train_path_in_help_and_in_the_error(data, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "heuristic:length,train=PATH" in " ".join(capsys.readouterr().out.split())
    assert main(_args(data, tmp_path / "f", "--auditor", "heuristic:length")) == 2   # no train split beside it
    err = capsys.readouterr().err
    assert "--auditor heuristic:length,train=PATH" in err and "--list-auditors heuristic" in err


def test_builtin_model_is_accepted(data, tmp_path, tiny_model_dir, monkeypatch, capsys, torch_one_thread):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_model_dir, cache / "models" / "tiny-qwen2")     # prepared already: nothing built
    monkeypatch.setenv("AGENTFORESIGHT_CACHE", str(cache))
    out = tmp_path / "b"
    assert main(_args(data, out, "--auditor", "hf", "--model", "builtin:tiny-qwen2", "--max-new-tokens", "2",
                      "--limit", "2")) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["model"] == str(cache / "models" / "tiny-qwen2")
    assert "--model builtin:tiny-qwen2" in m["provenance"]["command"]
    assert main(_args(data, tmp_path / "c", "--auditor", "hf", "--model", "builtin:nope")) == 2
    assert "--model builtin:nope: unknown model 'nope'" in capsys.readouterr().err


def test_an_existing_output_folder_is_not_overwritten(data, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(_args(data, out, "--auditor", "dummy:gold")) == 0
    before = (out / "metrics.json").read_text()
    assert main(_args(data, out, "--auditor", "dummy:safe")) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: already holds an earlier run's output (metrics.json" in err and "--resume" in err and "--overwrite" in err
    assert (out / "metrics.json").read_text() == before
    assert main(_args(data, out, "--auditor", "dummy:safe", "--resume", "--overwrite")) == 2
    assert main(_args(data, out, "--auditor", "nope", "--overwrite")) == 2     # a run that cannot start
    assert (out / "metrics.json").read_text() == before                         # leaves the old one
    assert main(_args(data, out, "--auditor", "dummy:safe", "--overwrite")) == 0
    assert json.loads((out / "metrics.json").read_text())["auditor"] == "dummy:safe"
    assert main(_args(data, out, "--auditor", "dummy:safe", "--resume")) == 0
    (tmp_path / "empty").mkdir()                                 # an empty folder is fine
    assert main(_args(data, tmp_path / "empty", "--auditor", "dummy:safe")) == 0


def test_a_kill_after_some_calls_keeps_them_and_resume_reads_them(data, tmp_path, monkeypatch):
    """Every walk is still in flight when the run dies (no walk finished, predictions.jsonl
    empty): the calls made are in calls.jsonl, and the resume asks only for the others."""
    from eval.auditors.dummy import DummyAuditor

    whole = tmp_path / "whole"
    assert main(_args(data, whole, "--auditor", "dummy:gold", "--all-prefixes")) == 0
    expected = [json.loads(x) for x in (whole / "predictions.jsonl").read_text().splitlines()]
    n_calls = sum(p["calls"] for p in expected)

    asked: list[tuple[str, int]] = []
    real = DummyAuditor.audit

    def dying(self, traj, t):
        if len(asked) == 7:
            raise KeyboardInterrupt
        asked.append((traj.id, t))
        return real(self, traj, t)

    monkeypatch.setattr(DummyAuditor, "audit", dying)
    out = tmp_path / "cut"
    assert main(_args(data, out, "--auditor", "dummy:gold", "--all-prefixes")) == 130
    assert (out / "predictions.jsonl").read_text() == ""          # no walk had ended
    cached = [json.loads(x) for x in (out / "calls.jsonl").read_text().splitlines()]
    assert sorted((c["id"], c["t"]) for c in cached) == sorted(asked) and len(cached) == 7

    again: list[tuple[str, int]] = []
    monkeypatch.setattr(DummyAuditor, "audit", lambda self, traj, t: again.append((traj.id, t)) or real(self, traj, t))
    assert main(_args(data, out, "--auditor", "dummy:gold", "--all-prefixes", "--resume")) == 0
    assert not set(again) & set(asked) and len(again) == n_calls - 7
    got = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    strip = lambda p: {k: v for k, v in p.items() if k != "latencies_s"}   # noqa: E731
    assert [strip(p) for p in got] == [strip(p) for p in expected]
    assert json.loads((out / "metrics.json").read_text())["cached_calls"] == 7


def test_the_cache_is_keyed_by_settings_and_prefix(make_traj, tmp_path):
    """An answer is replayed only for the same auditor settings and the same prefix content; the
    submit path (openai's) writes each answer as its call returns."""
    from concurrent.futures import ThreadPoolExecutor

    from aftraj.verdict import Verdict
    from eval.auditors import AuditResult, Auditor
    from eval.resume import CachedAuditor, CallCache

    pool = ThreadPoolExecutor(2)

    class Async(Auditor):
        name = "async-test"
        calls = 0

        def audit(self, traj, t):
            Async.calls += 1
            return AuditResult(Verdict("UNSAFE", step=t, agent=traj.steps[t].agent, reason="r"), t=t, raw="x")

        def submit(self, traj, t):
            return pool.submit(self.audit, traj, t)

    a, b = make_traj(0, 4, 2), make_traj(1, 4, 2)
    with CallCache(tmp_path, {"auditor": "x"}, keep=False) as cache:
        c = CachedAuditor(Async(), cache)
        first = c.submit(a, 2).result()
        pool.shutdown(wait=True)
        assert Async.calls == 1 and len((tmp_path / "calls.jsonl").read_text().splitlines()) == 1
        assert c.submit(a, 2).result() == first and Async.calls == 1          # replayed, not asked
        assert c.audit_batch([(b, 2)])[0].verdict.agent == b.steps[2].agent and Async.calls == 2  # other content
        failed = AuditResult(None, t=3, error="timeout", error_kind="deadline")
        cache.put(a, 3, failed)                                            # an endpoint failure: asked again
        assert cache.get(a, 3) is None
    kept = CallCache(tmp_path, {"auditor": "x"}, keep=True)
    assert kept.get(a, 2) == first and kept.get(a, 1) is None
    assert CallCache(tmp_path, {"auditor": "y"}, keep=True).get(a, 2) is None    # other settings
    (tmp_path / "calls.jsonl").write_text('{"key": "k", "result": {}}\nnot json\n{"key": "z", "result": {}}\n')
    from aftraj.errors import UsageError

    with pytest.raises(UsageError, match="calls.jsonl:2: not a cached call"):
        CallCache(tmp_path, {"auditor": "x"}, keep=True)
    (tmp_path / "calls.jsonl").write_text('{"key": "k", "result": {}}\n{"key": "z", "res')    # cut by a kill
    assert list(CallCache(tmp_path, {"auditor": "x"}, keep=True).answers) == ["k"]


def test_inert_flags_are_warned_and_not_recorded_as_applied(data, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(_args(data, out, "--auditor", "rules", "--layout", "reference", "--parser", "reference")) == 0
    err = capsys.readouterr().err
    assert "warning: --layout reference has no effect on the rules auditor" in err
    assert "warning: --parser reference has no effect on the rules auditor" in err
    m = json.loads((out / "metrics.json").read_text())
    assert m["layout"] is None and m["parser"] is None
    assert m["inert_flags"] == ["--layout reference", "--parser reference"]
    assert m["provenance"]["auditor_settings"]["layout"] is None
    md = (out / "report.md").read_text()
    assert "layout n/a, parser n/a" in md and "not applied (this auditor renders no prompt" in md
    assert main(_args(data, tmp_path / "q", "--auditor", "rules")) == 0            # defaults: nothing to say
    assert "no effect" not in capsys.readouterr().err


def test_sample_above_the_data_size_is_said(data, tmp_path, capsys):
    assert main(_args(data, tmp_path / "s", "--auditor", "dummy:gold", "--sample", "1000")) == 0
    err = capsys.readouterr().err
    assert f"warning: --sample 1000: {data} holds 5 trajectories, so all 5 are evaluated" in err
    m = json.loads((tmp_path / "s" / "metrics.json").read_text())
    assert m["n_trajectories"] == 5


def test_validation_is_the_val_split(tmp_path, make_traj, capsys):
    from dataclasses import replace

    runs = [replace(make_traj(i, 4, k), meta={"split": s})
            for i, (k, s) in enumerate([(1, "val"), (None, "val"), (2, "test"), (None, "train")])]
    data = tmp_path / "corpus.jsonl"
    write_jsonl(runs, data)
    for name in ("val", "validation"):
        out = tmp_path / name
        assert main(_args(data, out, "--auditor", "dummy:gold", "--split", name)) == 0
        m = json.loads((out / "metrics.json").read_text())
        assert m["split"] == "val" and m["n_trajectories"] == 2
    from eval.run import select_split

    assert [t.id for t in select_split(runs, "validation", "d")[0]] == ["t0", "t1"]
