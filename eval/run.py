"""One evaluation: `evaluate(EvalConfig) -> EvalResult`. `aftraj eval` is a thin command over
it (aftraj/commands/eval.py), and the ablation driver runs that command per row; nothing else
walks a data set and writes the reports.

Steps: read the data (`aftraj.readers`), choose the split (default test where the data has
splits; `validation` is `val`, as `datasets.Split.VALIDATION` names it), an optional stratified
sample and a limit, refuse runs without gold labels, build the auditor, walk (strict online unless
the auditor is post-hoc) appending each finished walk to OUT/predictions.jsonl and each auditor
answer to OUT/calls.jsonl (`--resume` keeps both: eval/resume.py), then metrics.json with the
run's provenance, report.md, the plots and the content-blind floors beside it. An OUT that
already holds an evaluation is refused unless `resume` or `overwrite` says what to do with it.
`--layout` / `--parser` on an auditor that renders no prompt (`rules`, the heuristics) are
warned about and recorded as not applied (None). Errors a user can cause are `UsageError`s (the
CLI prints one line, exit 2); an auditor that fails mid-walk is `EvalFailed` (no report;
`aftraj eval` exits 3).

`audit(cfg)` is the same walk without gold labels (`aftraj audit`, "score my traces"): the runs
may be unlabeled imports; it writes OUT/verdicts.jsonl (per run: ALARM at step d blaming k̂ and
â, or CONTINUE; and every prefix's verdict) and no metrics.

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
    overwrite: bool = False         # replace an evaluation already in `out` (else refused without resume)
    emit: str | None = None
    tenant: str = "local"           # --emit: the tenant every emitted id is derived from (aftraj.adapters.emit)
    data_format: str | None = None  # audit: an agent framework's export (aftraj.adapters.ADAPTERS); None: aftraj.readers
    command: str | None = None      # the command line that reproduces it (provenance)

    def __post_init__(self) -> None:
        """What can be checked without the data, the auditor or the output folder: a bad value
        is a `UsageError` naming its flag, before anything runs."""
        for flag, v in (("--sample", self.sample), ("--limit", self.limit)):
            if v is not None and v < 1:
                raise UsageError(f"{flag} must be >= 1, got {v}")
        if self.auc_start < 0:
            raise UsageError(f"--auc-start must be >= 0 (the first step of the per-step AUC), got {self.auc_start}")
        if self.resume and self.overwrite:
            raise UsageError("--resume and --overwrite exclude each other: continue the run in --out, or replace it")
        self.walk_config()

    def prices(self) -> dict | None:
        """Per-token prices for the report's cost line (cached tokens at the prompt price unless
        given), or None when no price is set."""
        if all(x is None for x in (self.price_prompt, self.price_cached, self.price_completion)):
            return None
        return {"prompt": self.price_prompt or 0.0, "completion": self.price_completion or 0.0,
                "cached": self.price_cached if self.price_cached is not None else (self.price_prompt or 0.0)}

    def walk_config(self):
        """The walker's settings (`eval.walker.WalkConfig`: protocol, parser, max_in_flight, …)."""
        from eval.walker import WalkConfig

        try:
            return WalkConfig(protocol=self.protocol, max_in_flight=self.max_in_flight,
                              all_prefixes=self.all_prefixes, parser=self.parser, lookahead=self.lookahead)
        except ValueError as e:
            raise UsageError(str(e)) from None

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


# `datasets` names the validation split "validation" (datasets.Split.VALIDATION); our corpus
# writes "val". Every command that takes a split name accepts both and means the same split.
SPLIT_ALIASES = {"validation": "val"}
SPLIT_CHOICES = ("train", "val", "validation", "test", "all")


def split_name(split: str | None) -> str | None:
    """The corpus's name of a split given as `datasets` names it ("validation" -> "val")."""
    return SPLIT_ALIASES.get(split, split) if split is not None else None


def select_split(trajs: list, split: str | None, data: str) -> tuple[list, str | None]:
    """The trajectories of `split` (default: test; "validation" is "val") when the data has splits
    (meta.split), else all of them. Returns (selected, the split used or None)."""
    split = split_name(split)
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


