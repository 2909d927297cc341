"""One evaluation: `evaluate(EvalConfig) -> EvalResult`. `aftraj eval` is a thin command over
it (aftraj/commands/eval.py), and the ablation driver runs that command per row; nothing else
walks a data set and writes the reports.

Steps: read the data (`aftraj.readers`), choose the split (default test where the data has
splits), an optional stratified sample and a limit, refuse runs without gold labels, build the
auditor, walk (strict online unless the auditor is post-hoc) appending each finished walk to
OUT/predictions.jsonl (`--resume` keeps them), then metrics.json with the run's provenance,
report.md, the plots and the content-blind floors beside it. Errors a user can cause are
`UsageError`s (the CLI prints one line, exit 2); an auditor that fails mid-walk is `EvalFailed`
(no report; `aftraj eval` exits 3).

    from eval.run import EvalConfig, evaluate
    res = evaluate(EvalConfig(auditor="rules", data="runs/aftraj-2k", out="runs/rules"))
    res.metrics["overall"]["exact_f1"]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aftraj.errors import UsageError


class EvalFailed(Exception):
    """The auditor failed during the walk (an endpoint down, a prompt over its budget): no report
    was written. Not a user error of the command line: `aftraj eval` exits 3."""


@dataclass
class EvalConfig:
    """Everything that decides an evaluation (the `aftraj eval` flags, same names and defaults)."""

    auditor: str
    data: str
    out: str | Path
    split: str | None = None
    protocol: str = "strict"
    layout: str = "ours"
    parser: str = "strict"
    model: str | None = None
    endpoint: str | None = None
    api_model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = 8
    timeout: float = 120.0
    retries: int = 4
    max_new_tokens: int = 1024
    budget: int | None = None
    decision_threshold: float | None = None   # hf: ALARM iff the decision-token log-odds >= it
    draft_tokens: int | None = None   # hf: canonical-completion tokens verified per forward (0: off)
    decision_finish: str | None = None   # hf: "canonical" finishes the side chosen at the decision token canonically
    mixed_precision: str | None = None   # hf: "bf16"/"auto" runs the forwards under bf16 autocast
    reference_answer: bool = False
    max_in_flight: int = 32
    lookahead: bool = True          # spare rows of a round audit walks' next prefixes (hf; same records)
    all_prefixes: bool = False
    auc_start: int = 0
    limit: int | None = None
    sample: int | None = None
    sample_seed: int = 0
    n_boot: int = 1000
    seed: int = 0
    price_prompt: float | None = None
    price_cached: float | None = None
    price_completion: float | None = None
    progress: bool = True
    resume: bool = False
    emit: str | None = None
    command: str | None = None      # the command line that reproduces it (provenance)

    @classmethod
    def from_namespace(cls, args, **extra) -> "EvalConfig":
        """From `aftraj eval`'s parsed arguments (`--no-progress` -> progress=False)."""
        names = set(cls.__dataclass_fields__) - {"progress", "command"}
        return cls(**{k: getattr(args, k) for k in names if hasattr(args, k)},
                   progress=not getattr(args, "no_progress", False), **extra)


@dataclass
class EvalResult:
    metrics: dict
    out: Path
    predictions: list[dict]
    auditor_label: str
    emitted: dict | None = None            # {"to", "emitted", "failures"} with --emit
    all_calls_failed: str | None = None    # set when every auditor call failed (report written)
    notes: list[str] = field(default_factory=list)


def _stderr(msg: str) -> None:
    print(f"aftraj eval: {msg}", file=sys.stderr)


def select_split(trajs: list, split: str | None, data: str) -> tuple[list, str | None]:
    """The trajectories of `split` (default: test) when the data has splits (meta.split), else
    all of them. Returns (selected, the split used or None)."""
    has = {t.meta.get("split") for t in trajs} - {None}
    if not has:
        if split not in (None, "all"):
            raise UsageError(f"--split {split}: {data} has no splits (no meta.split on its trajectories)")
        return trajs, None
    split = split or "test"
    if split == "all":
        return trajs, "all"
    chosen = [t for t in trajs if t.meta.get("split") == split]
    if not chosen:
        raise UsageError(f"--split {split}: {data} has no trajectory in that split "
                         f"(it has {', '.join(sorted(has))})")
    return chosen, split


