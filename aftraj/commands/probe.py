"""`aftraj probe --model PATH --data PATH --out DIR [--split S] [--budget N]`

The boundary probe (eval/probe.py): on every unsafe run of the split, the decision-token log-odds
ALARM − SAFE on the pre, post and twin prompts; the headline is post-beats-twin (content-blind
rules score 50 %), beside the content-blind rules. Teacher forcing only (no decoding).

    aftraj probe --model runs/ablation-cpu/stage1/final --data runs/ablation-cpu/corpus --out runs/probe-s1
"""

from __future__ import annotations

import json
from pathlib import Path

from eval.run import SPLIT_CHOICES


def register(sub) -> None:
    p = sub.add_parser("probe", help="boundary probe: does the model prefer the gold verdict at the boundary?")
    p.add_argument("--model", required=True, help="model folder (merged, or a LoRA adapter folder)")
    p.add_argument("--data", required=True, help="corpus folder, JSONL or parquet folder")
    p.add_argument("--split", choices=SPLIT_CHOICES,
                   help="split of data that has splits (default: test; validation is val)")
    p.add_argument("--out", required=True, help="folder for probe.json")
    p.add_argument("--budget", type=int, help="prompt budget in tokens (default: the model's context "
                                              "less the chat template and 128 tokens, as the hf auditor)")
    p.add_argument("--max-post-tokens", type=int, help="probe only unsafe runs whose full post-boundary prompt "
                                                        "has at most this many tokens (as stage 1's max_post_tokens)")
    p.add_argument("--linear-train", help="instead of the model's own decision: fit a linear probe (logistic "
                                          "regression on the frozen model's last hidden state at the decision "
                                          "position, post vs twin) on this train JSONL, score --data's pairs; "
                                          "writes linear_probe.json")
    p.add_argument("--linear-train-pairs", type=int, help="fit on at most this many train twin pairs (seeded)")
    p.add_argument("--mixed-precision", choices=("no", "bf16", "auto"), default="no",
                   help="bf16 autocast of the forwards (float32 weights); auto: where the device computes "
                        "bf16 natively (a CUDA GPU, a CPU with AVX512-BF16/AMX). Default no: float32. bf16 moves the "
                        "log-odds by more than the post-vs-twin gap (one stage-1 model: 71.1 %% float32, 51.1 %% bf16)")
    p.add_argument("--also", nargs=2, action="append", default=[], metavar=("MODEL", "OUT"),
                   help="probe this model too, on the same prompts, into OUT/probe.json (repeatable); models "
                        "whose bottom decoder layers equal --model's (rows trained with trainable_layers from "
                        "one model) run those layers once for all")
    p.add_argument("--n-boot", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    from eval.run import select_split
    from aftraj.readers import load_trajectories
    from eval.probe import run_probe

    from aftraj.errors import UsageError

    trajs, split = select_split(load_trajectories(args.data), args.split, args.data)
    if not any(t.label.unsafe for t in trajs):
        raise UsageError(f"--data {args.data}: no unsafe run in {'split ' + split if split else 'it'}: "
                         f"nothing to probe (the probe asks at each unsafe run's decisive step)")
    from eval.probe import linear_probe, read_error_types

    if args.linear_train:
        if args.also:
            raise UsageError("--also: the linear probe takes one --model")
        train = load_trajectories(args.linear_train)
        res = linear_probe(args.model, train, trajs, Path(args.out), budget=args.budget, n_boot=args.n_boot,
                           seed=args.seed, max_post_tokens=args.max_post_tokens,
                           max_train_pairs=args.linear_train_pairs, error_types=read_error_types(args.data),
                           mixed_precision=args.mixed_precision)
        print(json.dumps({"split": split, "n_train_pairs": res["n_train_pairs"],
                          "n_heldout_pairs": res["n_heldout_pairs"], "train_accuracy": res["train_accuracy"],
                          "post_beats_twin": res["post_beats_twin"]["share"],
                          "post_beats_twin_ci": res["post_beats_twin"]["ci"],
                          "out": str(Path(args.out) / "linear_probe.json")}))
        return 0
    res = run_probe(args.model, trajs, Path(args.out), budget=args.budget, n_boot=args.n_boot, seed=args.seed,
                    max_post_tokens=args.max_post_tokens, error_types=read_error_types(args.data),
                    mixed_precision=args.mixed_precision, also=[(m, Path(o)) for m, o in args.also])
    s = res["summary"]
    print(json.dumps({"split": split, "n_runs": s["n_runs"],
                      "post_beats_twin": s["post_beats_twin"]["share"], "post_beats_twin_ci": s["post_beats_twin"]["ci"],
                      "n_twin_pairs": s["post_beats_twin"]["n"], "post_beats_pre": s["post_beats_pre"]["share"],
                      "out": str(Path(args.out) / "probe.json")}))
    return 0
