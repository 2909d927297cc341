"""Corpus validity (DESIGN §4, issue 9): safe runs are clean by the injector's own definitions,
every injected error is visible in the prefix that ends at it, the diagnosis judge reads the
trajectory (not the simulator's record), ids and exported fields reveal no label, decisive steps
and lengths do not give the label away, and HumanEval is a real coding pool."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from aftraj.corpus.build import PUBLIC_META, traj_id
from aftraj.corpus.config import ERROR_TYPES, SlipConfig
from aftraj.corpus.curate import curate
from aftraj.corpus.inject import corrupt, targets
from aftraj.corpus.policies import ScriptedPolicy
from aftraj.corpus.rollout import run_rollout
from aftraj.corpus.slips import PREDICATES, find_slips, slips_at
from aftraj.corpus.tasks import generate_tasks
from aftraj.corpus.templates import template_for

DOMAINS = ("math", "coding", "agentic")


@pytest.fixture(scope="module")
def safe_runs(sandbox):
    """Clean successes per domain (curation accepts them)."""
    from aftraj.corpus.build import precompute_tests

    policy = ScriptedPolicy(SlipConfig())
    out = {}
    for d in DOMAINS:
        tasks = generate_tasks(d, 30, 3)
        if d == "coding":
            precompute_tests(tasks, sandbox)
        tpl = template_for(d)
        runs = []
        for t in tasks:
            r = run_rollout(tpl, t, policy, seed=3, sandbox=sandbox)
            if r.success and not curate(tpl, t, r):
                runs.append((t, r))
        out[d] = runs
    return out


@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize("etype", ERROR_TYPES)
def test_a_planted_slip_makes_a_safe_run_unsafe_for_curation(domain, etype, safe_runs):
    """Each slip type, planted in a run curation accepted (the rest of the run unchanged, as if a
    checker had caught it later), is rejected by the slip detector under its own type."""
    tpl = template_for(domain)
    planted = 0
    for task, r in safe_runs[domain]:
        assert find_slips(tpl, task, r.turns) == []
        for k in targets(tpl, task, r.turns, etype):
            bad = corrupt(tpl, task, r.turns, k, etype)
            if bad is None or bad.same_as(r.turns[k]):
                continue
            turns = list(r.turns[:k]) + [bad] + list(r.turns[k + 1:])
            rej = [x for x in curate(tpl, task, replace(r, turns=turns)) if x.predicate == "slip_free"]
            assert rej and rej[0].step == k and rej[0].slip_type == etype, (task.id, k, rej)
            assert etype in {f.type for f in slips_at(tpl, task, turns[: k + 1], k)}   # visible in its prefix
            planted += 1
            break
        if planted >= 3:
            break
    assert planted >= 1, f"no {etype} site in the {domain} safe runs"


def test_every_domain_has_one_predicate_per_type():
    assert set(PREDICATES) == set(DOMAINS)
    assert all(tuple(sorted(p)) == tuple(sorted(ERROR_TYPES)) for p in PREDICATES.values())


def test_built_corpus_holds_clean_safe_runs_and_visible_injections(demo_build, demo_cfg, sandbox):
    from aftraj.corpus.build import load_tasks

    tasks = {t.id: t for t in load_tasks(demo_cfg, demo_cfg.seed, sandbox)}   # HumanEval screened once a session
    from aftraj.corpus.rollout import Turn

    n_inj = 0
    for t in demo_build.trajectories:
        full = demo_build.full(t)
        tpl, task = template_for(t.domain), tasks[t.family_id]
        turns = [Turn.from_step(s) for s in full.steps]
        if not t.label.unsafe:
            assert find_slips(tpl, task, turns) == [], t.id
        elif t.label.label_source == "injected":
            k = t.label.decisive_step
            types = {f.type for f in slips_at(tpl, task, turns[: k + 1], k)}
            assert full.label.provenance["injection_type"] in types, (t.id, types)
            n_inj += 1
    assert n_inj >= 100
    s = demo_build.stats["total"]
    assert s["rejections_by_predicate"]["slip_free"] > 0 and s["slip_rejections_by_type"]


# --------------------------------------------------------------------------- what a reader sees

_SECRETS = re.compile("|".join(list(ERROR_TYPES) + ["injected", "diagnosed", "verified_safe", "decisive",
                                                    "fixed_steps", r"\bslips?\b", r"\bstream\b"]))


def _walk_strings(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _walk_strings(k, f"{path}.{k}[key]")
            yield from _walk_strings(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _walk_strings(v, f"{path}[{i}]")
    elif isinstance(x, str):
        yield path, x


def test_train_and_test_files_reveal_no_label_outside_label(demo_build):
    out = demo_build.out
    for split in ("train", "test", "val"):
        for line in (out / f"{split}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            assert re.fullmatch(r"t[0-9a-f]{16}", rec["id"]), rec["id"]
            assert set(rec["meta"]) <= set(PUBLIC_META)
            assert all(s["meta"] == {} for s in rec["steps"])
            assert rec["label"]["provenance"] == {}
            for path, text in _walk_strings({x: v for x, v in rec.items() if x != "label"}):
                assert not _SECRETS.search(text), (rec["id"], path, text[:120])


def test_parquet_export_reveals_no_label_outside_its_label_columns(demo_build):
    import pyarrow.parquet as pq

    label_cols = {"mistake_step", "mistake_agent", "mistake_reason", "unsafe_source"}
    for name in ("aftraj_safe.parquet", "aftraj_unsafe.parquet"):
        for row in pq.read_table(demo_build.out / name).to_pylist():
            assert re.fullmatch(r"t[0-9a-f]{16}", row["conv_id"])
            for path, text in _walk_strings({k: v for k, v in row.items() if k not in label_cols}):
                assert not _SECRETS.search(text), (row["conv_id"], path, text[:120])


def test_ids_are_opaque_hashes_of_family_and_variant():
    a, b = traj_id("coding/0-00001", "safe"), traj_id("coding/0-00001", "injected-wrong_entity-4")
    assert a != b and re.fullmatch(r"t[0-9a-f]{16}", a) and "coding" not in a
    assert traj_id("coding/0-00001", "safe") == a


def test_provenance_file_restores_what_the_files_leave_out(demo_build):
    from aftraj.corpus.build import attach_provenance, read_provenance

    prov = read_provenance(demo_build.out / "provenance.jsonl")
    assert set(prov) == {t.id for t in demo_build.trajectories}
    t = next(t for t in demo_build.trajectories if t.label.label_source == "injected")
    full = attach_provenance(t, prov[t.id])
    assert full.meta["stream"] == "injected" and full.meta["fixed_steps"] == [t.label.decisive_step]
    assert full.label.provenance["injection_type"] in ERROR_TYPES and full.steps[1].meta["sim"]["act"]
    with pytest.raises(ValueError, match="does not match"):
        attach_provenance(t, {**prov[t.id], "sim": []})


# --------------------------------------------------------------------------- the judge

def test_scripted_judge_reads_the_trajectory_not_the_record(sandbox):
    """Clearing the simulator's slip flags changes nothing the scripted judge decides; the oracle
    (which reads them) then finds nothing."""
    from aftraj.corpus.diagnose import OracleJudge, ScriptedJudge, diagnose

    policy = ScriptedPolicy(SlipConfig(computation_slip=0.2, wrong_entity=0.2, catch_rate=0.0))
    tpl = template_for("math")
    n = 0
    for task in generate_tasks("math", 40, 5):
        r = run_rollout(tpl, task, policy, seed=5, sandbox=sandbox)
        if r.success:
            continue
        blind = replace(r, turns=[replace(t, slip=None) for t in r.turns])
        a = diagnose(tpl, task, policy, r, ScriptedJudge(), seed=5, sandbox=sandbox)
        b = diagnose(tpl, task, policy, blind, ScriptedJudge(), seed=5, sandbox=sandbox)
        assert (a.accepted, a.step, a.agent) == (b.accepted, b.step, b.agent)
        assert not diagnose(tpl, task, policy, blind, OracleJudge(), seed=5, sandbox=sandbox).accepted
        n += a.accepted
    assert n >= 5


def test_oracle_is_a_judge_only_and_named_in_stats():
    from aftraj.config import ConfigError
    from aftraj.corpus.config import config_from_dict

    cfg = config_from_dict({"name": "x", "judge": {"backend": "oracle"}})
    assert cfg.judge.backend == "oracle"
    with pytest.raises(ConfigError, match="policy.backend"):
        config_from_dict({"name": "x", "policy": {"backend": "oracle"}})


# --------------------------------------------------------------------------- HumanEval

def test_humaneval_functions_are_real_and_their_mutants_fail(sandbox):
    from aftraj.corpus.build import screen_functions
    from aftraj.corpus.domains.coding import MUTATIONS, humaneval_function, humaneval_problems

    rows = humaneval_problems()
    assert len(rows) == 164
    funcs = screen_functions([humaneval_function(r) for r in rows[:40]], sandbox)
    assert len(funcs) >= 35
    kinds = set()
    for f in funcs:
        tests = tuple(f["public_tests"])
        assert sandbox.run(f["variants"]["correct"], tests).passed
        for name, code in f["variants"].items():
            if name != "correct":
                assert not sandbox.run(code, tests).passed, (f["task_id"], name)
            if name.startswith("bug:"):
                kinds.add(name[4:].rstrip("0123456789"))
    assert kinds == set(MUTATIONS)


def test_coding_tasks_bundle_functions_and_check_each_one(sandbox):
    from aftraj.corpus.build import precompute_tests
    from aftraj.corpus.domains.coding import functions_of
    from aftraj.corpus.tasks import check_answer

    tasks = generate_tasks("coding", 12, 0, humaneval=True)
    precompute_tests(tasks, sandbox)
    sizes = {len(functions_of(t)) for t in tasks}
    assert len(sizes) >= 3
    t = max(tasks, key=lambda t: len(functions_of(t)))
    blocks = [f"```python\n{f['variants']['correct']}```" for f in functions_of(t)]
    assert check_answer(t, "FINAL ANSWER:\n" + "\n".join(blocks), sandbox)[0]
    assert not check_answer(t, "FINAL ANSWER:\n" + "\n".join(blocks[:-1]), sandbox)[0]
    f = functions_of(t)[0]
    bug = next(v for k, v in f["variants"].items() if k.startswith("bug:"))
    assert not check_answer(t, "FINAL ANSWER:\n" + "\n".join([f"```python\n{bug}```"] + blocks[1:]), sandbox)[0]


def test_precomputed_prefix_suites_equal_their_own_runs():
    """precompute_tests runs each variant's full suite once and takes the public (and smoke) results
    as its prefix: every such result equals the suite run alone in a fresh sandbox, wrong variants
    included; a suite that is not a prefix (HumanEval's smoke test) is run on its own."""
    from aftraj.corpus.build import precompute_tests
    from aftraj.corpus.sandbox import Sandbox, sample_key
    from aftraj.corpus.domains.coding import functions_of, suite_tests

    tasks = generate_tasks("coding", 6, 1, humaneval=True)
    with Sandbox(timeout_s=2) as first, Sandbox(timeout_s=2) as alone:
        n = precompute_tests(tasks, first)
        runs = first.n_subprocesses
        checked = failing = 0
        for t in tasks:
            for f in functions_of(t):
                for code in (f.get("variants") or {}).values():
                    for s in ("public", "smoke"):
                        tests = suite_tests(t, s, f["function"])
                        seeded = first.cache[sample_key(code, tests)]
                        assert seeded.results == alone.run(code, tests).results, (t.id, f["function"], s)
                        checked += 1
                        failing += not seeded.passed
    assert checked and failing            # wrong variants were compared too, not only passing ones
    assert runs < n                       # the prefixes cost no sandbox run of their own
