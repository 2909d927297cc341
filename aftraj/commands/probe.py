"""`aftraj probe --model PATH --data PATH --out DIR [--split S] [--budget N]`

The boundary probe (eval/probe.py): on every unsafe run of the split, does the model give the
gold verdict a higher log-probability than the boundary error, before and at the decisive step?
Teacher forcing only (no decoding): cheap enough for a whole test split on a CPU.

    aftraj probe --model runs/ablation-cpu/stage1/final --data runs/ablation-cpu/corpus --out runs/probe-s1
"""

from __future__ import annotations

import json
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("probe", help="boundary probe: does the model prefer the gold verdict at the boundary?")
    p.add_argument("--model", required=True, help="model folder (merged, or a LoRA adapter folder)")
    p.add_argument("--data", required=True, help="corpus folder, JSONL or parquet folder")
    p.add_argument("--split", choices=("train", "val", "test", "all"),
                   help="split of data that has splits (default: test)")
    p.add_argument("--out", required=True, help="folder for probe.json")
    p.add_argument("--budget", type=int, help="prompt budget in tokens (default: the model's context "
                                              "less the chat template and 128 tokens, as the hf auditor)")
    p.add_argument("--n-boot", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    from aftraj.commands.eval import select_split
    from aftraj.readers import load_trajectories
    from eval.probe import run_probe

    from aftraj.errors import UsageError

    trajs, split = select_split(load_trajectories(args.data), args.split, args.data)
    if not any(t.label.unsafe for t in trajs):
        raise UsageError(f"--data {args.data}: no unsafe run in {'split ' + split if split else 'it'}: "
                         f"nothing to probe (the probe asks at each unsafe run's decisive step)")
    res = run_probe(args.model, trajs, Path(args.out), budget=args.budget, n_boot=args.n_boot, seed=args.seed)
    s = res["summary"]
    print(json.dumps({"split": split, "n_runs": s["n_runs"], **{k: s[k]["accuracy"] for k in ("pre", "post", "both")},
                      "out": str(Path(args.out) / "probe.json")}))
    return 0
