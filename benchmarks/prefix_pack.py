"""Every prefix of a run packed (`aftraj.scoring.Pack`, training/prefixes: the base, then the blocks
over its cache) vs one forward a prefix, on the same model and run, no grad, rounds alternating
(packed, one by one, packed, ...) because the machine's load swings. Also the tokens each way and the largest
difference of the decision-token log-odds between the two (they must agree).

    python benchmarks/prefix_pack.py --data runs/ablation-cpu/corpus [--model builtin:smollm2-135m]
        [--max-prompt-tokens 1100] [--runs 2] [--rounds 2]
last line: packed_s=… one_by_one_s=… speedup=… packed_tokens=… unpacked_tokens=… max_abs_diff=… load=…
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a corpus folder (its train.jsonl)")
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--max-prompt-tokens", type=int, default=1100)
    ap.add_argument("--runs", type=int, default=2, help="unsafe runs (the first eligible ones with k* >= 8)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import torch

    from aftraj.scoring import packed_logits
    from training.common import load_tokenizer, load_training_trajectories
    from aftraj.models import resolve_model_spec
    from training.prefixes.trainer import prefix_run

    torch.manual_seed(0)
    path = resolve_model_spec(args.model)
    tok = load_tokenizer(path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    trajs, _ = load_training_trajectories(args.data)
    runs = []
    for t in trajs:
        if t.label.unsafe and t.label.decisive_step >= 8:
            r = prefix_run(t, tok, args.max_prompt_tokens)
            if r is not None:
                runs.append(r)
        if len(runs) == args.runs:
            break

    def log_odds(lg, r):
        return torch.tensor(r.log_odds(lg))

    def packed():
        return [log_odds(packed_logits(model, r.pack), r) for r in runs]

    def one_by_one():
        out = []
        for r in runs:
            rows = []
            for i in r.pack.last:            # rebuild each prefix's own sequence from the pack
                seq = _sequence(r.pack, i)
                rows.append(model(input_ids=torch.tensor([seq]), use_cache=False, logits_to_keep=1).logits[0, -1])
            out.append(log_odds(torch.stack(rows), r))
        return out

    times = {"packed": [], "one_by_one": []}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, fn in (("packed", packed), ("one_by_one", one_by_one)):
                t0 = time.perf_counter()
                res = fn()
                times[name].append(time.perf_counter() - t0)
                if name == "packed":
                    a = res
                else:
                    b = res
    diff = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
    p, o = min(times["packed"]), min(times["one_by_one"])
    n_packed = sum(len(r.pack) for r in runs)
    n_unpacked = sum(r.pack.pos[i] + 1 for r in runs for i in r.pack.last)
    print(f"runs={len(runs)} prefixes={sum(len(r.ts) for r in runs)} rounds={args.rounds} (best of each)")
    print(f"packed_s={p:.2f} one_by_one_s={o:.2f} speedup={o / p:.2f} packed_tokens={n_packed} "
          f"unpacked_tokens={n_unpacked} max_abs_diff={diff:.2e} load={os.getloadavg()[0]:.1f}")


def _sequence(pack, i: int) -> list[int]:
    """The sequence whose last token is pack index i: the base up to its shared length, then its block."""
    if i < pack.base_len:
        return pack.ids[: i + 1]
    start, end, share = next(b for b in pack.blocks if b[0] <= i < b[1])
    return pack.ids[:share] + pack.ids[start: i + 1]


if __name__ == "__main__":
    main()
