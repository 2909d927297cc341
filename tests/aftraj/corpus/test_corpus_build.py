"""The pipeline end to end on configs/corpus/demo-small.yaml: counts, the independent label
check (every unsafe trajectory, >= 140), family splits, every export format, stats, byte-identical
rebuilds, the CLI. The 2k build (~4 min on 2 busy cores) has the marker `heavy`, outside the
default suite: `bash scripts/test.sh -m heavy tests/aftraj/corpus/test_corpus_build.py` (and
benchmarks/corpus_build.py)."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from aftraj.corpus.build import attach_provenance, build_corpus, load_tasks, precompute_tests, read_provenance
from aftraj.corpus.config import ERROR_TYPES, DomainCounts, load_corpus_config
from aftraj.corpus.policies import ScriptedPolicy
from aftraj.corpus.rollout import Turn, replay_with
from aftraj.corpus.templates import template_for
from aftraj.corpus.verify import _safe_turn
from aftraj.readers import load_trajectories
from aftraj.released import iter_aftraj_parquet
from aftraj.schema import from_hf_dataset, read_jsonl
from eval.floors import floor_scores

REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- independent label check

def verify_labels(trajs, cfg, seed, sb):
    """Replay the scripted policy from each unsafe trajectory as stored (not from the build's
    records): (a) the stored run reproduces and fails; (b) the decisive turn restored to its
    safe version succeeds; (c) restoring any single earlier turn leaves it failing. `sb`: a
    sandbox of the test's own (not the build's); its cache may be warm from an earlier check, as
    a sample's result depends only on its code, its tests and the limits."""
    tasks = {t.id: t for t in load_tasks(cfg, seed, sb)}
    precompute_tests([tasks[f] for f in sorted({t.family_id for t in trajs if t.label.unsafe})], sb)
    policy = ScriptedPolicy(cfg.slips)
    problems, n = [], 0
    for tr in trajs:
        if not tr.label.unsafe:
            continue
        n += 1
        task, tpl = tasks[tr.family_id], template_for(tr.domain)
        turns = [Turn.from_step(s) for s in tr.steps]
        fixed = {k: turns[k] for k in tr.meta["fixed_steps"]}
        # play(j, turn): turns[:j], `turn` at j, the fixed turns after j, the policy for the rest
        play = functools.partial(replay_with, tpl, task, policy, turns, seed=seed, sandbox=sb, fixed=fixed)
        safe_version = functools.partial(_safe_turn, tpl, task, turns, policy=policy, sandbox=sb, seed=seed)
        again = play(1, turns[1])
        if len(again.turns) != len(turns) or not all(t.same_as(u) for t, u in zip(again.turns, turns, strict=True)) \
                or again.success:
            problems.append((tr.id, "stored run does not reproduce"))
            continue
        k = tr.label.decisive_step
        if tr.steps[k].agent != tr.label.decisive_agent:
            problems.append((tr.id, "agent"))
        if not play(k, safe_version(k)).success:
            problems.append((tr.id, f"restoring step {k} does not fix the run"))
        for j in range(1, k):
            if turns[j].kind != "tool_result" and play(j, safe_version(j)).success:
                problems.append((tr.id, f"restoring earlier step {j} fixes the run"))
    return n, problems


def _with_provenance(folder):
    prov = read_provenance(folder / "provenance.jsonl")
    return [attach_provenance(t, prov[t.id]) for t in load_trajectories(folder / "corpus.jsonl")]


@pytest.mark.slow
def test_labels_pass_the_independent_replay_check(demo_build, demo_cfg, sandbox):
    trajs = _with_provenance(demo_build.out)
    n, problems = verify_labels(trajs, demo_cfg, demo_cfg.seed, sandbox)
    assert n == sum(t.label.unsafe for t in trajs) >= 140
    assert problems == []


def test_the_check_catches_a_wrong_label(demo_build, demo_cfg, sandbox):
    trajs = _with_provenance(demo_build.out)
    unsafe = [t for t in trajs if t.label.unsafe and t.label.decisive_step >= 3][:20]
    moved = [replace(t, label=replace(t.label, decisive_step=t.label.decisive_step - 1,
                                      decisive_agent=t.steps[t.label.decisive_step - 1].agent)) for t in unsafe]
    n, problems = verify_labels(moved, demo_cfg, demo_cfg.seed, sandbox)
    assert n == 20 and len({p[0] for p in problems}) == 20


