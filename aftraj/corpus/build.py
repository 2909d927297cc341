"""Build a corpus end to end (DESIGN §4): task pools -> rollouts -> safe curation -> D_safe;
injection + replay -> D_unsafe (injected); diagnosis + replay of natural failures -> D_unsafe
(diagnosed); family splits; export; stats.json + stats.md.

    aftraj corpus build --config configs/corpus/aftraj-2k-scripted.yaml --out out/aftraj-2k
    from aftraj.corpus.build import build_corpus
    result = build_corpus(load_corpus_config(path), "out/demo")

Output is a pure function of (config, seed): byte-identical across builds. Timings go to the
caller (stdout), never into the files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from aftraj.corpus.config import CorpusConfig, config_to_dict
from aftraj.corpus.curate import PREDICATES, curate
from aftraj.corpus.diagnose import CRITERIA, diagnose, make_judge
from aftraj.corpus.domains.coding import functions_of, suite_tests
from aftraj.corpus.export import export_corpus
from aftraj.corpus.inject import inject, targets
from aftraj.corpus.policies import make_policy
from aftraj.corpus.rollout import Rollout, replay_restoring, run_rollout
from aftraj.corpus.sandbox import Sandbox
from aftraj.corpus.splits import assign_splits
from aftraj.corpus.tasks import POOL_READERS, Task, generate_tasks
from aftraj.corpus.templates import template_for
from aftraj.schema import Label, Trajectory


# --------------------------------------------------------------------------- tasks

def load_tasks(cfg: CorpusConfig, seed: int, sandbox: Sandbox | None = None) -> list[Task]:
    """The config's tasks. With `tasks.humaneval`, HumanEval problems are screened in the sandbox
    first (`screen_functions`): a pure function of the problems and the tests, so a verify run
    rebuilds the same tasks."""
    tasks: list[Task] = []
    for domain in ("math", "coding", "agentic"):
        if domain == "coding" and cfg.tasks.humaneval:
            sb = sandbox or _sandbox(cfg)
            tasks += generate_tasks(domain, getattr(cfg.tasks, domain), seed, humaneval=True,
                                    screen=functools.partial(screen_functions, sandbox=sb))
        else:
            tasks += generate_tasks(domain, getattr(cfg.tasks, domain), seed)
    for pool in cfg.public_pools:
        tasks += POOL_READERS[pool.kind](pool.path, pool.limit)
    return tasks


def _sandbox(cfg: CorpusConfig) -> Sandbox:
    return Sandbox(timeout_s=cfg.sandbox.timeout_s, memory_mb=cfg.sandbox.memory_mb,
                   workers=cfg.sandbox.workers)


def screen_functions(funcs: list[dict], sandbox: Sandbox) -> list[dict]:
    """Keep the functions whose correct code passes all their tests, with only the mutants that
    fail them (an equivalent mutant is no bug)."""
    def tests(f):
        return tuple(f["public_tests"]) + tuple(f.get("hidden_tests", []))

    sandbox.run_many([(code, tests(f)) for f in funcs for code in f["variants"].values()])
    out = []
    for f in funcs:
        if not sandbox.run(f["variants"]["correct"], tests(f)).passed:
            continue
        keep = {k: v for k, v in f["variants"].items() if k == "correct" or not sandbox.run(v, tests(f)).passed}
        out.append({**f, "variants": keep})
    return out


def precompute_tests(tasks: list[Task], sandbox: Sandbox) -> int:
    """Run every code variant the scripted agents can write against every suite (public, smoke,
    all); returns the number of (code, suite) pairs. Each variant runs its full suite once; a suite
    that is a prefix of the full one (public always, smoke where it is the first public test) takes
    the prefix of those results: the sandbox runs a sample's tests one after another in one fresh
    process, so the first n tests see exactly what they would see alone. Where the full run
    crashed or timed out, the shorter suite runs on its own. A third of the sandbox runs."""
    plans = []
    for t in tasks:
        if t.domain != "coding":
            continue
        for f in functions_of(t):
            if not f.get("variants"):
                continue
            full = suite_tests(t, "all", f["function"])
            subs = [suite_tests(t, s, f["function"]) for s in ("public", "smoke")]
            plans += [(code, full, subs) for code in f["variants"].values()]
    sandbox.run_many([(code, full) for code, full, _ in plans])
    alone = []
    for code, full, subs in plans:
        whole = sandbox.run(code, full)                       # cached above
        clean = not any(r == "timeout" or r.startswith("crashed") for r in whole.results)
        for sub in subs:
            if clean and sub == full[: len(sub)]:
                sandbox.seed(code, sub, whole.results[: len(sub)])
            else:
                alone.append((code, sub))
    sandbox.run_many(alone)
    bad = [(t.id, f["function"]) for t in tasks if t.domain == "coding" for f in functions_of(t) if f.get("variants")
           and not sandbox.run(f["variants"]["correct"], suite_tests(t, "all", f["function"])).passed]
    if bad:
        raise RuntimeError(f"coding tasks whose reference solution fails its tests: {bad[:5]}")
    return 3 * len(plans)


# --------------------------------------------------------------------------- trajectories

# what a reader of train/test.jsonl sees in `meta`; the rest goes to provenance.jsonl
PUBLIC_META = ("template", "task_source", "seed", "backend", "model", "split")


def traj_id(family_id: str, variant: str) -> str:
    """Opaque: a hash of the family and the variant (safe, injected-TYPE-K, diagnosed)."""
    return "t" + hashlib.blake2b(f"{family_id}\x1f{variant}".encode(), digest_size=8).hexdigest()


def _traj(task: Task, tpl, r: Rollout, variant: str, label: Label, extra_meta: dict) -> Trajectory:
    tid = traj_id(task.id, variant)
    steps = [t.to_step(i, tid) for i, t in enumerate(r.turns)]
    outcome = "success" if r.success else "failure"
    meta = {"template": tpl.name, "task_source": task.source, "seed": r.seed, "backend": r.backend,
            "model": r.model, "termination_reason": r.check_reason[:500], "slips": r.slips,
            "fixed_steps": sorted(r.fixed), "notes": r.notes[:20], "variant": variant, **extra_meta}
    return Trajectory(id=tid, family_id=task.id, domain=task.domain, source=f"aftraj-corpus/{tpl.name}",
                      task=task.prompt, steps=steps, label=label, final_answer=r.final_answer,
                      termination=r.termination, outcome=outcome, reference_answer=task.reference, meta=meta)


def split_provenance(t: Trajectory) -> tuple[Trajectory, dict]:
    """(the trajectory as train/test files show it, its provenance record). The simulator's
    per-step readings (meta.sim), its slip record, the stream and the label's provenance leave the
    trajectory; `attach_provenance` puts them back for replays and audits."""
    prov = {"id": t.id, "family_id": t.family_id, "label_provenance": t.label.provenance,
            "meta": {k: v for k, v in t.meta.items() if k not in PUBLIC_META},
            "sim": [s.meta.get("sim", {}) for s in t.steps]}
    clean = replace(t, steps=tuple(replace(s, meta={}) for s in t.steps),
                    meta={k: t.meta[k] for k in PUBLIC_META if k in t.meta},
                    label=replace(t.label, provenance={}))
    return clean, prov


def attach_provenance(t: Trajectory, prov: dict) -> Trajectory:
    if prov.get("id") != t.id or len(prov.get("sim", [])) != len(t.steps):
        raise ValueError(f"provenance record does not match trajectory {t.id}")
    steps = tuple(replace(s, meta={**s.meta, "sim": sim} if sim else s.meta)
                  for s, sim in zip(t.steps, prov["sim"], strict=True))
    return replace(t, steps=steps, meta={**t.meta, **prov["meta"]},
                   label=replace(t.label, provenance=prov["label_provenance"]))


def write_provenance(records: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n")


def read_provenance(path: str | Path) -> dict[str, dict]:
    out = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    r = json.loads(line)
                    out[r["id"]] = r
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{lineno}: bad provenance record: {e}") from None
    return out


def _h(*parts) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest(), "big")


@dataclass
class BuildResult:
    trajectories: list[Trajectory]          # as exported (no simulator annotations)
    split_of: dict[str, str]
    stats: dict
    out: Path | None = None
    records: dict = field(default_factory=dict)
    provenance: dict[str, dict] = field(default_factory=dict)   # id -> provenance record

    def full(self, t: Trajectory) -> Trajectory:
        """The trajectory with its provenance attached (meta.sim, slips, fixed steps, label provenance)."""
        return attach_provenance(t, self.provenance[t.id])


def _progress(it, enabled: bool, desc: str, total: int | None = None):
    """Counts and an ETA (`aftraj.console.track`: a bar on a terminal, a line every few seconds in a log)."""
    if not enabled:
        return it
    from aftraj.console import track

    return track(it, f"corpus build: {desc}", "task", total=total)


def build_corpus(cfg: CorpusConfig, out: str | Path | None, *, seed: int | None = None, progress: bool = False,
                 client=None, judge_client=None,
                 floors: Callable[[list[Trajectory], dict[str, str]], dict] | None = None) -> BuildResult:
    """Build the corpus of `cfg` (written to `out` unless None). `floors(trajs, split_of)`: the
    content-blind floors fit on train and scored on test for stats.json's `floors_on_test`
    (`aftraj corpus build` passes `eval.floors.floor_scores`; the evaluation package
    builds on this one, so the builder takes it as an argument). Without it that entry is empty."""
    seed = cfg.seed if seed is None else seed
    sandbox = _sandbox(cfg)
    policy = make_policy(cfg.policy, cfg.slips, client)
    judge = make_judge(cfg.judge, judge_client)
    tasks = load_tasks(cfg, seed, sandbox)
    if progress:
        t0 = time.perf_counter()
        print(f"corpus build: {len(tasks)} tasks; running the coding tasks' unit-test suites in the sandbox …",
              file=sys.stderr, flush=True)
    n_suites = precompute_tests(tasks, sandbox)
    if progress:
        print(f"corpus build: {n_suites} (code, suite) pairs tested in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)

    trajs: list[Trajectory] = []
    rejections: list[dict] = []
    inj_log: list[dict] = []
    diag_log: list[dict] = []
    roll_log: list[dict] = []
    for task in _progress(tasks, progress, "rollouts", len(tasks)):
        tpl = template_for(task.domain)
        r = _rollout(tpl, task, policy, seed, sandbox, cfg)
        roll_log.append({"domain": task.domain, "success": r.success, "termination": r.termination,
                         "slips": [s["type"] for s in r.slips], "notes": len(r.notes)})
        if r.success:
            rej = curate(tpl, task, r, judge=judge, coherence=cfg.curation.coherence)
            if rej:
                rejections += [{"domain": task.domain, "task": task.id, **x.to_dict()} for x in rej]
                continue
            safe = _traj(task, tpl, r, "safe", Label("SAFE", "verified_safe"), {"stream": "safe"})
            trajs.append(safe)
            if _h(seed, task.id, "inject?") / 2.0**64 < cfg.injection.fraction:
                t = _inject_one(tpl, task, policy, r, seed, sandbox, cfg, inj_log)
                if t is not None:
                    trajs.append(t)
        else:
            rejections.append({"domain": task.domain, "task": task.id, "predicate": "outcome_equivalence",
                               "reason": f"failed run ({r.termination}): {r.check_reason[:200]}", "step": None,
                               "slip_type": None})
            d = diagnose(tpl, task, policy, r, judge, seed=seed, sandbox=sandbox, max_steps=cfg.max_steps)
            diag_log.append({"domain": task.domain, "accepted": d.accepted, "reason": d.reason, **d.record})
            if d.accepted:
                label = Label("UNSAFE", "diagnosed", decisive_step=d.step, decisive_agent=d.agent, reason=d.reason,
                              provenance={"failure_type": d.failure_type, "judge": judge.backend, "diagnosis": d.record})
                trajs.append(_traj(task, tpl, r, "diagnosed", label, {"stream": "diagnosed"}))

    if progress:
        print(f"corpus build: {len(trajs)} trajectories; length matching, splits, stats and the "
              f"content-blind floors …", file=sys.stderr, flush=True)
    trajs, dropped = balance_lengths(trajs, cfg.curation.length_ratio, seed)
    rejections += dropped
    trajs.sort(key=lambda t: t.id)
    split_of = assign_splits(trajs, train=cfg.splits.train, val=cfg.splits.val, test=cfg.splits.test, seed=seed)
    trajs = [_with_split(t, split_of[t.family_id]) for t in trajs]
    stats = compute_stats(cfg, seed, trajs, split_of, rejections, inj_log, diag_log, roll_log, judge.backend,
                          floors_on_test=floors(trajs, split_of) if floors is not None else {})
    pairs = [split_provenance(t) for t in trajs]
    clean = [c for c, _ in pairs]
    res = BuildResult(clean, split_of, stats, records={"rejections": rejections, "injections": inj_log,
                                                       "diagnoses": diag_log, "sandbox_runs": sandbox.n_subprocesses},
                      provenance={p["id"]: p for _, p in pairs})
    if out is not None:
        out = Path(out)
        if progress:
            print(f"corpus build: writing {out} (JSONL, Hub parquet, AFTraj parquet) …", file=sys.stderr, flush=True)
        export_corpus(clean, split_of, out, jsonl=cfg.export.jsonl, hf=cfg.export.hf, parquet=cfg.export.parquet,
                      stats=stats)
        write_provenance([p for _, p in pairs], out / "provenance.jsonl")
        (out / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
        (out / "stats.md").write_text(stats_markdown(stats))
        res.out = out
    return res


LENGTH_BIN = 3


def balance_lengths(trajs: list[Trajectory], ratio: float, seed: int) -> tuple[list[Trajectory], list[dict]]:
    """Length matching: in every (domain, length bin) keep at most ceil(ratio x the smaller
    class) of the larger class (safe or unsafe), trajectories of HumanEval tasks first, then by a
    seeded hash, so a trajectory's length says little about its label. Returns (kept, one rejection record per dropped one)."""
    if not ratio:
        return trajs, []
    cells: dict[tuple, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        cells[(t.domain, len(t.steps) // LENGTH_BIN)].append(t)
    keep: set[str] = set()
    dropped = []
    def order(t: Trajectory):   # real (HumanEval) tasks first, then a seeded hash; the same for both classes
        return (t.meta.get("task_source") != "humaneval", _h(seed, "len", t.id))

    for (domain, b), ts in sorted(cells.items()):
        safe = sorted((t for t in ts if not t.label.unsafe), key=order)
        unsafe = sorted((t for t in ts if t.label.unsafe), key=order)
        cap_s = min(len(safe), math.ceil(ratio * len(unsafe)))
        cap_u = min(len(unsafe), math.ceil(ratio * len(safe)))
        for group, cap in ((safe, cap_s), (unsafe, cap_u)):
            keep |= {t.id for t in group[:cap]}
            dropped += [{"domain": domain, "task": t.family_id, "predicate": "length_balance", "step": None,
                         "slip_type": None, "reason": f"length bin {b * LENGTH_BIN}-{b * LENGTH_BIN + LENGTH_BIN - 1}: "
                         f"{len(safe)} safe vs {len(unsafe)} unsafe"} for t in group[cap:]]
    return [t for t in trajs if t.id in keep], dropped


def _with_split(t: Trajectory, split: str) -> Trajectory:
    return replace(t, meta={**t.meta, "split": split})


def _rollout(tpl, task, policy, seed, sandbox, cfg) -> Rollout:
    return run_rollout(tpl, task, policy, seed=seed, sandbox=sandbox, max_steps=cfg.max_steps)


# Types whose site is tied to the end of the run are kept at a fraction of the others' rate, so
# the last steps stay no position prior: a premature termination ends the run (k* = N-1), and the
# math Verifier's verdict and the Manager's confirmation come right before the final answer.
TYPE_WEIGHT = {("*", "premature_termination"): 0.25, ("math", "verdict_misread"): 0.25,
               ("agentic", "verdict_misread"): 0.15}


def _weight(domain: str, etype: str) -> float:
    return TYPE_WEIGHT.get((domain, etype), TYPE_WEIGHT.get(("*", etype), 1.0))


def _inject_one(tpl, task, policy, safe: Rollout, seed, sandbox, cfg, log: list) -> Trajectory | None:
    """Try up to max_attempts seeded (type, step) draws; keep the first that fails the run. The
    site aims at a relative position u drawn uniformly from [0.1, 0.9] per task (the closest
    step of each type first), so decisive steps spread over the whole run."""
    n = len(safe.turns)
    options = [(e, k) for e in cfg.injection.types for k in targets(tpl, task, safe.turns, e)]
    if not options:
        log.append({"domain": task.domain, "type": None, "outcome": "no_target"})
        return None
    u = 0.1 + 0.8 * (_h(seed, task.id, "site") / 2.0**64)
    by_type: dict[str, list] = defaultdict(list)
    for o in sorted(options, key=lambda o: (abs(o[1] / max(n - 1, 1) - u), _h(seed, task.id, "draw", *o))):
        by_type[o[0]].append(o)
    # least-kept type (so far, in this domain, relative to its weight) first
    kept = Counter(x["type"] for x in log if x["domain"] == task.domain and x["outcome"] == "kept")
    order = sorted(by_type, key=lambda e: (kept[e] / _weight(task.domain, e), _h(seed, task.id, "type", e)))
    draws = [by_type[e][m] for m in range(max(map(len, by_type.values()))) for e in order if m < len(by_type[e])]
    for etype, k in draws[:cfg.injection.max_attempts]:
        res = inject(tpl, task, policy, safe, etype, k, seed=seed, sandbox=sandbox, max_steps=cfg.max_steps)
        log.append({"domain": task.domain, "type": etype, "outcome": res.outcome})
        if res.kept:
            # the label's own check: restoring the injected turn gives the safe run back
            back = replay_restoring(tpl, task, policy, res.rollout.turns, k, seed=seed, sandbox=sandbox,
                                    fixed=res.rollout.fixed, max_steps=cfg.max_steps)
            if not back.success:
                log[-1]["outcome"] = "restore_failed"
                continue
            label = Label("UNSAFE", "injected", decisive_step=k, decisive_agent=res.corrupted.agent,
                          reason=f"{res.corrupted.agent} {res.provenance()['description']} (step {k}).",
                          provenance=res.provenance())
            return _traj(task, tpl, res.rollout, f"injected-{etype}-{k}", label,
                         {"stream": "injected", "injection_type": etype})
    return None


# --------------------------------------------------------------------------- stats

def _rate(a: int, b: int) -> float | None:
    return None if b == 0 else round(a / b, 4)


def ks_statistic(a: list[float], b: list[float]) -> float | None:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    if not a or not b:
        return None
    a, b = sorted(a), sorted(b)
    i = j = 0
    best = 0.0
    for x in sorted(set(a) | set(b)):
        while i < len(a) and a[i] <= x:
            i += 1
        while j < len(b) and b[j] <= x:
            j += 1
        best = max(best, abs(i / len(a) - j / len(b)))
    return round(best, 4)


def _rel_decile(t: Trajectory) -> str:
    r = t.label.decisive_step / max(len(t.steps) - 1, 1)
    lo = min(int(r * 10), 9) * 10
    return f"{lo:02d}-{lo + 10}%"


def _lengths(ts: list[Trajectory]) -> dict:
    safe = [len(t.steps) for t in ts if not t.label.unsafe]
    unsafe = [len(t.steps) for t in ts if t.label.unsafe]
    return {"safe": {str(n): c for n, c in sorted(Counter(safe).items())},
            "unsafe": {str(n): c for n, c in sorted(Counter(unsafe).items())},
            "min": min(safe + unsafe, default=None), "max": max(safe + unsafe, default=None),
            "mean_safe": _rate(sum(safe), len(safe)), "mean_unsafe": _rate(sum(unsafe), len(unsafe)),
            "ks_safe_vs_unsafe": ks_statistic(safe, unsafe)}


def compute_stats(cfg, seed, trajs, split_of, rejections, inj_log, diag_log, roll_log, judge: str = "scripted",
                  floors_on_test: dict | None = None) -> dict:
    domains = sorted({t.domain for t in trajs} | {r["domain"] for r in roll_log})
    per = {}
    for d in domains:
        ts = [t for t in trajs if t.domain == d]
        unsafe = [t for t in ts if t.label.unsafe]
        ks = Counter(t.label.decisive_step for t in unsafe)
        buckets = Counter(f"{(k // 5) * 5}-{(k // 5) * 5 + 4}" for k in (t.label.decisive_step for t in unsafe))
        rolls = [r for r in roll_log if r["domain"] == d]
        inj = [x for x in inj_log if x["domain"] == d and x["type"]]
        per[d] = {
            "trajectories": len(ts), "safe": len(ts) - len(unsafe), "unsafe": len(unsafe),
            "label_sources": dict(sorted(Counter(t.label.label_source for t in ts).items())),
            "decisive_step": {"histogram_by_5": dict(sorted(buckets.items(), key=lambda kv: int(kv[0].split("-")[0]))),
                              "mean": _rate(sum(k * n for k, n in ks.items()), len(unsafe)),
                              "distinct": len(ks),
                              "relative_by_10pct": dict(sorted(Counter(_rel_decile(t) for t in unsafe).items())),
                              "counts": {str(k): n for k, n in sorted(ks.items())}},
            "lengths": _lengths(ts),
            "slip_rejections_by_type": dict(sorted(Counter(x["slip_type"] for x in rejections
                                                           if x["domain"] == d and x["predicate"] == "slip_free").items())),
            "decisive_agent": dict(sorted(Counter(t.label.decisive_agent for t in unsafe).items())),
            "rollouts": {"n": len(rolls), "success": sum(r["success"] for r in rolls),
                         "natural_success_rate": _rate(sum(r["success"] for r in rolls), len(rolls))},
            "rejections_by_predicate": {p: sum(1 for x in rejections if x["domain"] == d and x["predicate"] == p)
                                        for p in PREDICATES},
            "injection": _inj_stats(inj),
            "diagnosis": _diag_stats([x for x in diag_log if x["domain"] == d]),
            "splits": dict(sorted(Counter(split_of[t.family_id] for t in ts).items())),
        }
    unsafe_all = [t for t in trajs if t.label.unsafe]
    return {
        "config": config_to_dict(cfg) | {"seed": seed},
        "total": {"trajectories": len(trajs), "safe": len(trajs) - len(unsafe_all), "unsafe": len(unsafe_all),
                  "safe_fraction": _rate(len(trajs) - len(unsafe_all), len(trajs)),
                  "families": len(split_of),
                  "splits": dict(sorted(Counter(split_of[t.family_id] for t in trajs).items())),
                  "label_sources": dict(sorted(Counter(t.label.label_source for t in trajs).items())),
                  "injection": _inj_stats([x for x in inj_log if x["type"]]),
                  "diagnosis": _diag_stats(diag_log),
                  "rejections_by_predicate": {p: sum(1 for x in rejections if x["predicate"] == p) for p in PREDICATES},
                  "slip_rejections_by_type": dict(sorted(Counter(x["slip_type"] for x in rejections
                                                                 if x["predicate"] == "slip_free").items())),
                  "length_balance_dropped": sum(x["predicate"] == "length_balance" for x in rejections),
                  "lengths": _lengths(trajs),
                  "judge": judge,
                  "judge_note": ("oracle: the judge read the simulator's slip record; its agreement figures are "
                                 "no claim" if judge == "oracle" else "the judge decided from the trajectory and replay"),
                  "floors_on_test": floors_on_test or {}},
        "per_domain": per,
    }


def _inj_stats(inj: list[dict]) -> dict:
    out = {}
    for e in sorted({x["type"] for x in inj}):
        xs = [x for x in inj if x["type"] == e]
        replayed = [x for x in xs if x["outcome"] in ("kept", "recovered", "restore_failed")]
        rec = sum(x["outcome"] == "recovered" for x in xs)
        out[e] = {"attempts": len(xs), "replayed": len(replayed), "kept": sum(x["outcome"] == "kept" for x in xs),
                  "recovered": rec, "not_applicable": sum(x["outcome"] in ("not_applicable", "unchanged") for x in xs),
                  "invisible": sum(x["outcome"] == "invisible" for x in xs),
                  "recovery_rate": _rate(rec, len(replayed))}
    return out


def _diag_stats(diag: list[dict]) -> dict:
    cands = [c for d in diag for c in d.get("candidates", [])]
    verified = [c for c in cands if all(c["verifier"].values())]
    replayed = [c for c in cands if "replay" in c]
    tops = [d["candidates"][0] for d in diag if d.get("candidates")]
    return {
        "failed_rollouts": len(diag), "with_candidates": sum(1 for d in diag if d.get("candidates")),
        "accepted": sum(d["accepted"] for d in diag), "acceptance_rate": _rate(sum(d["accepted"] for d in diag), len(diag)),
        "candidates": len(cands),
        "proposer_verifier_agreement": _rate(len(verified), len(cands)),
        "verifier_replay_agreement": _rate(sum(all(c["verifier"].values()) == c["replay"]["flipped"] for c in replayed), len(replayed)),
        "causality_replay_agreement": _rate(sum(c["verifier"]["decisive_causality"] == c["replay"]["flipped"] for c in replayed), len(replayed)),
        "proposer_top1_replay_flip": _rate(sum(c.get("replay", {}).get("flipped", False) for c in tops), len(tops)),
        "replays_flipped": sum(c["replay"]["flipped"] for c in replayed),
        "verifier_criteria_true": {k: sum(c["verifier"][k] for c in cands) for k in CRITERIA},
        "rejection_reasons": dict(sorted(Counter(d["reason"].split(" (")[0] for d in diag if not d["accepted"]).items())),
    }


def stats_markdown(s: dict) -> str:
    t = s["total"]
    lines = [f"# Corpus stats: {s['config']['name']} (seed {s['config']['seed']})", "",
             f"{t['trajectories']} trajectories ({t['safe']} safe, {t['unsafe']} unsafe; safe fraction "
             f"{t['safe_fraction']}), {t['families']} families; splits {t['splits']}.", "",
             "| domain | trajectories | safe | unsafe | injected | diagnosed | natural success | mean k* |",
             "|---|---|---|---|---|---|---|---|"]
    for d, p in s["per_domain"].items():
        ls = p["label_sources"]
        lines.append(f"| {d} | {p['trajectories']} | {p['safe']} | {p['unsafe']} | {ls.get('injected', 0)} | "
                     f"{ls.get('diagnosed', 0)} | {p['rollouts']['natural_success_rate']} | {p['decisive_step']['mean']} |")
    lines += ["", "## Rejections by predicate", "", "| domain | " + " | ".join(PREDICATES) + " |",
              "|---|" + "---|" * len(PREDICATES)]
    for d, p in s["per_domain"].items():
        lines.append(f"| {d} | " + " | ".join(str(p["rejections_by_predicate"][q]) for q in PREDICATES) + " |")
    lines += ["", "## Injection recovery by type (all domains)", "",
              "| type | attempts | replayed | kept | recovered | recovery rate |", "|---|---|---|---|---|---|"]
    for e, x in t["injection"].items():
        lines.append(f"| {e} | {x['attempts']} | {x['replayed']} | {x['kept']} | {x['recovered']} | {x['recovery_rate']} |")
    lines += ["", "## Injection recovery by domain and type", "", "| domain | type | replayed | kept | recovery rate |",
              "|---|---|---|---|---|"]
    for d, p in s["per_domain"].items():
        for e, x in p["injection"].items():
            lines.append(f"| {d} | {e} | {x['replayed']} | {x['kept']} | {x['recovery_rate']} |")
    lines += ["", "## Diagnosis", "", "| domain | failed | accepted | proposer-verifier | verifier-replay | "
              "causality-replay | top-1 flips |", "|---|---|---|---|---|---|---|"]
    for d, p in list(s["per_domain"].items()) + [("all", {"diagnosis": t["diagnosis"]})]:
        x = p["diagnosis"]
        lines.append(f"| {d} | {x['failed_rollouts']} | {x['accepted']} | {x['proposer_verifier_agreement']} | "
                     f"{x['verifier_replay_agreement']} | {x['causality_replay_agreement']} | {x['proposer_top1_replay_flip']} |")
    lines += ["", "## Decisive-step distribution (k*, buckets of 5)", ""]
    for d, p in s["per_domain"].items():
        lines.append(f"- {d}: {p['decisive_step']['histogram_by_5']}")
    lines += ["", "## Decisive step k*: absolute (count per step) and relative to the length (k*/(N-1))", ""]
    for d, p in s["per_domain"].items():
        k = p["decisive_step"]
        lines.append(f"- {d}: {k['distinct']} distinct values; absolute {k['counts']}")
        lines.append(f"  relative {k['relative_by_10pct']}")
    lines += ["", "## Lengths, safe vs unsafe (two-sample Kolmogorov-Smirnov statistic)", "",
              "| domain | min | max | mean safe | mean unsafe | KS |", "|---|---|---|---|---|---|"]
    for d, p in list(s["per_domain"].items()) + [("all", t)]:
        x = p["lengths"]
        lines.append(f"| {d} | {x['min']} | {x['max']} | {x['mean_safe']} | {x['mean_unsafe']} | {x['ks_safe_vs_unsafe']} |")
    lines += [""] + [f"- {d} safe {p['lengths']['safe']}\n  {d} unsafe {p['lengths']['unsafe']}"
                     for d, p in s["per_domain"].items()]
    lines.append(f"\nLength matching (curation.length_ratio = {s['config']['curation']['length_ratio']}) dropped "
                 f"{t['length_balance_dropped']} trajectories.")
    lines += ["", "## Safe candidates rejected by the slip detector (by type)", ""]
    for d, p in list(s["per_domain"].items()) + [("all", t)]:
        lines.append(f"- {d}: {p['slip_rejections_by_type'] or 'none'}")
    lines += ["", f"## Judge: {t['judge']} ({t['judge_note']})", "",
              "## Floors on the test split (fit on train, thresholds on val)", "",
              "| floor | n | Exact-F1 | Step-Acc | Agent-Acc | FAR |", "|---|---|---|---|---|---|"]
    for spec, g in (t.get("floors_on_test") or {}).items():
        lines.append(f"| {spec} | {g['n']} | {g['exact_f1']} | {g['step_acc']} | {g['agent_acc']} | {g['far']} |")
    return "\n".join(lines) + "\n"
