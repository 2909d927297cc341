"""`aftraj eval --auditor NAME[:ARG] --data PATH --out DIR [--split S] [--protocol strict|reference]
[--model PATH | --endpoint URL]` and `aftraj eval compare RUN_DIR… --out DIR`

Walk every trajectory of PATH (a JSONL file, a corpus folder, a Who&When folder or an AFTraj
parquet folder; on data with splits, the test split unless --split says otherwise) with the
auditor (strict online walk unless the auditor is post-hoc), then write metrics.json (with the
run's provenance), predictions.jsonl (every raw completion), report.md and the plots that can be
drawn into DIR. `compare` puts finished runs side by side (eval/compare.py).

    aftraj eval --auditor heuristic:uniform-random --data who_and_when --out runs/ww-random
    aftraj eval --auditor rules --data runs/aftraj-2k --out runs/rules          # test split
    aftraj eval compare runs/ww-random runs/ww-rules --out runs/compare
    aftraj eval --auditor hf --model runs/stage1/final --data heldout.jsonl --out runs/eval-hf
    aftraj eval --auditor openai --endpoint http://127.0.0.1:8000/v1 --api-model auditor \
        --data who_and_when --out runs/ww-vllm
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from aftraj.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate an auditor (strict online walk) and write reports; "
                                    "`eval compare RUN_DIR…` puts runs side by side")
    p.add_argument("compare", nargs="*", metavar="compare RUN_DIR",
                   help="`aftraj eval compare RUN_DIR… --out DIR`: one table (Markdown + CSV) and "
                        "one plot with intervals across finished runs")
    p.add_argument("--auditor", metavar="NAME[:ARG]",
                   help="dummy:gold, heuristic:uniform-random, hf, openai[:METHOD], rules, … (required)")
    p.add_argument("--data", help="JSONL file, corpus folder, Who&When folder or AFTraj parquet folder (required)")
    p.add_argument("--split", choices=("train", "val", "test", "all"),
                   help="which split of data that has splits (a corpus folder, AFTraj with "
                        "splits_test.json); default: test. Data without splits is used whole")
    p.add_argument("--out", required=True, help="output folder for the reports")
    p.add_argument("--protocol", choices=("strict", "reference"), default="strict",
                   help="strict: every trajectory walked prefix by prefix (default); reference: "
                        "safe trajectories get one full-trajectory call, as the released evaluation")
    p.add_argument("--layout", choices=("ours", "reference"), default="ours",
                   help="prompt layout: ours (default; prefix-cache friendly, never cuts) or "
                        "reference (the released evaluation's: header before the steps, contents "
                        "cut at 2,000 characters), to compare with the paper's table")
    p.add_argument("--parser", choices=("strict", "reference"), default="strict",
                   help="strict: the contract's parser (default); reference: the released "
                        "evaluation's acceptance rules (aftraj/reference_parse.py: no <think> needed, "
                        "text around the answer, \"safe\", \"2\", 2.0, null agent, a step after the "
                        "prefix), to compare with the paper's table. Reports count the strict parse "
                        "failures the reference rules accept either way")
    p.add_argument("--model", help="local model folder (hf backend)")
    p.add_argument("--endpoint", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-model", help="model name to send to the endpoint (default: its first model)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the API key (default OPENAI_API_KEY)")
    p.add_argument("--concurrency", type=int, default=8, help="openai: parallel requests")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="openai: total deadline per call in seconds (retries included)")
    p.add_argument("--retries", type=int, default=4, help="openai: retries per call")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="generation budget per call")
    p.add_argument("--budget", type=int, help="prompt token budget (the fold's view beyond it)")
    p.add_argument("--reference-answer", action="store_true",
                   help="show the ground-truth answer in the prompt (Who&When 'with ground truth')")
    p.add_argument("--max-in-flight", type=int, default=32, help="trajectories walked at once")
    p.add_argument("--all-prefixes", action="store_true",
                   help="score every prefix (go on after the first ALARM): threshold sweep, AUC")
    p.add_argument("--auc-start", type=int, default=0,
                   help="first step of the per-step stratified ROC AUC (score auditors)")
    p.add_argument("--limit", type=int, help="evaluate only the first N trajectories")
    p.add_argument("--sample", type=int, metavar="N",
                   help="evaluate a stratified, seeded sample of N trajectories (by domain, subset and "
                        "gold verdict; eval/sample.py), after --split")
    p.add_argument("--sample-seed", type=int, default=0, help="seed of --sample (default 0)")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap and random-baseline seed")
    p.add_argument("--price-prompt", type=float, help="USD per million uncached prompt tokens")
    p.add_argument("--price-cached", type=float, help="USD per million cached prompt tokens")
    p.add_argument("--price-completion", type=float, help="USD per million completion tokens")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress (else a bar on a terminal, a line every few seconds in a log)")
    p.add_argument("--resume", action="store_true",
                   help="keep the trajectories already in OUT/predictions.jsonl (written as walks end) "
                        "and walk only the others; the settings must be the same (eval/resume.py)")
    p.add_argument("--emit", metavar="otel,langfuse",
                   help="also emit every prefix's verdict as an OpenTelemetry span and/or a Langfuse score "
                        "(aftraj/adapters/emit.py; configured by the OTEL_* / LANGFUSE_* environment)")
    p.set_defaults(func=run, _parser=p)


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


def run(args) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():   # before any evaluation starts (issue 23)
        raise UsageError(f"--out {out}: is a file, not a folder; give a folder for the reports")
    if args.auc_start < 0:
        raise UsageError(f"--auc-start must be >= 0 (the first step of the per-step AUC), got {args.auc_start}")
    if args.compare:
        if args.compare[0] != "compare" or len(args.compare) < 2:
            print("aftraj eval: positional arguments are only for `aftraj eval compare RUN_DIR… "
                  "--out DIR`", file=sys.stderr)
            return 2
        from eval.compare import compare_runs

        written = compare_runs([Path(d) for d in args.compare[1:]], Path(args.out))
        for w in written.pop("warnings", []):
            print(f"aftraj eval compare: warning: {w}", file=sys.stderr)
        for k, v in written.items():
            print(f"{k}: {v}")
        return 0
    for opt in ("auditor", "data"):
        if getattr(args, opt) is None:
            print(f"aftraj eval: --{opt} is required", file=sys.stderr)
            return 2
    return _run_eval(args)


def _run_eval(args) -> int:
    from aftraj.prompt import PromptBudgetError
    from aftraj.readers import load_trajectories
    from eval.auditors import available_auditors, get_auditor, parse_spec
    from eval.auditors.openai import AuditorError
    from eval.report import write_report
    from eval.walker import WalkConfig, walk

    name, _ = parse_spec(args.auditor)
    if name not in available_auditors():
        print(f"aftraj eval: unknown auditor {name!r}; available: {', '.join(available_auditors())}",
              file=sys.stderr)
        return 2
    try:
        cfg = WalkConfig(protocol=args.protocol, max_in_flight=args.max_in_flight,
                         all_prefixes=args.all_prefixes, parser=args.parser)
    except ValueError as e:
        print(f"aftraj eval: {e}", file=sys.stderr)
        return 2
    try:
        trajs = load_trajectories(args.data)
    except OSError as e:  # a missing or unreadable --data path (bad records raise SchemaError)
        print(f"aftraj eval: --data {args.data}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:
        trajs, split = select_split(trajs, args.split, args.data)
    except ValueError as e:
        print(f"aftraj eval: {e}", file=sys.stderr)
        return 2
    if args.sample is not None:
        from eval.sample import stratified_sample

        if args.sample < 1:
            print(f"aftraj eval: --sample must be >= 1, got {args.sample}", file=sys.stderr)
            return 2
        trajs = stratified_sample(trajs, args.sample, args.sample_seed)
    if args.limit is not None:
        trajs = trajs[: args.limit]
    if not trajs:
        print(f"aftraj eval: no trajectories in {args.data}", file=sys.stderr)
        return 2
    from aftraj.adapters.base import is_unlabeled

    unlabeled = [t.id for t in trajs if is_unlabeled(t)]
    if unlabeled:   # runs imported by an adapter carry a placeholder label: no gold to score against
        print(f"aftraj eval: {args.data}: {len(unlabeled)} of {len(trajs)} trajectories carry no gold "
              f"label (imported from an agent framework, e.g. {unlabeled[0]!r}); label them first, or "
              f"audit them with `aftraj fold` / the gateway", file=sys.stderr)
        return 2
    from eval.resume import PredictionLog

    log = PredictionLog(Path(args.out), _resume_settings(args, trajs, split), resume=args.resume)
    kw = dict(model=args.model, endpoint=args.endpoint, api_model=args.api_model,
              api_key_env=args.api_key_env, concurrency=args.concurrency, timeout=args.timeout,
              retries=args.retries, max_new_tokens=args.max_new_tokens, budget=args.budget,
              reference_answer=args.reference_answer, seed=args.seed, data=args.data,
              layout=args.layout)
    try:
        auditor = get_auditor(args.auditor, **{k: v for k, v in kw.items() if v is not None})
    except (ValueError, FileNotFoundError, AuditorError) as e:
        print(f"aftraj eval: {args.auditor}: {e}", file=sys.stderr)
        return 2
    emitters = None
    if getattr(args, "emit", None):     # checked before the walk: an unknown name fails at once
        from aftraj.adapters.emit import from_spec

        try:
            emitters = from_spec(args.emit)
        except (ValueError, ImportError) as e:
            print(f"aftraj eval: --emit {args.emit}: {e}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    with auditor, log:
        todo = [t for t in trajs if t.id not in log.done]
        if log.done:
            print(f"aftraj eval: resuming {args.out}: {len(trajs) - len(todo)} of {len(trajs)} trajectories "
                  f"already walked, {len(todo)} to go", file=sys.stderr)
        try:
            new = walk(auditor, todo, cfg, progress=not args.no_progress,
                       on_record=lambda i, rec: log.write(rec))
        except (AuditorError, PromptBudgetError) as e:
            print(f"aftraj eval: the auditor failed, no report written: {e}", file=sys.stderr)
            return 3
        if log.done:   # ids are unique here (_resume_settings)
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
    if any(x is not None for x in (args.price_prompt, args.price_cached, args.price_completion)):
        prices = {"prompt": args.price_prompt or 0.0, "completion": args.price_completion or 0.0,
                  "cached": args.price_cached if args.price_cached is not None else (args.price_prompt or 0.0)}
    meta = {"auditor": auditor.label, "auditor_spec": args.auditor, "posthoc": auditor.posthoc,
            "strategy": auditor.strategy, "protocol": args.protocol, "data": str(args.data),
            "confidence_kind": getattr(auditor, "confidence_kind", "probability"),
            "reference_answer_in_prompt": args.reference_answer, "all_prefixes": args.all_prefixes,
            "model": args.model, "endpoint": args.endpoint, "wall_s": round(wall, 3),
            "split": split, "n_trajectories": len(trajs), "layout": args.layout, "parser": args.parser,
            "sample": (None if args.sample is None else {"n": args.sample, "seed": args.sample_seed}),
            "resumed_trajectories": len(trajs) - len(todo)}
    meta["provenance"] = _provenance(args)
    if hasattr(auditor, "report_notes"):     # what the report must say of these runs (rules: message-only runs)
        meta["auditor_notes"] = auditor.report_notes(trajs)
        for note in meta["auditor_notes"]:
            print(f"aftraj eval: note: {note}", file=sys.stderr)
    metrics = write_report(preds, Path(args.out), meta=meta, n_boot=args.n_boot, seed=args.seed,
                           prices=prices, expectation=expectation, auc_start=args.auc_start)
    from eval.auditors.floors import add_floors_to_report  # the content-blind floors beside it

    add_floors_to_report(Path(args.out), args.data, trajs, auditor_spec=args.auditor, seed=args.seed)
    _print_summary(metrics, Path(args.out))
    if emitters:
        from aftraj.adapters.emit import prediction_verdicts

        for p in preds:
            for v in prediction_verdicts(p):
                emitters.emit(v, run_id=p["id"], model=args.model or args.api_model or auditor.label)
        emitters.flush()
        print(f"emitted {emitters.emitted} verdicts to {args.emit} ({emitters.failures} failures)")
    calls = metrics["calls"]
    if calls["n"] and calls["errors"] == calls["n"]:
        print(f"aftraj eval: every one of the {calls['n']} auditor calls failed "
              f"(first: {calls['first_error']})", file=sys.stderr)
        return 3
    if args.model:   # a checkpoint of ours: its model card gains this evaluation
        from training.model_card import record_eval

        card = record_eval(Path(args.model), metrics, args.out)
        if card is not None:
            print(f"model card updated: {card}")
    return 0


def _print_summary(m: dict, out: Path) -> None:
    from eval.report import call_line
    def pct(v):
        return "–" if v is None else f"{100 * v:.2f}%"

    def ci(v):
        return "" if not v else f" [{pct(v[0])}, {pct(v[1])}]"

    exp = m.get("analytic_expectation") or {}
    print(f"{m['auditor']}  protocol={m['protocol']}  metrics v{m['metrics_version']}")
    rows = [("overall", m["overall"], exp.get("overall"))] + [
        (k, v, (exp.get("by_subset") or {}).get(k)) for k, v in m["by_subset"].items()]
    for name, g, e in rows:
        line = (f"  {name:<22} n={g['n']:<4} step_acc={pct(g['step_acc'])}{ci(g['step_acc_ci'])}  "
                f"agent_acc={pct(g['agent_acc'])}{ci(g['agent_acc_ci'])}  exact_f1={pct(g['exact_f1'])}  "
                f"far={pct(g['far'])}  ww_substring_step_acc={pct(g['ww_substring_step_acc'])}")
        print(line)
        if e:
            print(f"  {'':<22} analytic expectation: step_acc={pct(e['step_acc'])} "
                  f"agent_acc={pct(e['agent_acc'])} exact_f1={pct(e['exact_f1'])}")
    print(call_line(m.get("calls") or {}))
    drawn = (m.get("plots") or {}).get("written") or []
    print(f"reports: {out}/metrics.json predictions.jsonl report.md {' '.join(drawn)}")
    for name, why in ((m.get("plots") or {}).get("not_drawn") or {}).items():
        print(f"  {name} not drawn: {why}")
    sys.stdout.flush()


def _resume_settings(args, trajs: list, split) -> dict:
    """What decides a walk's answers: a resume must match all of it (eval/resume.py)."""
    from eval.resume import ids_digest

    ids = [t.id for t in trajs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        if args.resume:
            raise UsageError(f"--resume: {args.data} holds trajectory id {dup!r} more than once; "
                             f"a resume matches runs by id")
    settings = {k: getattr(args, k, None) for k in (
        "auditor", "model", "endpoint", "api_model", "max_new_tokens", "budget", "protocol", "parser",
        "layout", "reference_answer", "all_prefixes", "seed", "data", "sample", "sample_seed", "limit")}
    return {**settings, "split": split, "n_trajectories": len(ids), "trajectory_ids_sha256": ids_digest(ids)}


def _provenance(args) -> dict:
    from eval.provenance import command_line, provenance

    settings = {k: getattr(args, k, None) for k in (
        "auditor", "model", "endpoint", "api_model", "max_new_tokens", "budget", "concurrency",
        "timeout", "retries", "protocol", "reference_answer", "all_prefixes", "max_in_flight",
        "seed", "split", "limit", "layout", "parser")}
    return provenance(command=command_line(args, args._parser, "aftraj eval"), settings=settings,
                      layout=getattr(args, "layout", None) or "ours")