# --------------------------------------------------------------------------- contents

def test_counts_domains_sources(demo_build, demo_cfg, sandbox):
    trajs = [demo_build.full(t) for t in demo_build.trajectories]
    assert 250 <= len(trajs) <= 700          # a few hundred: the demo trains on its whole train split
    doms = Counter(t.domain for t in trajs)
    assert set(doms) == {"math", "coding", "agentic"} and min(doms.values()) >= 60
    safe = sum(not t.label.unsafe for t in trajs)
    assert 0.4 <= safe / len(trajs) <= 0.6
    srcs = Counter(t.label.label_source for t in trajs)
    assert srcs["verified_safe"] == safe and srcs["injected"] > 0 and srcs["diagnosed"] > 0
    for t in trajs:
        assert len(t.steps) <= 40 and t.meta["seed"] == 0 and t.meta["backend"] == "scripted" and t.meta["model"]
        assert t.outcome == ("failure" if t.label.unsafe else "success")
        if t.label.label_source == "injected":
            assert t.label.provenance["injection_type"] in ERROR_TYPES
            assert t.meta["fixed_steps"] == [t.label.decisive_step]
        if t.label.label_source == "diagnosed":
            assert t.label.provenance["diagnosis"]["candidates"]
    types = Counter(t.label.provenance["injection_type"] for t in trajs if t.label.label_source == "injected")
    # premature terminations are kept at a quarter rate and make short runs, which length matching
    # thins: the small demo may hold none (the 2k build holds every type)
    assert set(types) >= set(ERROR_TYPES) - {"premature_termination"}
    # coding draws real tasks from HumanEval, each problem in one family only
    he = Counter(f["task_id"] for t in load_tasks(demo_cfg, 0, sandbox) if t.domain == "coding"
                 for f in t.data["functions"] if f["source"] == "humaneval")
    assert len(he) >= 50 and max(he.values()) == 1


def test_splits_are_by_family_and_stratified(demo_build, demo_cfg):
    out = demo_build.out
    fam = {}
    for s in ("train", "val", "test"):
        for t in read_jsonl(out / f"{s}.jsonl"):
            assert fam.setdefault(t.family_id, s) == s, f"family {t.family_id} in two splits"
            assert t.meta["split"] == s
    assert len(fam) == len({t.family_id for t in demo_build.trajectories})
    for d in ("math", "coding", "agentic"):
        fams = {t.family_id for t in demo_build.trajectories if t.domain == d}
        share = Counter(fam[f] for f in fams)
        for split in ("train", "val", "test"):      # each domain's families near the configured fractions
            assert abs(share[split] / len(fams) - getattr(demo_cfg.splits, split)) <= 0.05, (d, split, share)


def test_exports_read_back(demo_build):
    out = demo_build.out
    jsonl = load_trajectories(out / "corpus.jsonl")
    assert [t.id for t in jsonl] == [t.id for t in demo_build.trajectories]
    assert jsonl == demo_build.trajectories
    assert load_trajectories(out) == jsonl   # the folder reads as our JSONL, not the lossy parquet
    import datasets

    hub = datasets.load_dataset(str(out), cache_dir=str(out.parent / "hf-cache"))
    assert sorted(t.id for s in hub for t in from_hf_dataset(hub[s])) == sorted(t.id for t in jsonl)
    assert sorted(from_hf_dataset(hub["test"]), key=lambda t: t.id) == \
        sorted((t for t in jsonl if t.meta["split"] == "test"), key=lambda t: t.id)
    by_id = {t.id: t for t in jsonl}
    back = list(iter_aftraj_parquet(out))
    assert len(back) == len(jsonl)
    test_ids = {i for ids in json.loads((out / "splits_test.json").read_text()).values() for i in ids}
    for p in back:
        t = by_id[p.id]
        assert p.family_id == t.family_id and (p.domain, p.task, p.reference_answer) == \
            (t.domain, t.task, t.reference_answer)
        assert (p.label.verdict, p.label.decisive_step, p.label.decisive_agent, p.label.label_source, p.label.reason) == \
            (t.label.verdict, t.label.decisive_step, t.label.decisive_agent, t.label.label_source, t.label.reason)
        assert len(p.steps) == len(t.steps)
        for a, b in zip(p.steps, t.steps, strict=True):
            assert (a.agent, a.content, a.tool, a.arguments) == (b.agent, b.content, b.tool, b.arguments if b.kind == "tool_call" else None)
            assert a.kind == (b.kind if b.kind != "final_answer" else "message")
        assert (p.meta["split"] == "test") == (t.id in test_ids) == (t.meta["split"] == "test")
        assert p.meta["split"] == t.meta["split"]


