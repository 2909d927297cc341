"""`aftraj eval --auditor NAME[:ARG] --data PATH --out DIR [--split S] [--protocol strict|reference]
[--model PATH | --endpoint URL]` and `aftraj eval compare RUN_DIR… --out DIR`

Walk every trajectory of PATH (a JSONL file, a corpus folder, a Who&When folder or an AFTraj
parquet folder; on data with splits, the test split unless --split says otherwise) with the
auditor (strict online walk unless the auditor is post-hoc), then write metrics.json (with the
run's provenance), predictions.jsonl (every raw completion), report.md and the plots that can be
drawn into DIR (eval/run.py: `evaluate(EvalConfig)`, the one evaluation; this command only maps
its flags). `--update-model-card` adds the result to the --model folder's model card.
An --out that holds a run is refused unless `--resume` (continue it: finished walks and every
cached call in OUT/calls.jsonl are kept) or `--overwrite`. `--list-auditors [NAME]` lists the
registry's auditors with their documented arguments (lm-eval's `ls`); `--model builtin:NAME` is a
model prepared locally (aftraj.models); `--split validation` is `val`. Runs without gold labels:
`aftraj audit` (aftraj/commands/audit.py).
`compare` puts finished runs side by side (eval/compare.py). `tune-threshold` chooses the hf
auditor's `--decision-threshold` on a validation walk with `--all-prefixes` (a short
`--max-new-tokens` suffices: the decision token comes first).

    aftraj eval --list-auditors
    aftraj eval --auditor heuristic:uniform-random --data who_and_when --out runs/ww-random
    aftraj eval --auditor rules --data runs/aftraj-2k --out runs/rules          # test split
    aftraj eval compare runs/ww-random runs/ww-rules --out runs/compare
    aftraj eval --auditor hf --model M --data runs/aftraj-2k --split val --all-prefixes --max-new-tokens 8 --out runs/val-M
    aftraj eval tune-threshold runs/val-M --max-far 0.2        # prints the threshold for --decision-threshold
    aftraj eval tune-threshold runs/prefixes                   # an every-prefix run's held-out val rows
    aftraj eval --auditor hf --model runs/stage1/final --data heldout.jsonl --out runs/eval-hf --update-model-card
    aftraj eval --auditor openai --endpoint http://127.0.0.1:8000/v1 --api-model auditor \
        --data who_and_when --out runs/ww-vllm
"""

from __future__ import annotations

import sys
from pathlib import Path

from aftraj.errors import UsageError
from eval.run import SPLIT_CHOICES


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate an auditor (strict online walk) and write reports; "
                                    "`eval compare RUN_DIR…` puts runs side by side")
    actions = p.add_subparsers(dest="action", metavar="compare|tune-threshold")
    c = actions.add_parser("compare", help="one table (Markdown + CSV) and one plot with intervals "
                                           "across finished runs (eval/compare.py)")
    c.add_argument("runs", nargs="+", metavar="RUN_DIR", help="folders written by `aftraj eval`")
    c.add_argument("--out", required=True, help="output folder for the comparison")
    c.set_defaults(func=run_compare, _parser=c)
    t = actions.add_parser("tune-threshold", help="the ALARM threshold for a tune split's walk with "
                                                  "--all-prefixes: the best Exact-F1 within a FAR bound "
                                                  "(eval.metrics.pick_threshold)")
    t.add_argument("run", metavar="RUN_DIR", help="a folder written by `aftraj eval --all-prefixes` on a "
                                                  "validation split (never the test split), or an "
                                                  "`aftraj train prefixes` run with heldout_split: val "
                                                  "(its held-out rows, RUN/heldout.jsonl)")
    t.add_argument("--key", choices=("decision_log_odds", "confidence"), default="decision_log_odds",
                   help="decision_log_odds (default; then `--decision-threshold`) or confidence (P(UNSAFE))")
    t.add_argument("--max-far", type=float, default=0.2, help="the FAR bound (default 0.2, the deployable region)")
    t.add_argument("--out", help="also write the choice and the sweep to this JSON file")
    t.set_defaults(func=run_tune_threshold, _parser=t)
    add_walk_args(p)
    p.set_defaults(func=run, _parser=p)


def add_walk_args(p, *, audit: bool = False) -> None:
    """The flags `aftraj eval` and `aftraj audit` share (one definition); `audit` leaves out those
    that need gold labels (protocol, bootstrap, sample strata, AUC, model card)."""
    _data_args(p, audit)
    _backend_args(p)
    _decision_args(p)
    _walk_args(p, audit)
    _output_args(p, audit)