def load_eval_data(cfg: EvalConfig, *, labels: bool = True,
                   say: Callable[[str], None] | None = None) -> tuple[list, str | None]:
    """The trajectories the evaluation walks (split, sample, limit), refusing unlabeled runs
    unless `labels=False` (`audit`). A `--sample` or `--limit` at or above what the data holds is
    said (`say`), not silently read as a sample."""
    from aftraj.boundary import is_unlabeled
    from aftraj.readers import load_trajectories

    try:
        if cfg.data_format is not None:
            from aftraj.adapters import AdapterError, read_runs

            try:
                trajs = read_runs(cfg.data, cfg.data_format)
            except AdapterError as e:
                raise UsageError(f"--data {cfg.data} (--from {cfg.data_format}): {e}") from None
        else:
            trajs = load_trajectories(cfg.data)
    except OSError as e:  # a missing or unreadable --data path (bad records raise SchemaError)
        raise UsageError(f"--data {cfg.data}: {e.strerror or e}") from None
    trajs, split = select_split(trajs, cfg.split, cfg.data)
    where = f"{cfg.data}" + (f" (split {split})" if split not in (None, "all") else "")
    if cfg.sample is not None:
        from eval.sample import stratified_sample

        if cfg.sample >= len(trajs) and say is not None:
            say(f"warning: --sample {cfg.sample}: {where} holds {len(trajs)} trajectories, so all "
                f"{len(trajs)} are evaluated (no sample is drawn)")
        trajs = stratified_sample(trajs, cfg.sample, cfg.sample_seed)
    if cfg.limit is not None:
        if cfg.limit > len(trajs) and say is not None:
            say(f"warning: --limit {cfg.limit}: {where} holds {len(trajs)} trajectories; all are evaluated")
        trajs = trajs[: cfg.limit]
    if not trajs:
        raise UsageError(f"no trajectories in {cfg.data}")
    if not labels:
        return trajs, split
    unlabeled = [t.id for t in trajs if is_unlabeled(t)]
    if unlabeled:   # runs imported by an adapter carry a placeholder label: no gold to score against
        raise UsageError(f"{cfg.data}: {len(unlabeled)} of {len(trajs)} trajectories carry no gold "
                         f"label (imported from an agent framework, e.g. {unlabeled[0]!r}); label them first, or "
                         f"score them without labels with `aftraj audit --auditor {cfg.auditor} --data {cfg.data} "
                         f"--out DIR`")
    return trajs, split


EVAL_OUTPUTS = ("metrics.json", "predictions.jsonl", "report.md", "eval_settings.json", "calls.jsonl",
                "verdicts.jsonl", "audit.json", "audit.md")


def check_out(out: Path, *, resume: bool, overwrite: bool, flag: str = "--out") -> list[str]:
    """Refuse to write into a folder that already holds an evaluation (or an audit) unless the
    caller says `resume` (continue it) or `overwrite` (its files are replaced; calls.jsonl too,
    so no cached answer of the old run is replayed). Returns the files `clear_out` removes once
    everything else is checked and the auditor is built (a failure before leaves the old run)."""
    if out.exists() and not out.is_dir():   # before any evaluation starts (issue 23)
        raise UsageError(f"{flag} {out}: is a file, not a folder; give a folder for the reports")
    held = [f for f in EVAL_OUTPUTS if (out / f).exists()]
    if not held or resume:
        return []
    if not overwrite:
        raise UsageError(f"{flag} {out}: already holds an earlier run's output ({', '.join(held)}); pass --resume to "
                         f"continue it, --overwrite to replace it, or another {flag}")
    return held


def clear_out(out: Path, held: list[str]) -> None:
    for f in held:
        (out / f).unlink(missing_ok=True)


def inert_flags(cfg: EvalConfig, cls, say: Callable[[str], None] | None = None) -> list[str]:
    """The flags this auditor class ignores that the command set away from their defaults, each
    warned about through `say`: `--layout` and `--parser` reach only auditors that render the
    prompt and parse a completion (`eval.auditors.renders_prompt`)."""
    from eval.auditors import renders_prompt

    if renders_prompt(cls):
        return []
    inert = [f"--{k} {getattr(cfg, k)}" for k, default in (("layout", "ours"), ("parser", "strict"))
             if getattr(cfg, k) != default]
    for flag in inert if say is not None else ():
        say(f"warning: {flag} has no effect on the {cls.name} auditor (it renders no prompt and parses "
            f"no completion); recorded as not applied")
    return inert