def test_stats_files(demo_build):
    s = json.loads((demo_build.out / "stats.json").read_text())
    assert s == json.loads(json.dumps(demo_build.stats))
    for d in ("math", "coding", "agentic"):
        p = s["per_domain"][d]
        assert p["safe"] + p["unsafe"] == p["trajectories"]
        assert set(p["rejections_by_predicate"]) == {"outcome_equivalence", "valid_tool_use", "subgoal_coherence",
                                                     "slip_free"}
        assert p["decisive_step"]["distinct"] == len(p["decisive_step"]["counts"]) >= 10
        assert sum(p["decisive_step"]["relative_by_10pct"].values()) == p["unsafe"]
        assert 0 <= p["lengths"]["ks_safe_vs_unsafe"] <= 0.25
        assert sum(p["slip_rejections_by_type"].values()) == p["rejections_by_predicate"]["slip_free"]
        assert p["decisive_step"]["histogram_by_5"] and p["diagnosis"]["failed_rollouts"] > 0
    inj = s["total"]["injection"]
    assert set(inj) == set(ERROR_TYPES) and all(0 <= x["recovery_rate"] <= 1 for x in inj.values())
    diag = s["total"]["diagnosis"]
    for key in ("proposer_verifier_agreement", "verifier_replay_agreement", "causality_replay_agreement"):
        assert 0 <= diag[key] <= 1
    from eval.auditors.floors import FLOOR_SPECS

    assert set(s["total"]["floors_on_test"]) == set(FLOOR_SPECS)
    md = (demo_build.out / "stats.md").read_text()
    assert "Injection recovery" in md and "Diagnosis" in md and "Rejections by predicate" in md
    assert "Kolmogorov-Smirnov" in md and "slip detector" in md and "Floors on the test split" in md


def _digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_rebuild_is_byte_identical(demo_build, demo_cfg, tmp_path):
    build_corpus(demo_cfg, tmp_path / "again", floors=floor_scores)
    assert _digest(tmp_path / "again") == _digest(demo_build.out)


def test_another_seed_builds_another_corpus(demo_build, demo_cfg):
    """Seed 1, on 8 generated tasks a domain: other families, other trajectories, other task texts
    (family ids carry the seed, so a few tasks show it as well as the second demo-sized build that
    this test used to make)."""
    small = replace(demo_cfg, tasks=DomainCounts(math=8, coding=8, agentic=8, humaneval=False))
    other = build_corpus(small, None, seed=1)
    assert other.trajectories
    assert not {t.id for t in other.trajectories} & {t.id for t in demo_build.trajectories}
    assert {t.task for t in other.trajectories} - {t.task for t in demo_build.trajectories}


