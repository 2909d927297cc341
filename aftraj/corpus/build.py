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

import hashlib
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from aftraj.corpus.config import CorpusConfig, config_to_dict
from aftraj.corpus.curate import PREDICATES, curate
from aftraj.corpus.diagnose import CRITERIA, diagnose, make_judge
from aftraj.corpus.export import export_corpus
from aftraj.corpus.inject import inject, targets
from aftraj.corpus.policies import make_policy
from aftraj.corpus.rollout import Rollout, replay_restoring, run_rollout
from aftraj.corpus.sandbox import Sandbox
from aftraj.corpus.splits import assign_splits
from aftraj.corpus.tasks import POOL_READERS, Task, generate_tasks, suite_tests
from aftraj.corpus.templates import template_for
from aftraj.schema import Label, Trajectory


# --------------------------------------------------------------------------- tasks

def load_tasks(cfg: CorpusConfig, seed: int) -> list[Task]:
    tasks: list[Task] = []
    for domain in ("math", "coding", "agentic"):
        tasks += generate_tasks(domain, getattr(cfg.tasks, domain), seed)
    for pool in cfg.public_pools:
        tasks += POOL_READERS[pool.kind](pool.path, pool.limit)
    return tasks


def precompute_tests(tasks: list[Task], sandbox: Sandbox) -> int:
    """Run every code variant the scripted agents can write against every suite, batched."""
    items = [(code, suite_tests(t, s)) for t in tasks if t.domain == "coding" and t.data.get("variants")
             for code in t.data["variants"].values() for s in ("public", "smoke", "all")]
    sandbox.run_many(items)
    bad = [t.id for t in tasks if t.domain == "coding" and t.data.get("variants")
           and not sandbox.run(t.data["variants"]["correct"], suite_tests(t, "all")).passed]
    if bad:
        raise RuntimeError(f"generated coding tasks whose reference solution fails its tests: {bad[:5]}")
    return len(items)


# --------------------------------------------------------------------------- trajectories

def _traj(task: Task, tpl, r: Rollout, tid: str, label: Label, extra_meta: dict) -> Trajectory:
    steps = [t.to_step(i, tid) for i, t in enumerate(r.turns)]
    outcome = "success" if r.success else "failure"
    meta = {"template": tpl.name, "task_source": task.source, "seed": r.seed, "backend": r.backend,
            "model": r.model, "termination_reason": r.check_reason[:500], "slips": r.slips,
            "fixed_steps": sorted(r.fixed), "notes": r.notes[:20], **extra_meta}
    return Trajectory(id=tid, family_id=task.id, domain=task.domain, source=f"aftraj-corpus/{tpl.name}",
                      task=task.prompt, steps=steps, label=label, final_answer=r.final_answer,
                      termination=r.termination, outcome=outcome, reference_answer=task.reference, meta=meta)


def _h(*parts) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest(), "big")


@dataclass
class BuildResult:
    trajectories: list[Trajectory]
    split_of: dict[str, str]
    stats: dict
    out: Path | None = None
    records: dict = field(default_factory=dict)


def _progress(it, enabled: bool, desc: str, total: int | None = None):
    if not enabled:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, total=total, unit="task", leave=False)


