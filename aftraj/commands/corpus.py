"""`aftraj corpus build --config configs/corpus/<name>.yaml --out DIR [--seed N] [--no-progress]`
`aftraj corpus verify --config configs/corpus/<name>.yaml --corpus DIR [--seed N]`

build: the corpus (rollouts, curation, injection, diagnosis, splits) into DIR: corpus.jsonl,
train/val/test.jsonl, hf/, the AFTraj parquet layout, provenance.jsonl (simulator readings and
label provenance, keyed by id), stats.json and stats.md.
verify: replay every unsafe trajectory of a scripted corpus and check its decisive step; re-run
the slip detector over every safe one."""

from __future__ import annotations

import sys
import time

from aftraj.corpus.build import build_corpus
from aftraj.corpus.config import load_corpus_config


def register(sub) -> None:
    p = sub.add_parser("corpus", help="build a trajectory corpus (see configs/corpus/)")
    csub = p.add_subparsers(dest="corpus_command", required=True, metavar="ACTION")
    b = csub.add_parser("build", help="build a corpus from a config")
    b.add_argument("--config", required=True, help="configs/corpus/<name>.yaml")
    b.add_argument("--out", required=True, help="output folder")
    b.add_argument("--seed", type=int, default=None, help="override the config's seed")
    b.add_argument("--no-progress", action="store_true",
                   help="no progress (else a bar on a terminal, a line every few seconds in a log)")
    b.set_defaults(func=run_build)
    v = csub.add_parser("verify", help="re-verify the labels of a built scripted corpus by replay")
    v.add_argument("--config", required=True, help="the config the corpus was built with")
    v.add_argument("--corpus", required=True, help="the corpus folder (or its corpus.jsonl)")
    v.add_argument("--seed", type=int, default=None, help="the seed it was built with (default: the config's)")
    v.add_argument("--no-progress", action="store_true", help="no progress (a bar, or a line every few seconds)")
    v.set_defaults(func=run_verify)


def _check_out(out: str) -> None:
    """--out must be a folder or a path that can become one: checked before the build (minutes on
    a large config), not when its files are written at the end."""
    from pathlib import Path

    from aftraj.errors import UsageError

    p = Path(out)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder; give a folder for the corpus")
    above = next((a for a in p.parents if a.exists()), None)
    if above is not None and not above.is_dir():
        raise UsageError(f"--out {out}: {above} is a file, so the folder cannot be created")


def run_build(args) -> int:
    cfg = load_corpus_config(args.config)
    _check_out(args.out)
    from aftraj.corpus.policies import EndpointUnreachable
    from eval.floors import floor_scores   # stats.json's content-blind floors

    t0 = time.perf_counter()
    try:
        res = build_corpus(cfg, args.out, seed=args.seed, progress=not args.no_progress, floors=floor_scores)
    except EndpointUnreachable as e:   # nothing built: say why instead of an empty corpus
        print(f"aftraj corpus build: {args.config}: policy: {e}", file=sys.stderr)
        return 2
    secs = time.perf_counter() - t0
    tot = res.stats["total"]
    print(f"built {tot['trajectories']} trajectories ({tot['safe']} safe, {tot['unsafe']} unsafe) from "
          f"{tot['families']} families into {args.out} in {secs:.1f} s; stats in {args.out}/stats.md")
    if tot["trajectories"] == 0:   # e.g. an endpoint that answers /models but fails every call
        print(f"aftraj corpus build: {args.config}: no trajectory was built (every rollout failed or "
              f"was rejected; see {args.out}/stats.md)", file=sys.stderr)
        return 3
    return 0


def run_verify(args) -> int:
    from pathlib import Path

    from aftraj.corpus.verify import verify_corpus
    from aftraj.readers import load_trajectories

    cfg = load_corpus_config(args.config)
    from aftraj.corpus.build import attach_provenance, read_provenance

    path = Path(args.corpus)
    folder = path if path.is_dir() else path.parent
    trajs = load_trajectories(path / "corpus.jsonl" if path.is_dir() else path, "jsonl")
    if not (folder / "provenance.jsonl").is_file():
        print(f"aftraj corpus verify: no provenance.jsonl in {folder} (the build writes it beside corpus.jsonl)",
              file=sys.stderr)
        return 2
    prov = read_provenance(folder / "provenance.jsonl")
    missing = [t.id for t in trajs if t.id not in prov]
    if missing:
        print(f"aftraj corpus verify: {len(missing)} trajectories have no provenance record (e.g. {missing[0]})",
              file=sys.stderr)
        return 2
    trajs = [attach_provenance(t, prov[t.id]) for t in trajs]
    t0 = time.perf_counter()
    rep = verify_corpus(trajs, cfg, args.seed, progress=not args.no_progress)
    for tid, why in rep.problems[:20]:
        print(f"  {tid}: {why}")
    print(f"{rep.summary()} seconds={time.perf_counter() - t0:.1f}")
    return 0 if rep.ok else 1