def _data_args(p, audit: bool) -> None:
    """What is audited and how it is read: the auditor, the data, its split, the output folder,
    the walk's protocol, the prompt layout, the parser."""
    p.add_argument("--auditor", metavar="NAME[:ARG]",
                   help="dummy:gold, heuristic:uniform-random, hf, openai[:METHOD], rules, … (required); "
                        "the content-blind floors (heuristic:position-prior, heuristic:length, …) fit on the "
                        "train split beside --data, or on a file or folder you name: "
                        "heuristic:length,train=PATH. Every auditor with its arguments: --list-auditors")
    p.add_argument("--list-auditors", nargs="?", const="", metavar="NAME",
                   help="list the registered auditors with their documented arguments and exit "
                        "(with NAME: that auditor's whole documentation)")
    p.add_argument("--data", help="JSONL file, corpus folder, Who&When folder or AFTraj parquet folder (required)")
    p.add_argument("--split", choices=SPLIT_CHOICES,
                   help="which split of data that has splits (a corpus folder, AFTraj with "
                        "splits_test.json); default: test. validation is val (the name "
                        "datasets.Split.VALIDATION uses). Data without splits is used whole")
    p.add_argument("--out", help="output folder for the reports (required)")
    if not audit:
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


def _backend_args(p) -> None:
    """The model behind the auditor: a folder, an endpoint and its client's settings, budgets."""
    p.add_argument("--model", help="hf: a local model folder, or builtin:NAME (tiny-qwen2, smollm2-135m: "
                                   "prepared locally, as `aftraj models prepare` does); openai: the served "
                                   "model's folder, for its tokenizer")
    p.add_argument("--endpoint", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-model", help="model name to send to the endpoint (default: its first model)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the API key (default OPENAI_API_KEY)")
    p.add_argument("--concurrency", type=int, default=8, help="openai: parallel requests")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="openai: total deadline per call in seconds (retries included)")
    p.add_argument("--retries", type=int, default=4, help="openai: retries per call")
    p.add_argument("--max-new-tokens", type=int, default=1024,
                   help="generation budget per call (hf-steps: the reason generated on a crossing, at most 256; "
                        "0: no reason, the score's line: the walk's metrics do not read it)")
    p.add_argument("--budget", type=int, help="prompt token budget (the fold's view beyond it)")


def _decision_args(p) -> None:
    """The model auditors' own decoding flags (hf, hf-steps, vllm-steps); the reference answer."""
    p.add_argument("--decision-threshold", type=float, metavar="LOG_ODDS",
                   help="hf: at the decision token choose ALARM iff log p(ALARM) - log p(SAFE) >= this "
                        "(tune it on a validation walk: `aftraj eval tune-threshold`); default: greedy. "
                        "hf-steps, vllm-steps: instead of the threshold stored with the checkpoint")
    p.add_argument("--decision-finish", choices=("model", "canonical"),
                   help="hf: after the decision token, 'model' (default) lets the model write the rest; "
                        "'canonical' writes the canonical completion of the side chosen there (SAFE, or "
                        "ALARM at step t blaming step t's agent): for a row trained on the decision token only")
    p.add_argument("--mixed-precision", choices=("no", "bf16", "auto"),
                   help="hf, hf-steps: run the forwards under bf16 autocast (float32 weights); auto: where the device "
                        "computes bf16 natively (a CUDA GPU, a CPU with AVX512-BF16/AMX); default float32 "
                        "(a threshold tuned in one precision is read in the same one; bf16 moves the decision "
                        "log-odds by more than a post-vs-twin gap: see aftraj probe --help)")
    p.add_argument("--draft-tokens", type=int, metavar="N",
                   help="hf: verify up to N tokens of the canonical SAFE/ALARM completion per forward "
                        "(greedy speculative decoding: the same tokens, fewer forwards; 0 turns it off; default 64)")
    p.add_argument("--reference-answer", action="store_true",
                   help="show the ground-truth answer in the prompt (Who&When 'with ground truth')")


def _walk_args(p, audit: bool) -> None:
    """How the runs are walked and scored: in flight, lookahead, every prefix, limit, sample,
    bootstrap, seed, prices."""
    p.add_argument("--max-in-flight", type=int, default=32, help="trajectories walked at once")
    p.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                   help="hf: leave a round's spare rows empty instead of auditing the live walks' next "
                        "prefixes ahead (the records are the same either way; this measures the gain)")
    p.add_argument("--all-prefixes", action="store_true",
                   help="score every prefix (go on after the first ALARM): threshold sweep, AUC")
    if not audit:
        p.add_argument("--auc-start", type=int, default=0,
                       help="first step of the per-step stratified ROC AUC (score auditors)")
    p.add_argument("--limit", type=int, help="evaluate only the first N trajectories")
    if not audit:
        p.add_argument("--sample", type=int, metavar="N",
                       help="evaluate a stratified, seeded sample of N trajectories (by domain, subset and "
                            "gold verdict; eval/sample.py), after --split")
    if not audit:
        p.add_argument("--sample-seed", type=int, default=0, help="seed of --sample (default 0)")
    if not audit:
        p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap and random-baseline seed")
    if not audit:
        p.add_argument("--price-prompt", type=float, help="USD per million uncached prompt tokens")
    if not audit:
        p.add_argument("--price-cached", type=float, help="USD per million cached prompt tokens")
    if not audit:
        p.add_argument("--price-completion", type=float, help="USD per million completion tokens")