def build_corpus(cfg: CorpusConfig, out: str | Path | None, *, seed: int | None = None, progress: bool = False,
                 client=None, judge_client=None) -> BuildResult:
    seed = cfg.seed if seed is None else seed
    sandbox = Sandbox(timeout_s=cfg.sandbox.timeout_s, memory_mb=cfg.sandbox.memory_mb,
                      batch_size=cfg.sandbox.batch_size, workers=cfg.sandbox.workers)
    policy = make_policy(cfg.policy, cfg.slips, client)
    judge = make_judge(cfg.judge, judge_client)
    tasks = load_tasks(cfg, seed)
    precompute_tests(tasks, sandbox)

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
            safe = _traj(task, tpl, r, f"{task.id}/safe", Label("SAFE", "verified_safe"), {"stream": "safe"})
            trajs.append(safe)
            if _h(seed, task.id, "inject?") / 2.0**64 < cfg.injection.fraction:
                t = _inject_one(tpl, task, policy, r, seed, sandbox, cfg, inj_log)
                if t is not None:
                    trajs.append(t)
        else:
            rejections.append({"domain": task.domain, "task": task.id, "predicate": "outcome_equivalence",
                               "reason": f"failed run ({r.termination}): {r.check_reason[:200]}", "step": None})
            d = diagnose(tpl, task, policy, r, judge, seed=seed, sandbox=sandbox, max_steps=cfg.max_steps)
            diag_log.append({"domain": task.domain, "accepted": d.accepted, "reason": d.reason, **d.record})
            if d.accepted:
                label = Label("UNSAFE", "diagnosed", decisive_step=d.step, decisive_agent=d.agent, reason=d.reason,
                              provenance={"failure_type": d.failure_type, "diagnosis": d.record})
                trajs.append(_traj(task, tpl, r, f"{task.id}/diagnosed", label, {"stream": "diagnosed"}))

    trajs.sort(key=lambda t: t.id)
    split_of = assign_splits(trajs, train=cfg.splits.train, val=cfg.splits.val, test=cfg.splits.test, seed=seed)
    trajs = [_with_split(t, split_of[t.family_id]) for t in trajs]
    stats = compute_stats(cfg, seed, trajs, split_of, rejections, inj_log, diag_log, roll_log)
    res = BuildResult(trajs, split_of, stats, records={"rejections": rejections, "injections": inj_log,
                                                       "diagnoses": diag_log, "sandbox_runs": sandbox.n_subprocesses})
    if out is not None:
        out = Path(out)
        export_corpus(trajs, split_of, out, jsonl=cfg.export.jsonl, hf=cfg.export.hf, parquet=cfg.export.parquet,
                      stats=stats)
        (out / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
        (out / "stats.md").write_text(stats_markdown(stats))
        res.out = out
    return res


def _with_split(t: Trajectory, split: str) -> Trajectory:
    return replace(t, meta={**t.meta, "split": split})


def _rollout(tpl, task, policy, seed, sandbox, cfg) -> Rollout:
    return run_rollout(tpl, task, policy, seed=seed, sandbox=sandbox, max_steps=cfg.max_steps)


def _inject_one(tpl, task, policy, safe: Rollout, seed, sandbox, cfg, log: list) -> Trajectory | None:
    """Try up to max_attempts seeded (type, step) draws; keep the first that fails the run."""
    first_slip = min((s["step"] for s in safe.slips), default=len(safe.turns))
    options = [(e, k) for e in cfg.injection.types for k in targets(tpl, task, safe.turns, e) if k < first_slip]
    if not options:
        log.append({"domain": task.domain, "type": None, "outcome": "no_target"})
        return None
    options.sort(key=lambda o: _h(seed, task.id, "draw", o[0], o[1]))
    # spread the attempts over types: the first draw of each type first
    by_type: dict[str, list] = defaultdict(list)
    for o in options:
        by_type[o[0]].append(o)
    # least-kept type (so far, in this domain) first, so kept injections spread over the types
    kept = Counter(x["type"] for x in log if x["domain"] == task.domain and x["outcome"] == "kept")
    order = sorted(by_type, key=lambda e: (kept[e], _h(seed, task.id, "type", e)))
    draws = [by_type[e][n] for n in range(max(map(len, by_type.values()))) for e in order if n < len(by_type[e])]
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
            return _traj(task, tpl, res.rollout, f"{task.id}/injected-{etype}-{k}", label,
                         {"stream": "injected", "injection_type": etype})
    return None


# --------------------------------------------------------------------------- stats

def _rate(a: int, b: int) -> float | None:
    return None if b == 0 else round(a / b, 4)


def compute_stats(cfg, seed, trajs, split_of, rejections, inj_log, diag_log, roll_log) -> dict:
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
                              "counts": {str(k): n for k, n in sorted(ks.items())}},
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
                  "rejections_by_predicate": {p: sum(1 for x in rejections if x["predicate"] == p) for p in PREDICATES}},
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
    return "\n".join(lines) + "\n"
