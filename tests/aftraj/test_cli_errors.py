"""The CLI's one rule (issue 14): every error a user can cause is one line on stderr naming what
was wrong, and exit status 2; a traceback only for a bug, with a request to report it. A table
of bad inputs over every command; `--skip-invalid` loses no valid record."""

from __future__ import annotations

import json
import os
from pathlib import Path

import orjson
import pytest

from aftraj.cli import main
from aftraj.guard import BUG_HINT

REPO = Path(__file__).resolve().parents[2]


def _traj(i: int, **kw) -> dict:
    d = {"schema_version": 1, "id": f"t{i}", "family_id": f"f{i}", "domain": "math", "source": "test",
         "task": "add 2 and 2", "steps": [
             {"index": 0, "agent": "Solver", "kind": "message", "content": "2 + 2 = 4"},
             {"index": 1, "agent": "Verifier", "kind": "message", "content": "correct"}],
         "final_answer": "4", "termination": "completed", "outcome": "success",
         "label": {"verdict": "SAFE", "label_source": "verified_safe"}}
    d.update(kw)
    return d


def _event(i: int, **kw) -> dict:
    d = {"event_id": f"r/{i}", "seq": i, "run_id": "r", "kind": "message", "agent": "A",
         "payload": {"content": f"step {i}"}}
    d.update(kw)
    return d


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """A folder of good and bad inputs."""
    d = tmp_path_factory.mktemp("cli-bad")
    good = d / "good.jsonl"
    good.write_bytes(b"".join(orjson.dumps(_traj(i)) + b"\n" for i in range(3)))
    (d / "events.jsonl").write_bytes(b"".join(orjson.dumps(_event(i)) + b"\n" for i in range(4)))
    (d / "empty_dir").mkdir()
    (d / "empty.jsonl").write_bytes(b"")
    os.symlink(d / "loop_b", d / "loop_a")
    os.symlink(d / "loop_a", d / "loop_b")
    (d / "a_file").write_text("x")
    (d / "not.parquet").write_text("this is not parquet\n")
    pq = d / "pq_folder"
    pq.mkdir()
    (pq / "aftraj_safe.parquet").write_text("not parquet either")
    (pq / "aftraj_unsafe.parquet").write_text("not parquet either")
    (d / "garbage.jsonl").write_bytes(bytes(range(256)) * 4)
    (d / "bad_json.jsonl").write_text('{"id": "t0", \n')
    (d / "list_line.jsonl").write_text("[1, 2, 3]\n")
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    (d / "deep.jsonl").write_bytes(deep + b"\n")
    (d / "surrogate.jsonl").write_bytes(json.dumps(_traj(0, task="add \ud800 2")).encode() + b"\n")
    (d / "bad_policy.yaml").write_text("max_error_streak: [\n")
    (d / "wrong_policy.yaml").write_text("no_such_key: 3\n")
    (d / "bad_config.yaml").write_text("seed: [\n")
    (d / "wrong_config.yaml").write_text("seed: -1\nno_such_section: {}\n")
    (d / "existing_out" / "checkpoint-2").mkdir(parents=True)     # a previous run's checkpoint
    return d