def call_settings(cfg: EvalConfig) -> dict:
    """What decides one auditor answer, beside the prefix itself: the call cache's key (with the
    prefix's hash). The walk's protocol, parser and sample do not change an answer."""
    c = asdict(cfg)
    return {k: c[k] for k in ("auditor", "model", "endpoint", "api_model", "max_new_tokens", "budget",
                              "decision_threshold", "decision_finish", "mixed_precision", "layout",
                              "reference_answer", "seed", "data")}


def _build(cfg: EvalConfig):
    """(auditor class, walk config, emitters or None, auditor) for cfg, checked before any walk."""
    from eval.auditors import auditor_class, get_auditor, parse_spec

    name, _ = parse_spec(cfg.auditor)
    try:
        cls = auditor_class(name)
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    if str(cfg.model or "").startswith("builtin:"):
        raise UsageError(f"--model {cfg.model}: resolve it to its prepared folder first "
                         f"(`aftraj eval` and `aftraj audit` do: aftraj.models.resolve_model_spec)")
    walk_cfg = cfg.walk_config()
    _check_own_flags(cfg, cls)
    emitters = None
    if cfg.emit:     # checked before the walk: an unknown name fails at once
        from aftraj.adapters.emit import from_spec

        try:
            emitters = from_spec(cfg.emit)
        except (ValueError, ImportError) as e:
            raise UsageError(f"--emit {cfg.emit}: {e}") from None
    return cls, walk_cfg, emitters, lambda: _make_auditor(cfg, get_auditor)


# The EvalConfig fields that reach an auditor as the option of the same name, each only to an
# auditor that takes it (`eval.auditors.accepted_options`) and only when set (not None).
AUDITOR_OPTIONS = ("model", "endpoint", "api_model", "api_key_env", "concurrency", "timeout", "retries",
                   "max_new_tokens", "budget", "reference_answer", "seed", "data", "layout",
                   "decision_threshold", "draft_tokens", "decision_finish", "mixed_precision")
# Of those, the model auditors' own flags: set for an auditor that does not take them, an error.
OWN_FLAGS = ("decision_threshold", "decision_finish", "mixed_precision")


def _check_own_flags(cfg: EvalConfig, cls) -> None:
    from eval.auditors import accepted_options, auditor_class, available_auditors

    for key in OWN_FLAGS:
        if getattr(cfg, key) is not None and key not in accepted_options(cls):
            takes = [n for n in available_auditors() if key in accepted_options(auditor_class(n))]
            raise UsageError(f"--{key.replace('_', '-')} applies to the {' and '.join(takes)} auditors only, "
                             f"not {cfg.auditor!r}")


def auditor_options(cfg: EvalConfig) -> dict:
    """The options cfg gives its auditor: the `AUDITOR_OPTIONS` it takes that are set."""
    from eval.auditors import accepted_options

    takes = accepted_options(cfg.auditor)
    return {k: getattr(cfg, k) for k in AUDITOR_OPTIONS if k in takes and getattr(cfg, k) is not None}


def _make_auditor(cfg: EvalConfig, get_auditor):
    try:
        return get_auditor(cfg.auditor, **auditor_options(cfg))
    except (ValueError, FileNotFoundError) as e:   # AuditorError is a UsageError (a ValueError)
        from eval.auditors.floors import FLOORS, parse_rule

        rule = parse_rule(cfg.auditor)
        hint = (f"; a floor fits on the train split beside --data, or on the one you name: --auditor "
                f"{cfg.auditor.partition(':')[0]}:{rule},train=PATH (a JSONL file, its train records when it "
                f"has splits, or a corpus folder)" if rule in FLOORS else "")
        raise UsageError(f"{cfg.auditor}: {e}{hint} (every auditor's arguments: `aftraj eval --list-auditors "
                         f"{cfg.auditor.partition(':')[0]}`)") from None


