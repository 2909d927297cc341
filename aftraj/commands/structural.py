"""`aftraj structural fit --data CORPUS --out DIR [--config YAML] [--tune FILE] [--cache NPZ]`
`aftraj structural show --model DIR --data FILE [--id ID]`

fit: the structural monitor (aftraj.structural) in one command. CORPUS is a corpus folder
(its train.jsonl is fitted, its val.jsonl tunes k, the aggregation and the ALARM threshold) or
any trajectory file (then --tune FILE, or a seeded family split holding out `tune_fraction` of
the families). Fit and tune never share a family. Step embeddings are cached by text hash in
DIR/embeddings.npz (or --cache), so a refit embeds only new texts.
show: one trajectory's per-prefix scores (structural and baseline) and fold signals.

    aftraj structural fit --data runs/aftraj-2k --out runs/structural
    aftraj eval --auditor structural:runs/structural --data runs/aftraj-2k/test.jsonl --all-prefixes --out runs/eval-structural
    aftraj structural show --model runs/structural --data runs/aftraj-2k/test.jsonl --id math/0-00001/safe
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "structural" / "default.yaml"


def register(sub) -> None:
    p = sub.add_parser("structural", help="structural monitor: token-pattern retrieval failure score")
    ssub = p.add_subparsers(dest="structural_command", required=True, metavar="ACTION")
    f = ssub.add_parser("fit", help="fit (and tune) the monitor on a corpus")
    f.add_argument("--data", required=True, help="corpus folder (train.jsonl + val.jsonl) or a trajectory file")
    f.add_argument("--out", required=True, help="output folder (monitor.json, monitor.npz, embeddings.npz)")
    f.add_argument("--config", default=str(DEFAULT_CONFIG), help="configs/structural/<name>.yaml")
    f.add_argument("--tune", help="tune split (default: CORPUS/val.jsonl, or a family split of --data)")
    f.add_argument("--cache", help="embedding cache .npz (default: OUT/embeddings.npz)")
    f.add_argument("--embedder", choices=("minilm", "hashing"), help="override the config's embedder")
    f.add_argument("--threads", type=int, help="torch threads while embedding (default: the config's)")
    f.add_argument("--no-progress", action="store_true",
                   help="no progress (else a bar on a terminal, a line every few seconds in a log)")
    f.set_defaults(func=run_fit)
    s = ssub.add_parser("show", help="per-prefix scores and signals of one trajectory")
    s.add_argument("--model", required=True, help="a folder written by `aftraj structural fit`")
    s.add_argument("--data", required=True, help="trajectory file")
    s.add_argument("--id", help="trajectory id (default: the first)")
    s.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    s.set_defaults(func=run_show)


def _split_inputs(args, cfg):
    """(fit trajectories, tune trajectories, description)."""
    from aftraj.corpus.splits import assign_splits
    from aftraj.readers import load_trajectories

    data = Path(args.data)
    if data.is_dir() and (data / "train.jsonl").is_file():
        fit = load_trajectories(data / "train.jsonl")
        tune_path = Path(args.tune) if args.tune else data / "val.jsonl"
        if not tune_path.is_file():
            raise FileNotFoundError(f"no tune split: {tune_path} (give --tune FILE)")
        return fit, load_trajectories(tune_path), f"fit {data / 'train.jsonl'}, tune {tune_path}"
    trajs = load_trajectories(data)
    if args.tune:
        return trajs, load_trajectories(args.tune), f"fit {data}, tune {args.tune}"
    split = assign_splits(trajs, train=1.0 - cfg.tune_fraction, val=cfg.tune_fraction, test=0.0, seed=cfg.seed)
    fit = [t for t in trajs if split[t.family_id] == "train"]
    tune = [t for t in trajs if split[t.family_id] == "val"]
    return fit, tune, f"{data} split by family: {len(fit)} fit, {len(tune)} tune ({cfg.tune_fraction:.0%} of families)"


def run_fit(args) -> int:
    from aftraj.config import ConfigError
    from aftraj.structural.config import load_structural_config
    from aftraj.structural.monitor import StructuralMonitor
    from eval.structural_tune import tune

    overrides = {k: v for k, v in (("embedder", args.embedder or None), ("embed_threads", args.threads))
                 if v is not None}
    try:
        cfg = load_structural_config(args.config, overrides)
    except ConfigError as e:
        print(f"aftraj structural fit: {e}", file=sys.stderr)
        return 2
    try:
        fit, tune_set, how = _split_inputs(args, cfg)
    except OSError as e:
        print(f"aftraj structural fit: --data/--tune: {e}", file=sys.stderr)
        return 2
    shared = {t.family_id for t in fit} & {t.family_id for t in tune_set}
    if shared:
        print(f"aftraj structural fit: {len(shared)} families are in both the fit and the tune split "
              f"(e.g. {sorted(shared)[0]!r}); splits must be by family", file=sys.stderr)
        return 2
    if not fit or not tune_set:
        print(f"aftraj structural fit: empty split ({how})", file=sys.stderr)
        return 2
    print(how)
    out = Path(args.out)
    t0 = time.perf_counter()
    mon = StructuralMonitor.fit(fit, cfg, cache_path=args.cache or out / "embeddings.npz", log=print,
                                progress=not args.no_progress)
    t_fit = time.perf_counter() - t0
    try:
        mon.tuned = tune(mon, tune_set, log=print, progress=not args.no_progress)
    except ValueError as e:
        print(f"aftraj structural fit: {e}", file=sys.stderr)
        return 2
    mon.info.update(tune_s=round(time.perf_counter() - t0 - t_fit, 3), data=str(args.data), splits=how)
    mon.save(out)
    if args.cache:
        mon.cache.save(args.cache)
    print(f"fit {t_fit:.1f} s, tune {mon.info['tune_s']:.1f} s; wrote {out}/monitor.json monitor.npz embeddings.npz")
    print(f"evaluate: aftraj eval --auditor structural:{out} --data TEST --all-prefixes --auc-start {cfg.auc_start} --out DIR")
    return 0


def run_show(args) -> int:
    from aftraj.readers import load_trajectories
    from aftraj.structural.monitor import StructuralMonitor

    try:
        mon = StructuralMonitor.load(args.model)
        trajs = load_trajectories(args.data)
    except (OSError, ValueError) as e:
        print(f"aftraj structural show: {e}", file=sys.stderr)
        return 2
    traj = next((t for t in trajs if args.id is None or t.id == args.id), None)
    if traj is None:
        print(f"aftraj structural show: no trajectory {args.id!r} in {args.data}", file=sys.stderr)
        return 2
    k_star = traj.label.decisive_step if traj.label.unsafe else None
    th = {m: (mon.tuned.get(m) or {}).get("threshold") for m in ("structural", "baseline")}
    if not args.json:
        print(f"{traj.id}  {traj.label.verdict}" + (f" k*={k_star} ({traj.label.decisive_agent})"
                                                    if k_star is not None else ""))
        print("  tuned ALARM thresholds: " + ", ".join(
            f"{m} {'none (never alarms)' if v is None else f'{v:.3f}'}" for m, v in th.items())
              + "; '!' = score >= threshold (ALARM), '<- k*' = the decisive step")
    for t in range(len(traj.steps)):
        sc = {m: mon.score(traj, t, m) for m in th}
        alarm = {m: th[m] is not None and sc[m] >= th[m] for m in th}
        row = {"t": t, "agent": traj.steps[t].agent, "structural": round(sc["structural"], 4),
               "baseline": round(sc["baseline"], 4), "structural_alarm": alarm["structural"],
               "baseline_alarm": alarm["baseline"], "thresholds": th, "is_k_star": t == k_star,
               **mon.signals(traj, t)}
        if args.json:
            print(json.dumps(row))
        else:
            ent = row["next_token_entropy"]
            print(f"  t={t:<3} {row['agent']:<14} "
                  f"structural={row['structural']:.3f}{'!' if alarm['structural'] else ' '} "
                  f"baseline={row['baseline']:.3f}{'!' if alarm['baseline'] else ' '} "
                  f"token={row['tokens'][-1] if row['tokens'] else '-':<3} loop={row['loop_length']} "
                  f"next_entropy={'-' if ent is None else f'{ent:.2f}'} neighbours={row['n_neighbours']}"
                  + ("  <- k*" if t == k_star else ""))
    return 0