def _output_args(p, audit: bool) -> None:
    """Progress, resume or overwrite, emitting the verdicts, the model card."""
    p.add_argument("--no-progress", action="store_true",
                   help="no progress (else a bar on a terminal, a line every few seconds in a log)")
    p.add_argument("--resume", action="store_true",
                   help="keep the trajectories already in OUT/predictions.jsonl (aftraj audit: verdicts.jsonl; "
                        "written as walks end) "
                        "and the auditor answers in OUT/calls.jsonl (written as each call returns), and "
                        "ask only for the rest; the settings must be the same (eval/resume.py)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the evaluation already in OUT (without --resume or --overwrite an OUT "
                        "holding one is refused)")
    p.add_argument("--emit", metavar="otel,langfuse",
                   help="also emit every prefix's verdict as an OpenTelemetry span and/or a Langfuse score "
                        "(aftraj/adapters/emit.py; configured by the OTEL_* / LANGFUSE_* environment)")
    p.add_argument("--tenant", default="local",
                   help="--emit: the tenant every emitted trace, span and score id is derived from (default local)")
    if not audit:
        p.add_argument("--update-model-card", action="store_true",
                       help="add this evaluation to the model card (README.md) of the --model folder "
                            "(a checkpoint of ours); without it no file outside --out is written")

def run_compare(args) -> int:
    from eval.compare import compare_runs

    written = compare_runs([Path(d) for d in args.runs], Path(args.out))
    for w in written.pop("warnings", []):
        print(f"aftraj eval compare: warning: {w}", file=sys.stderr)
    for k, v in written.items():
        print(f"{k}: {v}")
    return 0


def run_tune_threshold(args) -> int:
    import json

    from eval.metrics import pick_threshold, threshold_sweep

    if not 0 <= args.max_far <= 1:
        raise UsageError(f"--max-far must be in [0, 1], got {args.max_far}")
    path = Path(args.run) / "predictions.jsonl"
    control = None
    if not path.is_file() and (Path(args.run) / "heldout.jsonl").is_file():
        path, preds, control = _heldout_rows(Path(args.run), args.key)
    elif not path.is_file():
        raise UsageError(f"{path}: no such file (RUN_DIR is a folder written by `aftraj eval`, or an "
                         f"`aftraj train prefixes` run with a heldout_split)")
    else:
        preds = _read_jsonl(path)
    sweep = threshold_sweep(preds, key=args.key)
    if sweep is None:
        raise UsageError(f"{path}: no {args.key} on every prefix; walk the tune split with --all-prefixes "
                         f"(and the hf auditor for decision_log_odds)")
    pick = pick_threshold(sweep, args.max_far)
    if pick is None:
        raise UsageError(f"{path}: no threshold has an Exact-F1 (the split holds no unsafe run)")
    within = pick["far"] is None or pick["far"] <= args.max_far
    print(f"threshold {pick['threshold']}: Exact-F1 {pick['exact_f1']}, FAR {pick['far']}, Step-Acc "
          f"{pick['step_acc']} on {len(preds)} runs" + ("" if within else f" (no threshold reaches FAR <= {args.max_far})"))
    if control is not None:
        def share(b: dict) -> str:
            return "n/a" if b["share"] is None else f"{b['share']:.3f} {[round(x, 3) for x in b['ci']]}"
        after, before = control["after"]["post_beats_twin"], control["before"]["post_beats_twin"]
        print(f"post beats twin on {after['n']} held-out pairs: {share(after)} (before training: {share(before)}; "
              f"a content-blind model: 0.5)")
    if args.out:
        Path(args.out).write_text(json.dumps({"key": args.key, "max_far": args.max_far, "run": str(args.run),
                                              "n_runs": len(preds), "pick": pick, "within_far": within,
                                              **({} if control is None else {"heldout_rows": control}),
                                              "sweep": sweep}, indent=2) + "\n")
    return 0


def _read_jsonl(path: Path) -> list[dict]:
    import json

    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{i}: not JSON ({e.msg})") from None
    return out