def _walk(cfg: EvalConfig, auditor, trajs: list, walk_cfg, log, cache, say,
          shape: Callable[[dict], dict] = lambda rec: rec) -> list[dict]:
    """Walk the trajectories `log` has not kept, through the call cache; the records of all
    (each walker record passed through `shape` before it is written)."""
    from eval.resume import CachedAuditor
    from eval.walker import walk

    todo = [t for t in trajs if t.id not in log.done]
    if log.done or cache.answers:
        say(f"resuming {cfg.out}: {len(trajs) - len(todo)} of {len(trajs)} trajectories already walked, "
            f"{len(todo)} to go; {len(cache.answers)} auditor answers cached in calls.jsonl")
    try:
        shaped: dict[int, dict] = {}

        def write(i: int, rec: dict) -> None:
            shaped[i] = shape(rec)
            log.write(shaped[i])

        new = walk(CachedAuditor(auditor, cache), todo, walk_cfg, progress=cfg.progress, on_record=write)
        new = [shaped.get(i) or shape(r) for i, r in enumerate(new)]
    except Exception as e:
        from aftraj.tokens import PromptBudgetError
        from eval.auditors.openai import AuditorError

        if isinstance(e, (AuditorError, PromptBudgetError)):
            raise EvalFailed(f"the auditor failed, no report written: {e}") from e
        raise
    if cache.hits:
        say(f"{cache.hits} auditor answers replayed from {cache.path}, {cache.misses} asked")
    if log.done:   # ids are unique here (resume_settings)
        by_id = {**log.done, **{r["id"]: r for r in new}}
        return [by_id[t.id] for t in trajs]
    return new


def evaluate(cfg: EvalConfig, *, say: Callable[[str], None] = _stderr) -> EvalResult:
    """Walk cfg.data with cfg.auditor and write the reports into cfg.out. `say`: the run's notes
    (resuming, auditor notes) for a person; the CLI prefixes them with `aftraj eval: `."""
    from eval.floors import add_floors_to_report
    from eval.report import write_report
    from eval.resume import CallCache, PredictionLog

    out = Path(cfg.out)
    stale = check_out(out, resume=cfg.resume, overwrite=cfg.overwrite)
    cls, walk_cfg, emitters, make = _build(cfg)
    inert = inert_flags(cfg, cls, say)
    trajs, split = load_eval_data(cfg, say=say)
    log = PredictionLog(out, resume_settings(cfg, trajs, split), resume=cfg.resume)
    auditor = make()
    clear_out(out, stale)     # --overwrite: the old run's files go once the new one can start
    cache = CallCache(out, call_settings(cfg), keep=cfg.resume)
    t0 = time.perf_counter()
    with auditor, log, cache:
        preds = _walk(cfg, auditor, trajs, walk_cfg, log, cache, say)
        expectation = _expectation(auditor, trajs, preds)
    meta = _report_meta(cfg, cls, auditor, trajs, split, inert, time.perf_counter() - t0,
                        resumed=len(log.done), cached=cache.hits)
    notes = _auditor_notes(auditor, trajs, say)
    if hasattr(auditor, "report_notes"):
        meta["auditor_notes"] = notes
    metrics = write_report(preds, out, meta=meta, n_boot=cfg.n_boot, seed=cfg.seed,
                           prices=cfg.prices(), expectation=expectation, auc_start=cfg.auc_start)
    add_floors_to_report(out, cfg.data, trajs, auditor_spec=cfg.auditor, seed=cfg.seed)   # a report stage
    res = EvalResult(metrics=metrics, out=out, predictions=preds, auditor_label=auditor.label, notes=notes)
    if emitters:
        res.emitted = _emit(emitters, cfg, preds, trajs, auditor.label)
    calls = metrics["calls"]
    if calls["n"] and calls["errors"] == calls["n"]:
        res.all_calls_failed = (f"every one of the {calls['n']} auditor calls failed "
                                f"(first: {calls['first_error']})")
    return res