def load_eval_data(cfg: EvalConfig) -> tuple[list, str | None]:
    """The trajectories the evaluation walks (split, sample, limit), refusing unlabeled runs."""
    from aftraj.boundary import is_unlabeled
    from aftraj.readers import load_trajectories

    try:
        trajs = load_trajectories(cfg.data)
    except OSError as e:  # a missing or unreadable --data path (bad records raise SchemaError)
        raise UsageError(f"--data {cfg.data}: {e.strerror or e}") from None
    trajs, split = select_split(trajs, cfg.split, cfg.data)
    if cfg.sample is not None:
        from eval.sample import stratified_sample

        if cfg.sample < 1:
            raise UsageError(f"--sample must be >= 1, got {cfg.sample}")
        trajs = stratified_sample(trajs, cfg.sample, cfg.sample_seed)
    if cfg.limit is not None:
        trajs = trajs[: cfg.limit]
    if not trajs:
        raise UsageError(f"no trajectories in {cfg.data}")
    unlabeled = [t.id for t in trajs if is_unlabeled(t)]
    if unlabeled:   # runs imported by an adapter carry a placeholder label: no gold to score against
        raise UsageError(f"{cfg.data}: {len(unlabeled)} of {len(trajs)} trajectories carry no gold "
                         f"label (imported from an agent framework, e.g. {unlabeled[0]!r}); label them first, or "
                         f"audit them with `aftraj fold` / the gateway")
    return trajs, split


def evaluate(cfg: EvalConfig, *, say: Callable[[str], None] = _stderr) -> EvalResult:
    """Walk cfg.data with cfg.auditor and write the reports into cfg.out. `say`: the run's notes
    (resuming, auditor notes) for a person; the CLI prefixes them with `aftraj eval: `."""
    from eval.auditors import available_auditors, get_auditor, parse_spec
    from eval.report import write_report
    from eval.walker import WalkConfig, walk

    out = Path(cfg.out)
    if out.exists() and not out.is_dir():   # before any evaluation starts (issue 23)
        raise UsageError(f"--out {out}: is a file, not a folder; give a folder for the reports")
    if cfg.auc_start < 0:
        raise UsageError(f"--auc-start must be >= 0 (the first step of the per-step AUC), got {cfg.auc_start}")
    name, _ = parse_spec(cfg.auditor)
    if name not in available_auditors():
        raise UsageError(f"unknown auditor {name!r}; available: {', '.join(available_auditors())}")
    try:
        walk_cfg = WalkConfig(protocol=cfg.protocol, max_in_flight=cfg.max_in_flight,
                              all_prefixes=cfg.all_prefixes, parser=cfg.parser, lookahead=cfg.lookahead)
    except ValueError as e:
        raise UsageError(str(e)) from None
    trajs, split = load_eval_data(cfg)
    from eval.resume import PredictionLog

    log = PredictionLog(out, resume_settings(cfg, trajs, split), resume=cfg.resume)
    kw = dict(model=cfg.model, endpoint=cfg.endpoint, api_model=cfg.api_model,
              api_key_env=cfg.api_key_env, concurrency=cfg.concurrency, timeout=cfg.timeout,
              retries=cfg.retries, max_new_tokens=cfg.max_new_tokens, budget=cfg.budget,
              reference_answer=cfg.reference_answer, seed=cfg.seed, data=cfg.data,
              layout=cfg.layout, decision_threshold=cfg.decision_threshold, draft_tokens=cfg.draft_tokens,
              decision_finish=cfg.decision_finish, mixed_precision=cfg.mixed_precision)
    for key in ("decision_threshold", "decision_finish", "mixed_precision"):   # the hf auditor's own flags
        if getattr(cfg, key) is not None and parse_spec(cfg.auditor)[0] != "hf":
            raise UsageError(f"--{key.replace('_', '-')} applies to the hf auditor only, not {cfg.auditor!r}")
    try:
        auditor = get_auditor(cfg.auditor, **{k: v for k, v in kw.items() if v is not None})
    except (ValueError, FileNotFoundError) as e:   # AuditorError is a UsageError (a ValueError)
        raise UsageError(f"{cfg.auditor}: {e}") from None
    emitters = None
    if cfg.emit:     # checked before the walk: an unknown name fails at once
        from aftraj.adapters.emit import from_spec

        try:
            emitters = from_spec(cfg.emit)
        except (ValueError, ImportError) as e:
            raise UsageError(f"--emit {cfg.emit}: {e}") from None
    t0 = time.perf_counter()
    with auditor, log:
        todo = [t for t in trajs if t.id not in log.done]
        if log.done:
            say(f"resuming {cfg.out}: {len(trajs) - len(todo)} of {len(trajs)} trajectories "
                f"already walked, {len(todo)} to go")
        try:
            new = walk(auditor, todo, walk_cfg, progress=cfg.progress,
                       on_record=lambda i, rec: log.write(rec))
        except Exception as e:
            from aftraj.tokens import PromptBudgetError
            from eval.auditors.openai import AuditorError

            if isinstance(e, (AuditorError, PromptBudgetError)):
                raise EvalFailed(f"the auditor failed, no report written: {e}") from e
            raise
        if log.done:   # ids are unique here (resume_settings)
            by_id = {**log.done, **{r["id"]: r for r in new}}
            preds = [by_id[t.id] for t in trajs]
        else:
            preds = new
        expectation = None
        if hasattr(auditor, "analytic_expectation"):
            subsets = sorted({p["subset"] for p in preds})
            overall = auditor.analytic_expectation(trajs)
            if overall is not None:
                expectation = {"overall": overall, "by_subset": {
                    s: auditor.analytic_expectation(
                        [t for t, p in zip(trajs, preds) if p["subset"] == s]) for s in subsets}}
    wall = time.perf_counter() - t0
    prices = None
    if any(x is not None for x in (cfg.price_prompt, cfg.price_cached, cfg.price_completion)):
        prices = {"prompt": cfg.price_prompt or 0.0, "completion": cfg.price_completion or 0.0,
                  "cached": cfg.price_cached if cfg.price_cached is not None else (cfg.price_prompt or 0.0)}
    meta = {"auditor": auditor.label, "auditor_spec": cfg.auditor, "posthoc": auditor.posthoc,
            "strategy": auditor.strategy, "protocol": cfg.protocol, "data": str(cfg.data),
            "confidence_kind": getattr(auditor, "confidence_kind", "probability"),
            "reference_answer_in_prompt": cfg.reference_answer, "all_prefixes": cfg.all_prefixes,
            "model": cfg.model, "endpoint": cfg.endpoint, "wall_s": round(wall, 3),
            "split": split, "n_trajectories": len(trajs), "layout": cfg.layout, "parser": cfg.parser,
            "sample": (None if cfg.sample is None else {"n": cfg.sample, "seed": cfg.sample_seed}),
            "resumed_trajectories": len(trajs) - len(todo)}
    meta["provenance"] = _provenance(cfg)
    notes: list[str] = []
    if hasattr(auditor, "report_notes"):     # what the report must say of these runs (rules: message-only runs)
        notes = meta["auditor_notes"] = auditor.report_notes(trajs)
        for note in notes:
            say(f"note: {note}")
    metrics = write_report(preds, out, meta=meta, n_boot=cfg.n_boot, seed=cfg.seed,
                           prices=prices, expectation=expectation, auc_start=cfg.auc_start)
    from eval.auditors.floors import add_floors_to_report  # the content-blind floors beside it

    add_floors_to_report(out, cfg.data, trajs, auditor_spec=cfg.auditor, seed=cfg.seed)
    res = EvalResult(metrics=metrics, out=out, predictions=preds, auditor_label=auditor.label, notes=notes)
    if emitters:
        from aftraj.adapters.emit import prediction_verdicts

        for p in preds:
            for v in prediction_verdicts(p):
                emitters.emit(v, run_id=p["id"], model=cfg.model or cfg.api_model or auditor.label)
        emitters.flush()
        res.emitted = {"to": cfg.emit, "emitted": emitters.emitted, "failures": emitters.failures}
    calls = metrics["calls"]
    if calls["n"] and calls["errors"] == calls["n"]:
        res.all_calls_failed = (f"every one of the {calls['n']} auditor calls failed "
                                f"(first: {calls['first_error']})")
    return res


