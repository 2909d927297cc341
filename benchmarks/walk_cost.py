"""Walk cost: re-encoding every prefix from scratch vs the `hf` backend's KV-cache-reusing walk.

Same model, same trajectories (the shortest Who&When runs with at least
--steps steps, cut to their first --steps steps),
every prefix t = 0..N-1 audited with greedy decoding of --max-new-tokens tokens:
  (a) re-encode: tokenise prefix t's prompt and call `model.generate` on it from scratch, as the
      released inference script does for each prefix;
  (b) reuse: `eval.auditors.hf.HFAuditor` (one pass over the trajectory's stable part, then per
      prefix only the new step, the suffix and the generated tokens).
The generated token ids of (a) and (b) are compared prefix by prefix (the real equality check:
a random tiny model's text is not a parseable verdict). The tiny model is re-initialised with
weights of std --init-std so its greedy output depends on the context (the default init
produces one repeated token, which would make the comparison vacuous).

    .venv/bin/python benchmarks/walk_cost.py            # 2 runs x 30 steps, ~3 min on 2 cores
    .venv/bin/python benchmarks/walk_cost.py --model PATH --device cuda --dtype bfloat16
  (c) with --batch-size B: the same walk with the trajectories interleaved, each round decoded
      together by `HFAuditor.audit_batch` (B trajectories at once); its completions are compared
      with (b) and its seconds per prefix printed beside (b)'s:
    .venv/bin/python benchmarks/walk_cost.py --model ~/.cache/agentforesight/models/smollm2-135m \
        --data /tmp/ab/demo-corpus/data/test.jsonl --format auto --steps 0 --trajectories 8 \
        --max-new-tokens 128 --batch-size 8 --threads 2 --no-reencode
  (d) with --compare-cache: (b) (and (c) when --batch-size is given) again with transformers' own
      DynamicCache, which concatenates the whole cache at every token, in place of the backend's
      slack layers (`eval.hf_compat.new_cache`); prints both times, their ratio and whether
      the completions are equal:
    .venv/bin/python benchmarks/walk_cost.py --model ~/.cache/agentforesight/models/smollm2-135m \
        --data runs/ablation-cpu/corpus/test.jsonl --format auto --steps 0 --trajectories 4 \
        --max-new-tokens 128 --batch-size 4 --threads 2 --no-reencode --compare-cache
  (e) with --compare-drafts: (b) (and (c)) again without drafts (`draft_tokens=0`: one forward a
      generated token instead of verifying the canonical completion's next tokens in one); prints
      both times, their ratio and whether the completions are equal (a trained auditor follows
      its canonical completions, a random model does not: measure with a warmed model):
    .venv/bin/python benchmarks/walk_cost.py --model out/demo/ablation/warmup/final \
        --data out/demo/ablation/corpus/test.jsonl --format auto --steps 0 --trajectories 2 \
        --max-new-tokens 128 --batch-size 2 --threads 2 --no-reencode --compare-drafts
Last line: walk_reencode_s=… walk_reuse_s=… ratio=… verdicts_equal=true|false
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def cut(traj, n):
    """The first n steps of a trajectory (label kept when k* < n, else SAFE)."""
    from aftraj.schema import Label

    lb = traj.label
    if lb.unsafe and lb.decisive_step >= n:
        lb = Label(verdict="SAFE", label_source="verified_safe")
    return dataclasses.replace(traj, id=f"{traj.id}[:{n}]", steps=traj.steps[:n], label=lb)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(REPO / "eval" / "data" / "who_and_when"))
    ap.add_argument("--format", default="whoandwhen", help="reader format of --data (auto, whoandwhen, ...)")
    ap.add_argument("--steps", type=int, default=30,
                    help="steps per trajectory (>= 20; 0: whole runs, the shortest first)")
    ap.add_argument("--batch-size", type=int, default=0,
                    help="also walk with rounds of this many trajectories decoded together (0: off)")
    ap.add_argument("--no-reencode", action="store_true",
                    help="skip (a), the from-scratch re-encoding (slow with a real model)")
    ap.add_argument("--compare-cache", action="store_true",
                    help="also walk with transformers' DynamicCache and print the ratio (d)")
    ap.add_argument("--compare-drafts", action="store_true",
                    help="also walk without drafts (draft_tokens=0) and print the ratio (e)")
    ap.add_argument("--trajectories", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--model", help="a local model folder (default: a freshly built tiny Qwen2)")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--init-std", type=float, default=0.3)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="model dtype (bfloat16 on a GPU: near-ties may break differently)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 keeps the ratio stable on a shared machine)")
    args = ap.parse_args(argv)
    if 0 < args.steps < 20 or args.steps < 0:
        ap.error("--steps must be >= 20, or 0 for whole runs")

    # --- setup
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aftraj.readers import load_trajectories
    from eval.auditors.hf import HFAuditor
    from aftraj.models import build_tiny_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="walkcost-") as tmp:
        path = args.model or build_tiny_model(Path(tmp), hidden_size=args.hidden_size,
                                              num_layers=args.layers)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
        model = model.to(args.device).eval()
        tok = AutoTokenizer.from_pretrained(path)
    path = args.model or "tiny Qwen2 (built locally)"
    if args.model is None and args.init_std > 0:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.copy_((torch.randn(p.shape, generator=g) * args.init_std).to(p))
    # The shortest (in characters) runs with at least --steps steps: bounded memory, real text.
    long_enough = [cut(t, args.steps) if args.steps else t
                   for t in load_trajectories(args.data, args.format) if len(t.steps) >= args.steps]
    trajs = sorted(long_enough, key=lambda t: sum(len(s.content) for s in t.steps))[: args.trajectories]
    if not trajs:
        ap.error(f"no trajectory in {args.data} has {args.steps} steps")
    reuse = HFAuditor(model=model, tokenizer=tok, max_new_tokens=args.max_new_tokens, batch_size=1)
    n_prefix = sum(len(t.steps) for t in trajs)
    prompt_tokens = 0

    # --- (a) re-encode every prefix (model.generate from scratch)
    ref: dict[tuple[str, int], list[int]] = {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        for traj in trajs if not args.no_reencode else []:
            for t in range(len(traj.steps)):
                ids, _ = reuse.prompt_ids(traj, t)
                prompt_tokens += len(ids)
                x = torch.tensor([ids], device=model.device)
                out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=args.max_new_tokens)
                ref[traj.id, t] = out[0, len(ids):].tolist()
    reencode_s = time.perf_counter() - t0

    # --- (b) the hf backend's walk (KV cache reused across prefixes)
    def walk_one_by_one():
        got: dict[tuple[str, int], list[int]] = {}
        raw: dict[tuple[str, int], str] = {}
        t0 = time.perf_counter()
        for traj in trajs:
            for t in range(len(traj.steps)):
                raw[traj.id, t] = reuse.audit(traj, t).raw
                got[traj.id, t] = list(reuse.last_generated)
            reuse.end(traj)
        return got, raw, time.perf_counter() - t0

    got, raw, reuse_s = walk_one_by_one()
    if args.no_reencode:
        ref = got

    # --- (c) rounds of --batch-size trajectories decoded together
    batched_line = None
    bat = HFAuditor(model=model, tokenizer=tok, max_new_tokens=args.max_new_tokens,
                    batch_size=max(args.batch_size, 1))

    def walk_batched():
        braw: dict[tuple[str, int], str] = {}
        t0 = time.perf_counter()
        for i in range(0, len(trajs), args.batch_size):
            live = {tr.id: [tr, 0] for tr in trajs[i:i + args.batch_size]}
            while live:
                req = [(tr, t) for tr, t in live.values()]
                for (tr, t), r in zip(req, bat.audit_batch(req), strict=True):
                    braw[tr.id, t] = r.raw
                    live[tr.id][1] += 1
                    if t + 1 == len(tr.steps):
                        bat.end(tr)
                        del live[tr.id]
        return braw, time.perf_counter() - t0

    if args.batch_size > 0:
        braw, batched_s = walk_batched()
        same = sum(braw[k] == raw[k] for k in raw)
        batched_line = (f"batch1_s_per_prefix={reuse_s / n_prefix:.3f} batched_s_per_prefix="
                        f"{batched_s / n_prefix:.3f} batch_size={args.batch_size} "
                        f"speedup={reuse_s / batched_s:.2f} batched_equal={same}/{len(raw)}")

    # --- (d) the same walks with transformers' DynamicCache (torch.cat at every token)
    cache_line = None
    if args.compare_cache:
        import eval.decoding as hf
        from transformers import DynamicCache

        slack = hf.new_cache
        hf.new_cache = lambda config: DynamicCache(config=config)
        try:
            _, draw, dyn_s = walk_one_by_one()
            dyn_b = walk_batched() if args.batch_size > 0 else None
        finally:
            hf.new_cache = slack
        same = draw == raw and (dyn_b is None or dyn_b[0] == braw)
        cache_line = (f"cache_dynamic_s={dyn_s:.2f} cache_slack_s={reuse_s:.2f} "
                      f"cache_speedup={dyn_s / reuse_s:.2f}"
                      + (f" batched_dynamic_s={dyn_b[1]:.2f} batched_slack_s={batched_s:.2f} "
                         f"batched_cache_speedup={dyn_b[1] / batched_s:.2f}" if dyn_b else "")
                      + f" cache_equal={'true' if same else 'false'}")

    # --- (e) the same walks without drafts (draft_tokens=0: one forward a generated token)
    drafts_line = None
    if args.compare_drafts:
        reuse.draft_tokens = bat.draft_tokens = 0
        try:
            nd_got, nd_raw, nd_s = walk_one_by_one()
            nd_b = walk_batched() if args.batch_size > 0 else None
        finally:
            reuse.draft_tokens = bat.draft_tokens = 64
        same = nd_got == got and (nd_b is None or nd_b[0] == braw)
        drafts_line = (f"drafts_off_s={nd_s:.2f} drafts_on_s={reuse_s:.2f} drafts_speedup={nd_s / reuse_s:.2f}"
                       + (f" batched_drafts_off_s={nd_b[1]:.2f} batched_drafts_on_s={batched_s:.2f} "
                          f"batched_drafts_speedup={nd_b[1] / batched_s:.2f}" if nd_b else "")
                       + f" drafts_equal={'true' if same else 'false'}")

    # --- report
    equal = all(got[k] == ref[k] for k in ref)
    mismatches = [k for k in ref if got[k] != ref[k]]
    print(f"model={path} hidden={model.config.hidden_size} layers={model.config.num_hidden_layers} "
          f"device={model.device} dtype={args.dtype}")
    print(f"trajectories={len(trajs)} steps={args.steps} prefixes={n_prefix} "
          f"prompt_tokens_total={prompt_tokens} max_new_tokens={args.max_new_tokens}")
    if mismatches:
        print(f"mismatching prefixes: {mismatches[:5]}")
    if batched_line:
        print(batched_line)
    if cache_line:
        print(cache_line)
    if drafts_line:
        print(drafts_line)
    print(f"walk_reencode_s={reencode_s:.2f} walk_reuse_s={reuse_s:.2f} "
          f"ratio={reencode_s / reuse_s:.2f} verdicts_equal={'true' if equal else 'false'}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
