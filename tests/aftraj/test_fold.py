"""The fold: determinism, incrementality (one at a time = all at once = random chunks),
snapshot/restore, an independent recount over the raw JSONL, and the `aftraj fold` CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from aftraj.cli import main as cli_main
from aftraj.events import parse_event
from aftraj.fold import Folder, RunState, fold, fold_events, fold_file
from aftraj.ledger import LineSplitter, decode_line

AGENTS = ("Manager", "search_agent", "ranker")
TOOLS = ("search", "rank", "read_document")


def gen_trace(seed: int, run: str = "r", n_turns: int = 60) -> list[dict]:
    """A seeded run with every event kind, errors, unknown/empty results, repeated usage ids."""
    rng = random.Random(seed)
    out: list[dict] = []

    def put(kind, agent, payload, parent=None, usage=None):
        eid = f"{run}/{len(out)}"
        out.append({"event_id": eid, "seq": len(out), "run_id": run, "kind": kind, "agent": agent,
                    "parent_id": parent, "ts": 1000.0 + len(out), "payload": payload, "usage": usage})
        return eid

    put("message", "user", {"content": f"task {seed}"})
    doc = 0
    for turn in range(n_turns):
        agent = rng.choice(AGENTS)
        uid = f"{run}/u{turn}"
        usage = {"input_tokens": rng.randint(1, 500), "output_tokens": rng.randint(1, 50),
                 "model": rng.choice(("m1", "m2")), "id": uid}
        r = rng.random()
        if r < 0.15:
            put("thinking", agent, {"content": "thinking " * rng.randint(1, 5)}, usage=usage)
            if rng.random() < 0.5:   # the framework repeats the usage record on the next event
                put("message", agent, {"content": "and so"}, usage=usage)
        elif r < 0.25:
            put("handoff", agent, {"content": "yours", "to": rng.choice(AGENTS)})
        else:
            put("message", agent, {"content": f"turn {turn} ✓ \"quoted\""}, usage=usage)
        tool = rng.choice(TOOLS)
        call = put("tool_call", agent, {"content": "", "tool": tool, "arguments": {"q": turn % 7}})
        x = rng.random()
        if x < 0.1:
            put("tool_result", "env", {"content": "fail", "tool": tool, "error": "timeout"}, parent=call)
        elif x < 0.15:
            put("error", "env", {"content": "", "error": "crashed", "retryable": False}, parent=call)
        elif x < 0.22:
            put("tool_result", "env", {"content": "?", "tool": tool}, parent=call)       # unknown ids
        elif x < 0.27:
            put("tool_result", "env", {"content": "", "tool": tool, "result_ids": []}, parent=call)
        elif x < 0.3:
            pass                                                                          # stays open
        else:
            k = rng.choice((0, 1, 3))
            got = [f"d{doc + i}" for i in range(4)]
            doc += k
            put("tool_result", "env", {"content": "docs", "tool": tool, "result_ids": got}, parent=call)
    put("final_answer", rng.choice(AGENTS), {"content": rng.choice(("42", ""))})
    put("termination", "system", {"reason": rng.choice(("completed", "step_limit", "cancelled",
                                                        "tool_error"))})
    return out


def write(path, records) -> bytes:
    data = b"".join(orjson.dumps(r) + b"\n" for r in records)
    path.write_bytes(data)
    return data


def fold_records(records, state=None) -> RunState:
    return fold_events((parse_event(r) for r in records), state)


@pytest.mark.parametrize("seed", range(5))
def test_deterministic_and_incremental(tmp_path, seed):
    recs = gen_trace(seed)
    whole = fold_records(recs)
    assert fold_records(recs).state_hash() == whole.state_hash()
    # one event at a time through fold()
    s = RunState("r")
    for r in recs:
        s = fold(s, parse_event(r))
    assert s.state_hash() == whole.state_hash()
    # through the ledger file reader
    write(tmp_path / "ev.jsonl", recs)
    folder, rep = fold_file(tmp_path / "ev.jsonl")
    assert rep.n_appended == len(recs) and rep.n_rejected == 0
    assert folder.states["r"].state_hash() == whole.state_hash()


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks_mid_record(seed):
    recs = gen_trace(seed + 10)
    data = b"".join(orjson.dumps(r) + b"\n" for r in recs)
    rng = random.Random(seed)
    splitter, s, pos = LineSplitter(), RunState("r"), 0
    while pos < len(data):
        n = rng.randint(1, 700)
        for line in splitter.feed(data[pos:pos + n]):
            fold(s, decode_line(line))
        pos += n
    for line in splitter.flush():
        fold(s, decode_line(line))
    assert s.state_hash() == fold_records(recs).state_hash()


@pytest.mark.parametrize("seed", range(5))
def test_snapshot_restore_then_continue(seed):
    recs = gen_trace(seed + 20)
    cut = random.Random(seed).randint(1, len(recs) - 1)
    head = fold_records(recs[:cut])
    snap = json.loads(json.dumps(head.snapshot()))          # through plain JSON
    restored = RunState.restore(snap)
    assert restored.state_hash() == head.state_hash()
    for r in recs[cut:]:
        fold(restored, parse_event(r))
    assert restored.state_hash() == fold_records(recs).state_hash()


def test_findings_survive_snapshot():
    recs = gen_trace(3)
    s = fold_records(recs)
    r = RunState.restore(s.snapshot())
    assert [f.to_dict() for f in r.findings] == [f.to_dict() for f in s.findings]


# --------------------------------------------------------------------------- independent recount

RECOUNT = Path(__file__).parent / "fixtures" / "fold" / "recount.py"


@pytest.mark.parametrize("seed", range(6))
def test_independent_recount(tmp_path, seed):
    """A separate short script (json module only) recounts the raw JSONL."""
    recs = gen_trace(seed + 30, n_turns=80)
    p = tmp_path / "ev.jsonl"
    write(p, recs)
    s = fold_file(p)[0].states["r"]
    out = subprocess.run([sys.executable, str(RECOUNT), str(p)], capture_output=True, text=True,
                         check=True, timeout=60)
    want = json.loads(out.stdout)
    assert s.turns_by_agent == want["turns"]
    assert s.events_by_agent == want["events"]
    assert s.calls_by_tool == want["calls"]
    assert (s.input_tokens, s.output_tokens) == (want["input_tokens"], want["output_tokens"])
    assert sum(want["calls"].values()) == len(s.tool_calls) > 0


def test_generated_traces_repeat_usage_records():
    assert sum(fold_records(gen_trace(seed + 30, n_turns=80)).usage_repeats for seed in range(6)) > 0


def test_many_runs_in_one_file_and_run_filter(tmp_path):
    recs = gen_trace(1, run="a") + gen_trace(2, run="b")
    random.Random(0).shuffle(recs)
    recs.sort(key=lambda r: (r["run_id"] != "a", r["seq"]))   # per-run order kept
    p = tmp_path / "ev.jsonl"
    write(p, recs)
    folder, rep = fold_file(p)
    assert set(folder.states) == {"a", "b"}
    assert folder.states["a"].state_hash() == fold_records(gen_trace(1, run="a")).state_hash()
    only_b, rep_b = fold_file(p, run="b")
    assert set(only_b.states) == {"b"} and rep_b.n_filtered == len(gen_trace(1, run="a"))


def test_resume_from_offset(tmp_path):
    recs = gen_trace(4)
    p = tmp_path / "ev.jsonl"
    write(p, recs[:50])
    folder = Folder()
    rep = folder.ingest_file(p)
    with open(p, "ab") as f:   # the ledger grows; resume where the last read stopped
        f.write(b"".join(orjson.dumps(r) + b"\n" for r in recs[50:]))
    rep2 = folder.ingest_file(p, rep.next_offset, first_line=rep.next_line)
    assert rep2.n_appended == len(recs) - 50 and rep2.n_duplicates == 0
    assert folder.states["r"].state_hash() == fold_records(recs).state_hash()
    rep3 = folder.ingest_file(p)            # re-reading everything is idempotent
    assert rep3.n_duplicates == len(recs) and rep3.n_appended == 0


# --------------------------------------------------------------------------- CLI

def test_cli_fold_json_and_text(tmp_path, capsys):
    recs = gen_trace(5)
    p = tmp_path / "ev.jsonl"
    write(p, recs)
    assert cli_main(["fold", str(p), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    run = out["runs"][0]
    assert run["run_id"] == "r" and run["events"] == len(recs)
    assert run["state_hash"] == fold_records(recs).state_hash()
    assert all({"kind", "event_ids", "policy_revision", "reason"} <= set(f) for f in run["findings"])
    assert cli_main(["fold", str(p), "--run", "r"]) == 0
    text = capsys.readouterr().out
    assert "== run r" in text and "findings" in text
    assert cli_main(["fold", str(p), "--run", "nope"]) == 2


def test_cli_fold_trajectories(ww_dir, capsys):
    assert cli_main(["fold", str(ww_dir), "--run", "whoandwhen/Hand-Crafted/1", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["run_id"] == "whoandwhen/Hand-Crafted/1" and run["termination"] == "completed"


def test_snapshot_is_a_copy():
    recs = gen_trace(8)
    s = fold_records(recs[:40])
    snap = s.snapshot()
    frozen = json.dumps(snap, sort_keys=True)
    for r in recs[40:]:
        fold(s, parse_event(r))
    assert json.dumps(snap, sort_keys=True) == frozen


def test_ingest_creates_no_reference_cycles(tmp_path):
    """ingest_file pauses the cyclic GC; that is only sound if folding leaves no cycles behind."""
    import gc

    recs = gen_trace(9) + gen_trace(10, run="other")
    p = tmp_path / "ev.jsonl"
    p.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs) + b"{bad\n" + b'{"kind": 1}\n')
    gc.collect()
    assert gc.isenabled()
    folder, rep = fold_file(p)
    assert gc.isenabled() and rep.n_rejected == 2
    observer = [s.snapshot() for s in folder.states.values()]
    del folder, rep, observer
    assert gc.collect() == 0


def test_cli_resumed_read_names_the_real_line(tmp_path, capsys):
    recs = gen_trace(6)
    p = tmp_path / "ev.jsonl"
    data = write(p, recs[:10])
    with open(p, "ab") as f:
        f.write(b"{bad\n" + b"".join(orjson.dumps(r) + b"\n" for r in recs[10:12]))
    assert cli_main(["fold", str(p), "--offset", str(len(data)), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ingest"]["appended"] == 2 and len(out["ingest"]["errors"]) == 1
    assert out["ingest"]["errors"][0].startswith(f"{p}:11: ")     # not line 1 of the resumed read
    assert out["ingest"]["next_line"] == 14