def _expectation(auditor, trajs: list, preds: list[dict]) -> dict | None:
    """An auditor's analytic expectation of its metrics (`dummy:uniform`), overall and per subset."""
    if not hasattr(auditor, "analytic_expectation"):
        return None
    overall = auditor.analytic_expectation(trajs)
    if overall is None:
        return None
    subsets = sorted({p["subset"] for p in preds})
    return {"overall": overall, "by_subset": {
        s: auditor.analytic_expectation([t for t, p in zip(trajs, preds, strict=True) if p["subset"] == s])
        for s in subsets}}


def _auditor_notes(auditor, trajs: list, say: Callable[[str], None]) -> list[str]:
    """What the report must say of these runs (rules: message-only runs), each also said."""
    notes = auditor.report_notes(trajs) if hasattr(auditor, "report_notes") else []
    for note in notes:
        say(f"note: {note}")
    return notes


def _report_meta(cfg: EvalConfig, cls, auditor, trajs: list, split, inert: list[str], wall: float, *,
                 resumed: int, cached: int) -> dict:
    """metrics.json's description of the run: the auditor, the data, the settings, provenance."""
    applied = renders_prompt_of(cls)
    meta = {"auditor": auditor.label, "auditor_spec": cfg.auditor, "posthoc": auditor.posthoc,
            "strategy": auditor.strategy, "protocol": cfg.protocol, "data": str(cfg.data),
            "confidence_kind": getattr(auditor, "confidence_kind", "probability"),
            "reference_answer_in_prompt": cfg.reference_answer, "all_prefixes": cfg.all_prefixes,
            "model": cfg.model, "endpoint": cfg.endpoint, "wall_s": round(wall, 3),
            "split": split, "n_trajectories": len(trajs),
            "layout": cfg.layout if applied else None, "parser": cfg.parser if applied else None,
            "sample": (None if cfg.sample is None else {"n": cfg.sample, "seed": cfg.sample_seed}),
            "resumed_trajectories": resumed, "cached_calls": cached}
    if inert:
        meta["inert_flags"] = inert
    meta["provenance"] = _provenance(cfg, applied)
    return meta


def _emit(emitters, cfg: EvalConfig, records: list[dict], trajs: list, label: str) -> dict:
    """Every prefix's verdict of `records` (walker records, in the order of `trajs`) to the
    emitters, each on its judged step (the step's own span when the trajectory was read from an
    OTel, OpenInference or Langfuse export: `meta["otel"]`), ids derived from (cfg.tenant, run)."""
    from aftraj.adapters.emit import prediction_verdicts

    for rec, traj in zip(records, trajs, strict=True):
        for v in prediction_verdicts(rec):
            emitters.emit(v, tenant=cfg.tenant, run_id=rec["id"], model=cfg.model or cfg.api_model or label,
                          step=traj.steps[v["t"]])
    emitters.flush()
    return {"to": cfg.emit, "tenant": cfg.tenant, "emitted": emitters.emitted, "failures": emitters.failures}


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


def renders_prompt_of(cls) -> bool:
    from eval.auditors import renders_prompt

    return renders_prompt(cls)


def _provenance(cfg: EvalConfig, applied: bool = True) -> dict:
    from eval.provenance import provenance

    c = asdict(cfg)
    if not applied:     # --layout / --parser never reached this auditor
        c["layout"] = c["parser"] = None
    settings = {k: c[k] for k in (
        "auditor", "model", "endpoint", "api_model", "max_new_tokens", "budget", "decision_threshold",
        "concurrency",
        "timeout", "retries", "protocol", "reference_answer", "all_prefixes", "max_in_flight",
        "lookahead", "seed", "split", "limit", "layout", "parser", "decision_finish", "mixed_precision")}
    # the template the command selected (its hash), even where this auditor renders none
    return provenance(command=cfg.command, settings=settings, layout=cfg.layout or "ours")


# --------------------------------------------------------------------------- audit: no gold labels

VERDICTS_FILE = "verdicts.jsonl"
AUDIT_FILE = "audit.json"
AUDIT_REPORT = "audit.md"


@dataclass
class AuditOutcome:
    verdicts: list[dict]
    out: Path
    auditor_label: str
    summary: dict
    emitted: dict | None = None