def resume_settings(cfg: EvalConfig, trajs: list, split) -> dict:
    """What decides a walk's answers: a resume must match all of it (eval/resume.py)."""
    from eval.resume import ids_digest

    ids = [t.id for t in trajs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        if cfg.resume:
            raise UsageError(f"--resume: {cfg.data} holds trajectory id {dup!r} more than once; "
                             f"a resume matches runs by id")
    c = asdict(cfg)
    settings = {k: c[k] for k in (
        "auditor", "model", "endpoint", "api_model", "max_new_tokens", "budget", "decision_threshold",
        "protocol", "parser", "layout", "reference_answer", "all_prefixes", "seed", "data", "sample", "sample_seed", "limit")}
    for k in ("decision_finish", "mixed_precision"):     # only when set: earlier logs still resume
        if c[k] is not None:
            settings[k] = c[k]
    return {**settings, "split": split, "n_trajectories": len(ids), "trajectory_ids_sha256": ids_digest(ids)}


def _provenance(cfg: EvalConfig) -> dict:
    from eval.provenance import provenance

    c = asdict(cfg)
    settings = {k: c[k] for k in (
        "auditor", "model", "endpoint", "api_model", "max_new_tokens", "budget", "decision_threshold",
        "concurrency",
        "timeout", "retries", "protocol", "reference_answer", "all_prefixes", "max_in_flight",
        "lookahead", "seed", "split", "limit", "layout", "parser", "decision_finish", "mixed_precision")}
    return provenance(command=cfg.command, settings=settings, layout=cfg.layout or "ours")
