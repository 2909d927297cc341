"""Stage-1 micro-step cost: one padded forward per micro-batch (`batching: padded`, SDPA's masked
path) vs one unpadded forward + backward per pair (`batching: per_pair`: the prompt once, its KV
cache shared by both completions), on the same pairs and model, each mode in its own child
process so that its peak resident memory is its own (`ru_maxrss`). Rounds alternate the modes
(padded, per_pair, padded, …) because the machine's load swings; compare the medians of one run.

    python benchmarks/stage1_batching.py [--model builtin:smollm2-135m] [--prompt 900] [--pairs 3]
        [--steps 3] [--rounds 2] [--trainable-layers 8]
last line: padded_s_per_pair=… per_pair_s_per_pair=… speedup=… padded_peak_gib=… per_pair_peak_gib=…

Measured 2026-12-01 on this project's 2-core AVX2 machine (no AVX512-BF16, so fp32), SmolLM2-135M,
900-token prompts, 40/60-token completions, load average ~9 from other sessions: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def child(args) -> None:
    import torch

    from aftraj.models import resolve_model_spec
    from training.stage1.config import load_stage1_config
    from training.stage1.data import TokenizedPair, collate
    from training.common import load_model, wrap_trainable
    from training.stage1.trainer import _micro_step, _per_pair_step

    torch.manual_seed(0)
    cfg = load_stage1_config("configs/stage1/smollm2-135m-cpu.yaml", {
        "model": args.model, "batching": args.mode, "report_to": [], "reference": "precomputed",
        "trainable_layers": args.trainable_layers, "finetune": "full", "per_device_batch_size": args.pairs,
        "weight_twin": 0.5 if args.pairs >= 3 else 0.0})
    path = resolve_model_spec(args.model)
    model = wrap_trainable(cfg, load_model(cfg, path))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(10, vocab - 10, (n,), generator=g).tolist()

    subsets = ["pre", "post", "twin"][: args.pairs] + ["post"] * max(0, args.pairs - 3)
    pairs = []
    for i, sub in enumerate(subsets):
        common = ids(4)
        pairs.append(TokenizedPair(i, sub == "pre", ids(args.prompt - 17 * i), common + ids(36), common + ids(56),
                                   is_twin=sub == "twin", decision_at=4))
    batch = collate(pairs, 0, torch.zeros(len(pairs), 2) - 50.0)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        if args.mode == "per_pair":
            _per_pair_step(cfg, model, model, None, pairs, batch, lambda x: x.backward())
        else:
            loss, _ = _micro_step(cfg, model, model, None, batch)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(json.dumps({"mode": args.mode, "s_per_pair": statistics.median(times[1:]) / args.pairs,
                      "peak_gib": peak}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--prompt", type=int, default=900, help="prompt tokens of the first pair")
    ap.add_argument("--pairs", type=int, default=3, help="pairs per micro-batch (pre, post, twin, post…)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trainable-layers", type=int, default=8)
    ap.add_argument("--mode", choices=("padded", "per_pair"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        return child(args)
    res: dict[str, list[dict]] = {"padded": [], "per_pair": []}
    for r in range(args.rounds):
        for mode in ("padded", "per_pair"):
            cmd = [sys.executable, __file__, "--mode", mode, *sys.argv[1:]]
            out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TQDM_DISABLE="1"))
            if out.returncode != 0:
                raise SystemExit(f"{mode} child failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            res[mode].append(row)
            print(f"round {r + 1} {mode}: {row['s_per_pair']:.2f} s/pair, peak {row['peak_gib']:.2f} GiB "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    med = {m: statistics.median(x["s_per_pair"] for x in rows) for m, rows in res.items()}
    peak = {m: max(x["peak_gib"] for x in rows) for m, rows in res.items()}
    print(f"padded_s_per_pair={med['padded']:.3f} per_pair_s_per_pair={med['per_pair']:.3f} "
          f"speedup={med['padded'] / med['per_pair']:.2f} padded_peak_gib={peak['padded']:.2f} "
          f"per_pair_peak_gib={peak['per_pair']:.2f}")


if __name__ == "__main__":
    main()