def verdict_record(rec: dict) -> dict:
    """A walker record without the gold fields: the run's verdict (ALARM at prefix d blaming step
    k̂ and agent â, or CONTINUE after every prefix asked) and each prefix's verdict."""
    alarm = bool(rec["alarmed"])
    prefixes = [{"t": e["t"], "decision": "ALARM" if e["alarm"] else "CONTINUE",
                 "step": e["k"] if e["alarm"] else None, "agent": e["agent"] if e["alarm"] else None,
                 "confidence": e["confidence"], "decision_log_odds": e["decision_log_odds"],
                 "parse_failure": e["parse_failure"], "error": e["error"], "step_agent": e["step_agent"],
                 "raw": e["raw"]} for e in rec["trace"]]
    return {"id": rec["id"], "source": rec["source"], "domain": rec["domain"], "n_steps": rec["n_steps"],
            "verdict": "ALARM" if alarm else "CONTINUE", "alarm_at": rec["d"],
            "step": rec["k_hat"] if alarm else None, "agent": rec["a_hat"] if alarm else None,
            "reason": rec["reason"] if alarm else None, "confidence": rec["confidence"], "mode": rec["mode"],
            "calls": rec["calls"], "parse_failures": rec["parse_failures"], "errors": rec["errors"],
            "error_kinds": rec["error_kinds"], "first_error": rec["first_error"],
            "prompt_tokens": rec["prompt_tokens"], "completion_tokens": rec["completion_tokens"],
            "cached_tokens": rec["cached_tokens"], "latencies_s": rec["latencies_s"],
            "prefixes": prefixes}


def emitted_view(v: dict) -> dict:
    """A verdict record in the shape `aftraj.adapters.emit.prediction_verdicts` reads."""
    return {"id": v["id"], "d": v["alarm_at"], "reason": v["reason"], "latencies_s": v["latencies_s"],
            "trace": [{"t": e["t"], "alarm": e["decision"] == "ALARM", "k": e["step"], "agent": e["agent"],
                       "confidence": e["confidence"], "parse_failure": e["parse_failure"], "error": e["error"]}
                      for e in v["prefixes"]]}