def _cases(w: Path) -> dict[str, list[str]]:
    g, ev = str(w / "good.jsonl"), str(w / "events.jsonl")
    missing, loop, empty_dir, a_file = str(w / "missing.jsonl"), str(w / "loop_a"), str(w / "empty_dir"), str(w / "a_file")
    under_file = str(w / "a_file" / "out.jsonl")
    stage1 = str(REPO / "configs" / "stage1" / "tiny-cpu.yaml")
    corpus_cfg = str(REPO / "configs" / "corpus" / "demo-small.yaml")
    return {
        # missing paths, folders where files belong, symlink loops, non-data files
        "inspect-missing": ["inspect", missing],
        "inspect-empty-dir": ["inspect", empty_dir],
        "inspect-symlink-loop": ["inspect", loop],
        "inspect-empty-file": ["inspect", str(w / "empty.jsonl")],
        "inspect-binary-garbage": ["inspect", str(w / "garbage.jsonl")],
        "inspect-bad-json": ["inspect", str(w / "bad_json.jsonl")],
        "inspect-json-list-line": ["inspect", str(w / "list_line.jsonl")],
        "inspect-deep-nesting": ["inspect", str(w / "deep.jsonl")],
        "inspect-lone-surrogate": ["inspect", str(w / "surrogate.jsonl"), "--json"],
        "inspect-unknown-id": ["inspect", g, "--id", "nope"],
        "summary-missing": ["summary", missing],
        "summary-symlink-loop": ["summary", loop],
        "summary-empty-dir": ["summary", empty_dir],
        "summary-non-parquet-file": ["summary", str(w / "not.parquet")],
        "summary-non-parquet-folder": ["summary", str(w / "pq_folder")],
        "fold-missing": ["fold", missing],
        "fold-empty-dir": ["fold", empty_dir],
        "fold-symlink-loop": ["fold", loop],
        "fold-policy-missing": ["fold", ev, "--policy", str(w / "no_policy.yaml")],
        "fold-policy-invalid-yaml": ["fold", ev, "--policy", str(w / "bad_policy.yaml")],
        "fold-policy-unknown-key": ["fold", ev, "--policy", str(w / "wrong_policy.yaml")],
        "fold-policy-a-folder": ["fold", ev, "--policy", empty_dir],
        "fold-offset-past-end": ["fold", ev, "--offset", "999999"],
        "fold-offset-negative": ["fold", ev, "--offset", "-5"],
        "fold-unknown-run": ["fold", ev, "--run", "nope"],
        "convert-missing": ["convert", "--from", "jsonl", missing, "--out", str(w / "o1.jsonl")],
        "convert-folder-as-jsonl": ["convert", "--from", "jsonl", empty_dir, "--out", str(w / "o2.jsonl")],
        "convert-out-is-a-folder": ["convert", "--from", "jsonl", g, "--out", empty_dir],
        "convert-out-unwritable": ["convert", "--from", "jsonl", g, "--out", under_file],
        "convert-symlink-loop": ["convert", "--from", "jsonl", loop, "--out", str(w / "o3.jsonl")],
        "convert-non-parquet-file": ["convert", "--from", "aftraj-parquet", str(w / "not.parquet"),
                                     "--out", str(w / "o4.jsonl")],
        "convert-non-parquet-folder": ["convert", "--from", "aftraj-parquet", str(w / "pq_folder"),
                                       "--out", str(w / "o5.jsonl")],
        "convert-jsonl-as-whoandwhen": ["convert", "--from", "whoandwhen", g, "--out", str(w / "o6.jsonl")],
        "convert-bad-record": ["convert", "--from", "jsonl", str(w / "bad_json.jsonl"), "--out", str(w / "o7.jsonl")],
        "convert-lone-surrogate": ["convert", "--from", "jsonl", str(w / "surrogate.jsonl"), "--out", str(w / "o8.jsonl")],
        "inspect-prompt-out-of-range": ["inspect", g, "--prompt", "99"],
        "inspect-prompt-negative": ["inspect", g, "--prompt", "-1"],
        "inspect-budget-too-small": ["inspect", g, "--prompt", "1", "--budget", "5"],
        "inspect-budget-zero": ["inspect", g, "--prompt", "1", "--budget", "0"],
        "inspect-reference-answer-without-one": ["inspect", g, "--prompt", "1", "--reference-answer"],
        "eval-data-missing": ["eval", "--auditor", "dummy:gold", "--data", missing, "--out", str(w / "e1")],
        "eval-data-symlink-loop": ["eval", "--auditor", "dummy:gold", "--data", loop, "--out", str(w / "e2")],
        "eval-data-empty-dir": ["eval", "--auditor", "dummy:gold", "--data", empty_dir, "--out", str(w / "e3")],
        "eval-out-is-a-file": ["eval", "--auditor", "dummy:gold", "--data", g, "--out", a_file, "--n-boot", "10", "--no-progress"],
        "eval-out-unwritable": ["eval", "--auditor", "dummy:gold", "--data", g, "--out", under_file, "--n-boot", "10", "--no-progress"],
        "eval-unknown-auditor": ["eval", "--auditor", "nope", "--data", g, "--out", str(w / "e4")],
        "eval-hf-without-model": ["eval", "--auditor", "hf", "--data", g, "--out", str(w / "e5")],
        "eval-limit-zero": ["eval", "--auditor", "dummy:gold", "--data", g, "--out", str(w / "e6"), "--limit", "0"],
        "eval-bad-records": ["eval", "--auditor", "dummy:gold", "--data", str(w / "bad_json.jsonl"), "--out", str(w / "e8")],
        "corpus-build-config-missing": ["corpus", "build", "--config", str(w / "none.yaml"), "--out", str(w / "c1")],
        "corpus-build-config-a-folder": ["corpus", "build", "--config", empty_dir, "--out", str(w / "c2")],
        "corpus-build-config-invalid-yaml": ["corpus", "build", "--config", str(w / "bad_config.yaml"), "--out", str(w / "c3")],
        "corpus-build-config-wrong-values": ["corpus", "build", "--config", str(w / "wrong_config.yaml"), "--out", str(w / "c4")],
        "corpus-build-out-is-a-file": ["corpus", "build", "--config", corpus_cfg, "--out", a_file, "--no-progress"],
        "corpus-build-out-under-a-file": ["corpus", "build", "--config", corpus_cfg, "--out", under_file, "--no-progress"],
        "corpus-verify-corpus-missing": ["corpus", "verify", "--config", corpus_cfg, "--corpus", missing],
        "train-stage1-config-missing": ["train", "stage1", "--config", str(w / "none.yaml")],
        "train-stage1-data-missing": ["train", "stage1", "--config", stage1, "--data", missing,
                                      "--out", str(w / "s1")],
        "train-stage1-into-existing-folder": ["train", "stage1", "--config", stage1, "--data", g,
                                              "--out", str(w / "existing_out"), "--no-progress"],
        "train-stage1-no-unsafe-trajectory": ["train", "stage1", "--config", stage1, "--data", g,
                                              "--out", str(w / "s2"), "--no-progress"],
        "train-stage1-set-without-value": ["train", "stage1", "--config", stage1, "--set", "beta"],
        "train-stage1-set-bad-yaml": ["train", "stage1", "--config", stage1, "--set", "beta=[1"],
        "train-stage1-config-bad-value": ["train", "stage1", "--config", stage1, "--set", "beta=-1"],
        "models-prepare-out-is-a-file": ["models", "prepare", "tiny-qwen2", "--out", a_file],
    }