@pytest.mark.slow
def test_cli(tmp_path, capsys):
    from aftraj.cli import main

    cfg = tmp_path / "tiny.yaml"
    tiny = re.sub(r"(?m)^  (math|coding|agentic): \d+$", r"  \1: 6", (REPO / "configs/corpus/demo-small.yaml").read_text())
    assert tiny.count(": 6\n") == 3             # six tasks a domain: the CLI's path, not the demo corpus again
    cfg.write_text(tiny)
    assert main(["corpus", "build", "--config", str(cfg), "--out", str(tmp_path / "o"), "--seed", "4", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "trajectories" in said and (tmp_path / "o" / "stats.md").is_file()
    assert json.loads((tmp_path / "o" / "stats.json").read_text())["config"]["seed"] == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntasks:\n  maths: 1\n")
    assert main(["corpus", "build", "--config", str(bad), "--out", str(tmp_path / "b")]) == 2
    assert "tasks.maths" in capsys.readouterr().err


@pytest.mark.heavy
def test_the_2k_scripted_corpus(tmp_path, sandbox):
    """configs/corpus/aftraj-2k-scripted.yaml: >= 2,000 trajectories, about half safe, labels verified.
    ~4 min on 2 busy cores, so not in the default suite (marker `heavy`); the demo-sized tests above
    make the same kinds of checks on ~450 trajectories (the replay check, stats, floors), with looser
    bounds (per-domain KS <= 0.25; premature terminations may be absent).

        bash scripts/test.sh -m heavy tests/aftraj/corpus/test_corpus_build.py
    """
    cfg = load_corpus_config(REPO / "configs/corpus/aftraj-2k-scripted.yaml")
    res = build_corpus(cfg, tmp_path / "k2", floors=floor_scores)
    tot = res.stats["total"]
    assert tot["trajectories"] >= 2000 and 0.4 <= tot["safe_fraction"] <= 0.6
    assert {t.domain for t in res.trajectories} == {"math", "coding", "agentic"}
    full = [res.full(t) for t in res.trajectories]
    assert {t.label.provenance["injection_type"] for t in full if t.label.label_source == "injected"} == set(ERROR_TYPES)
    n, problems = verify_labels(full, cfg, cfg.seed, sandbox)
    assert n >= 900 and problems == []
    assert tot["lengths"]["ks_safe_vs_unsafe"] <= 0.2
    for d, p in res.stats["per_domain"].items():
        assert p["decisive_step"]["distinct"] >= 10 and p["lengths"]["ks_safe_vs_unsafe"] <= 0.2, d
    # every floor, the ones that read included, at most 10 % Exact-F1 on test (issue 43)
    assert all(f["exact_f1"] <= 0.10 for f in tot["floors_on_test"].values()), tot["floors_on_test"]


@pytest.mark.slow
def test_verify_command(demo_build, tmp_path, capsys):
    """`aftraj corpus verify` agrees with the independent check: clean on the build, and it fails
    (exit 1) on a corpus whose labels were moved one step earlier."""
    from aftraj.cli import main
    from aftraj.schema import write_jsonl

    cfg = str(REPO / "configs/corpus/demo-small.yaml")
    assert main(["corpus", "verify", "--config", cfg, "--corpus", str(demo_build.out)]) == 0
    said = capsys.readouterr().out
    assert "problems=0" in said and "unsafe=" in said
    unsafe = [t for t in demo_build.trajectories if t.label.unsafe and t.label.decisive_step >= 3][:10]
    moved = [replace(t, label=replace(t.label, decisive_step=t.label.decisive_step - 1,
                                      decisive_agent=t.steps[t.label.decisive_step - 1].agent)) for t in unsafe]
    write_jsonl(moved, tmp_path / "corpus.jsonl")
    (tmp_path / "provenance.jsonl").write_text((demo_build.out / "provenance.jsonl").read_text())
    assert main(["corpus", "verify", "--config", cfg, "--corpus", str(tmp_path)]) == 1
    assert "problems=10" in capsys.readouterr().out
    (tmp_path / "provenance.jsonl").unlink()
    assert main(["corpus", "verify", "--config", cfg, "--corpus", str(tmp_path)]) == 2
    assert "provenance.jsonl" in capsys.readouterr().err


def test_cli_an_empty_build_fails(tmp_path, capsys, monkeypatch):
    """A build that keeps no trajectory (e.g. an endpoint answering /models but failing every
    call) exits non-zero naming the stats; one trajectory is a success (both sides)."""
    import types

    import aftraj.commands.corpus as cmd
    from aftraj.cli import main

    def fake(n):
        return lambda cfg, out, **kw: types.SimpleNamespace(stats={"total": {
            "trajectories": n, "safe": n, "unsafe": 0, "families": n}})
    monkeypatch.setattr(cmd, "build_corpus", fake(0))
    cfg = REPO / "configs/corpus/demo-small.yaml"
    assert main(["corpus", "build", "--config", str(cfg), "--out", str(tmp_path / "e"), "--no-progress"]) == 3
    assert "no trajectory was built" in capsys.readouterr().err
    monkeypatch.setattr(cmd, "build_corpus", fake(1))
    assert main(["corpus", "build", "--config", str(cfg), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