def _heldout_rows(run: Path, key: str) -> tuple[Path, list[dict], dict]:
    """An every-prefix run's held-out rows (RUN/heldout.jsonl: the decision log-odds at every
    held-out prefix, before and after training) as walk records of the trained model on its held-out
    split (read from the run's config.json), and the post-vs-twin control before and after
    (eval/prefix_rows.py)."""
    import json

    from aftraj.readers import load_trajectories
    from eval.prefix_rows import heldout_traces, heldout_twins

    if key != "decision_log_odds":
        raise UsageError(f"{run}: an every-prefix run's held-out rows hold decision log-odds only (--key {key})")
    cfg_file = run / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        if not isinstance(cfg["heldout_split"], str):
            raise TypeError(f"heldout_split is {cfg['heldout_split']!r}: the run scored no held-out rows")
        from eval.run import split_name

        data = Path(cfg["data"]) / f"{split_name(cfg['heldout_split'])}.jsonl"   # validation = val
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"{cfg_file}: not an `aftraj train prefixes` run's config with data and "
                         f"heldout_split ({e})") from None
    if not data.is_file():
        raise UsageError(f"{data}: the run's held-out split ({cfg_file}: data, heldout_split) is not there")
    path = run / "heldout.jsonl"
    rows = _read_jsonl(path)
    trajs = {t.id: t for t in load_trajectories(data, "jsonl")}
    try:
        preds = heldout_traces(rows, trajs, "log_odds_after")
        control = {k: heldout_twins(rows, trajs, f"log_odds_{k}") for k in ("before", "after")}
    except (ValueError, KeyError) as e:
        raise UsageError(f"{path}: {e}") from None
    return path, preds, control


def list_auditors(name: str = "") -> str:
    """The registry's auditors, lm-eval `ls` style: name, strategy, summary and documented
    arguments of each (discovered, never a fixed list); with `name` its whole documentation."""
    from eval.auditors import available_auditors, describe_auditor

    if name:
        try:
            d = describe_auditor(name.partition(":")[0])
        except KeyError as e:
            raise UsageError(e.args[0]) from None
        head = f"{d['name']} ({d['strategy']}; {d['module']})"
        return "\n".join([head, "=" * len(head), "", "arguments:", *[f"  {a}" for a in d["arguments"]], "",
                          d["doc"], ""])
    lines = []
    for n in available_auditors():
        d = describe_auditor(n)
        flags = "" if d["renders_prompt"] else "; --layout/--parser do not apply"
        lines.append(f"{n}  [{d['strategy']}{flags}]")
        lines.append(f"    {d['summary']}")
        for a in d["arguments"]:
            lines.append(f"    {a}" if " " in a else f"    --auditor {a}")
    lines.append("")
    lines.append("`aftraj eval --list-auditors NAME` prints an auditor's whole documentation.")
    return "\n".join(lines)


def resolve_model(spec: str | None) -> str | None:
    """`builtin:NAME` -> its prepared local folder (aftraj.models.resolve_model_spec: built or
    prepared on first use, never downloaded); anything else unchanged."""
    if spec is None or not str(spec).startswith("builtin:"):
        return spec
    from aftraj.models import PREPARED, resolve_model_spec

    try:
        return str(resolve_model_spec(spec))
    except ValueError as e:
        raise UsageError(f"--model {spec}: {e} (builtin: names {', '.join(PREPARED)})") from None


def walk_config(args, prog: str):
    """The EvalConfig of `aftraj eval` / `aftraj audit` (required flags checked, `builtin:` models
    resolved, the reproducing command line recorded); None after `--list-auditors` printed."""
    from eval.provenance import command_line
    from eval.run import EvalConfig

    if args.list_auditors is not None:
        print(list_auditors(args.list_auditors))
        return None
    for opt in ("auditor", "data", "out"):
        if getattr(args, opt) is None:
            raise UsageError(f"--{opt} is required")
    if getattr(args, "update_model_card", False) and not args.model:
        raise UsageError("--update-model-card needs --model (the checkpoint folder whose card it updates)")
    command = command_line(args, args._parser, prog)
    args.model = resolve_model(args.model)
    return EvalConfig.from_namespace(args, command=command)


def run(args) -> int:
    from eval.run import EvalFailed, evaluate

    cfg = walk_config(args, "aftraj eval")
    if cfg is None:
        return 0
    try:
        res = evaluate(cfg)
    except EvalFailed as e:
        print(f"aftraj eval: {e}", file=sys.stderr)
        return 3
    _print_summary(res.metrics, res.out)
    if res.emitted:
        print(f"emitted {res.emitted['emitted']} verdicts to {res.emitted['to']} "
              f"({res.emitted['failures']} failures)")
    if res.all_calls_failed:
        print(f"aftraj eval: {res.all_calls_failed}", file=sys.stderr)
        return 3
    if args.update_model_card:   # a checkpoint of ours: its model card gains this evaluation
        from training.model_card import record_eval

        card = record_eval(Path(args.model), res.metrics, args.out)
        print(f"model card updated: {card}" if card is not None else
              f"aftraj eval: {args.model} holds no model card of ours (no README.md written by training)")
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