def audit(cfg: EvalConfig, *, say: Callable[[str], None] = _stderr) -> AuditOutcome:
    """Score runs without gold labels (`aftraj audit`): the strict online walk of cfg.auditor over
    cfg.data (our JSONL, a corpus, Who&When, AFTraj parquet, or with `data_format` an agent
    framework's export), OUT/verdicts.jsonl (one verdict record a run, `verdict_record`, written
    as walks end and rewritten in input order at the end), OUT/audit.json (counts and provenance),
    OUT/audit.md (`write_audit_markdown`) and, with `emit`, every prefix's verdict as an OTel span /
    Langfuse score. Labels, where the data has them, are not read. `resume`, `overwrite` and the
    call cache as for `evaluate`."""
    import json

    from eval.resume import CallCache, PredictionLog

    out = Path(cfg.out)
    stale = check_out(out, resume=cfg.resume, overwrite=cfg.overwrite)
    if cfg.protocol != "strict":
        raise UsageError(f"--protocol {cfg.protocol}: the reference protocol walks a run by its gold label; "
                         f"an audit has none (strict online walk only)")
    cls, walk_cfg, emitters, make = _build(cfg)
    inert = inert_flags(cfg, cls, say)
    trajs, split = load_eval_data(cfg, labels=False, say=say)
    ids = [t.id for t in trajs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise UsageError(f"--data {cfg.data}: trajectory id {dup!r} occurs more than once; verdicts are "
                         f"written by run id")
    log = PredictionLog(out, {**resume_settings(cfg, trajs, split), "mode": "audit"}, resume=cfg.resume,
                        filename=VERDICTS_FILE)
    auditor = make()
    clear_out(out, stale)     # --overwrite: the old run's files go once the new one can start
    cache = CallCache(out, call_settings(cfg), keep=cfg.resume)
    t0 = time.perf_counter()
    with auditor, log, cache:
        verdicts = _walk(cfg, auditor, trajs, walk_cfg, log, cache, say, shape=verdict_record)
        notes = auditor.report_notes(trajs) if hasattr(auditor, "report_notes") else []
    for note in notes:
        say(f"note: {note}")
    (out / VERDICTS_FILE).write_text("".join(json.dumps(v, ensure_ascii=False) + "\n" for v in verdicts),
                                     encoding="utf-8")
    alarms = [v for v in verdicts if v["verdict"] == "ALARM"]
    by_agent: dict[str, int] = {}
    for v in alarms:
        by_agent[str(v["agent"])] = by_agent.get(str(v["agent"]), 0) + 1
    applied = renders_prompt_of(cls)
    summary = {"auditor": auditor.label, "auditor_spec": cfg.auditor, "posthoc": auditor.posthoc,
               "data": str(cfg.data), "data_format": cfg.data_format, "split": split,
               "n_runs": len(verdicts), "n_alarm": len(alarms), "n_continue": len(verdicts) - len(alarms),
               "alarms_by_agent": dict(sorted(by_agent.items(), key=lambda kv: (-kv[1], kv[0]))),
               "calls": sum(v["calls"] for v in verdicts), "cached_calls": cache.hits,
               "parse_failures": sum(v["parse_failures"] for v in verdicts),
               "errors": sum(v["errors"] for v in verdicts), "all_prefixes": cfg.all_prefixes,
               "layout": cfg.layout if applied else None, "parser": cfg.parser if applied else None,
               "wall_s": round(time.perf_counter() - t0, 3), "auditor_notes": notes,
               "provenance": _provenance(cfg, applied)}
    if inert:
        summary["inert_flags"] = inert
    res = AuditOutcome(verdicts=verdicts, out=out, auditor_label=auditor.label, summary=summary)
    if emitters:
        res.emitted = summary["emitted"] = _emit(emitters, cfg, [emitted_view(v) for v in verdicts], trajs,
                                                 auditor.label)
    (out / AUDIT_FILE).write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    write_audit_markdown(summary, verdicts, out / AUDIT_REPORT)
    return res


def md_cell(v, n: int = 200) -> str:
    """A value as one Markdown table cell: one line, `|` escaped, at most n characters."""
    text = " ".join(str(v if v is not None else "–").split()).replace("|", "\\|")
    return text if len(text) <= n else text[: n - 1] + "…"


def write_audit_markdown(summary: dict, verdicts: list[dict], path: Path) -> None:
    """audit.md: the counts, the alarms by agent and one row per ALARM (run, prefix, blamed step
    and agent, reason), for a person; verdicts.jsonl holds everything."""
    s = summary
    lines = [f"# Audit: {s['auditor']}", "",
             f"- data: `{s['data']}`" + (f" (read as {s['data_format']})" if s.get("data_format") else "")
             + (f", split {s['split']}" if s.get("split") else "") + "; no gold labels read",
             f"- {s['n_runs']} runs: **{s['n_alarm']} ALARM**, {s['n_continue']} CONTINUE "
             f"({'every prefix scored' if s['all_prefixes'] else 'strict online walk: the first ALARM ends a run'})",
             f"- {s['calls']} auditor calls ({s['cached_calls']} replayed from calls.jsonl), "
             f"{s['parse_failures']} parse failures (each counts as CONTINUE), {s['errors']} endpoint errors",
             *([f"- note: {n}" for n in s.get("auditor_notes") or []]),
             *([f"- not applied (this auditor renders no prompt): {', '.join(s['inert_flags'])}"]
               if s.get("inert_flags") else []), ""]
    if s["alarms_by_agent"]:
        lines += ["## Alarms by blamed agent", "", "| agent | ALARMs |", "|---|---|"]
        lines += [f"| {md_cell(a)} | {n} |" for a, n in s["alarms_by_agent"].items()]
        lines.append("")
        lines += ["## Runs that raised an ALARM", "", "| run | at prefix | blamed step | agent | reason |",
                  "|---|---|---|---|---|"]
        lines += [f"| {md_cell(v['id'])} | {v['alarm_at']} | {v['step']} | {md_cell(v['agent'])} | "
                  f"{md_cell(v['reason'] or '')} |" for v in verdicts if v["verdict"] == "ALARM"]
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