CASE_NAMES = sorted(_cases(Path("/x")))


@pytest.mark.parametrize("case", CASE_NAMES)
def test_a_bad_input_is_one_line_and_exit_2(case, w, capsys):
    argv = _cases(w)[case]
    rc = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and BUG_HINT not in err, err[-3000:]
    assert rc == 2, (rc, err[-2000:])
    # progress bars (\r) and library log lines may come before it; the error is one line, last
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
    mine = [ln for ln in lines if ln.startswith("aftraj ")]
    assert len(mine) == 1 and lines[-1] == mine[0], err[-2000:]


def test_the_table_is_large_enough():
    assert len(CASE_NAMES) >= 40


def test_a_bug_gets_a_traceback_and_a_request_to_report_it(monkeypatch, capsys, w):
    import aftraj.commands.summary as summary

    def broken(args):
        raise KeyError("internal")

    monkeypatch.setattr(summary, "run", broken)
    rc = main(["summary", str(w / "good.jsonl")])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" in err and BUG_HINT in err


def test_skip_invalid_keeps_every_valid_record(tmp_path, capsys):
    """Good records between bad ones of every kind all reach the output."""
    bad = [b'{"id": "x", \n', b"[1, 2]\n", b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"\n",
           json.dumps(_traj(90, task="add \ud800")).encode() + b"\n",
           json.dumps(_traj(91, steps="not a list")).encode() + b"\n",
           json.dumps(_traj(92, label={"verdict": "MAYBE"})).encode() + b"\n",
           bytes(range(128, 256)) + b"\n"]
    lines, n_good = [], 0
    for i, b in enumerate(bad):
        lines += [orjson.dumps(_traj(i)) + b"\n", b]
        n_good += 1
    lines.append(orjson.dumps(_traj(99)) + b"\n")
    n_good += 1
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b"".join(lines))
    out = tmp_path / "out.jsonl"
    rc = main(["convert", "--from", "jsonl", str(src), "--out", str(out), "--skip-invalid"])
    err = capsys.readouterr().err
    assert rc == 0 and "Traceback" not in err
    ids = [json.loads(ln)["id"] for ln in out.read_text().splitlines()]
    assert ids == [f"t{i}" for i in range(len(bad))] + ["t99"] and len(ids) == n_good
    assert err.count("skipped:") == len(bad)


def test_fold_names_bad_event_fields_and_folds_the_rest(tmp_path, capsys):
    """In a ledger, a bad record is reported (file, line, field) and the others are folded:
    the fold's contract, so the exit status is 0."""
    bad = [_event(0, usage=[1, 2]), _event(1, usage={"input_tokens": "many"}),
           _event(2, payload={"content": "x", "logprobs": "high"}), _event(3, payload="text"),
           _event(4, seq="four"), _event(5, kind="telepathy")]
    good = [_event(10 + i) for i in range(3)]
    p = tmp_path / "ev.jsonl"
    p.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in bad + good))
    assert main(["fold", str(p)]) == 0
    out, err = capsys.readouterr()
    rejected = [ln for ln in err.splitlines() if ln.startswith("rejected:")]
    assert len(rejected) == len(bad) and "Traceback" not in err
    assert all(f"{p}:{i + 1}: field " in ln for i, ln in enumerate(rejected)), rejected
    assert "3 folded" in out
