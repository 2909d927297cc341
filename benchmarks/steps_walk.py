"""Step-scored walk vs generation walk, one process, same runs, same model (issue 44).

  walk:    every prefix of each run scored by (a) `hf` (the generation walk: the normal prompt per
           prefix on its KV cache, each completion forced to the canonical SAFE completion, which
           the drafts verify in a forward or two: what a trained auditor pays on a prefix it
           passes, so every prefix is walked) and (b)
           `hf-steps` (one incremental forward a step on the step-tagged reading, threshold never
           crossed, no reason); per trajectory: wall seconds, prompt tokens read (the sum of each
           call's prompt: the paper's measure) and tokens computed (prompt tokens not taken from
           a cache + generated tokens), and the ratios (b)/(a).
  latency: `hf-steps` per-event latency as a run grows to --events steps (a long run made of the
           test runs' own steps one after another, under one run's task), with the checkpoint's
           or the SmolLM2 config's reading bounds; p50/p99 over the events around step 10 and
           around the last step, over --repeats different long runs, and the new-segment events.

    python benchmarks/steps_walk.py --data /tmp/lead/base2k/test.jsonl --runs 4 --part walk
    python benchmarks/steps_walk.py --data /tmp/lead/base2k/test.jsonl --part latency --events 200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time


MAX_NEW = 128          # the generation walks' completion budget (a forced SAFE completion stops well before)


def _pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def walk_part(model, tok, trajs, bounds, reencode_runs: int = 1) -> dict:
    from eval.auditors.hf import HFAuditor
    from eval.auditors.hf_steps import HFStepsAuditor

    def trained_like(aud: HFAuditor) -> HFAuditor:
        """The `hf` auditor with each completion forced to the prefix's canonical SAFE completion:
        the tokens a trained generation auditor writes on a prefix it passes, decoded by the same
        forwards (the drafts verify it in one or two), so the cost is that of a trained auditor's
        walk; an untrained model would ramble to max_new_tokens and cost far more. The hook is the
        decoding engine's `pick` (eval.decoding.Decoder); `forced_or_fail` checks it took."""
        base = aud.engine.pick

        def pick(logits, gen, dec, lo):
            nxt, top = base(logits, gen, dec, lo)
            safe = dec[3][0]
            return (safe[len(gen)] if len(gen) < len(safe) else nxt), top

        aud.engine.pick = pick
        return aud

    def forced_or_fail(res) -> None:
        if res.completion_tokens >= MAX_NEW or getattr(res.verdict, "decision", None) != "SAFE":
            raise SystemExit(f"steps_walk: the forced SAFE completion did not take ({res.completion_tokens} tokens, "
                             f"{res.verdict!r}): the decoding engine's pick hook moved")

    gen = trained_like(HFAuditor(model=model, tokenizer=tok, batch_size=1, max_new_tokens=MAX_NEW,
                                 decision_finish="canonical"))
    # the paper's walk: every prefix's prompt encoded from scratch (the released inference script)
    scratch = trained_like(HFAuditor(model=model, tokenizer=tok, batch_size=1, max_new_tokens=MAX_NEW,
                                     decision_finish="canonical", reuse_cache=False))
    steps = HFStepsAuditor(model=model, tokenizer=tok, threshold=1e9, reason="none", **bounds)
    forced_or_fail(gen.audit(trajs[0], 0))                                         # warm, and the hook took
    gen.end(trajs[0]), steps.audit(trajs[0], 0), steps.end(trajs[0])
    rows = []
    for traj in trajs:
        rec = {"id": traj.id, "n_steps": len(traj.steps)}
        pairs = [("generation", gen), ("steps", steps)]
        if len(rows) < reencode_runs:
            pairs.insert(0, ("reencode", scratch))
        for name, aud in pairs:
            t0 = time.perf_counter()
            res = [aud.audit(traj, t) for t in range(len(traj.steps))]
            aud.end(traj)
            rec[name] = {"wall_s": round(time.perf_counter() - t0, 2),
                         "prompt_tokens_read": sum(r.prompt_tokens for r in res),
                         "completion_tokens": sum(r.completion_tokens for r in res),
                         "tokens_computed": sum(r.prompt_tokens - r.cached_tokens + r.completion_tokens for r in res)}
        for k in ("wall_s", "prompt_tokens_read", "tokens_computed"):
            rec[f"ratio_{k}"] = round(rec["steps"][k] / rec["generation"][k], 4)
        # a re-encoding walk computes every prompt token of every call, and the same completions
        rec["reencode_tokens_computed"] = rec["generation"]["prompt_tokens_read"] + rec["generation"]["completion_tokens"]
        rec["ratio_tokens_computed_vs_reencode"] = round(rec["steps"]["tokens_computed"] / rec["reencode_tokens_computed"], 4)
        if "reencode" in rec:
            rec["ratio_wall_s_vs_reencode"] = round(rec["steps"]["wall_s"] / rec["reencode"]["wall_s"], 4)
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    keys = ("wall_s", "prompt_tokens_read", "completion_tokens", "tokens_computed")
    tot = {n: {k: sum(r[n][k] for r in rows) for k in keys} for n in ("generation", "steps")}
    re_tok = sum(r["reencode_tokens_computed"] for r in rows)
    re_rows = [r for r in rows if "reencode" in r]
    return {"runs": len(rows), "prefixes": sum(r["n_steps"] for r in rows), "totals": tot,
            "ratio_vs_kv_reusing_generation_walk": {k: round(tot["steps"][k] / tot["generation"][k], 4)
                                                    for k in ("wall_s", "tokens_computed")},
            "reencode_tokens_computed": re_tok,
            "ratio_tokens_computed_vs_reencode": round(tot["steps"]["tokens_computed"] / re_tok, 4),
            "ratio_wall_s_vs_reencode_measured_runs": (round(sum(r["steps"]["wall_s"] for r in re_rows)
                                                             / sum(r["reencode"]["wall_s"] for r in re_rows), 4)
                                                       if re_rows else None),
            "reencode_runs_measured": len(re_rows),
            "per_trajectory_s": {n: round(tot[n]["wall_s"] / len(rows), 2) for n in tot}}


def long_runs(trajs, n_events: int, repeats: int):
    """`repeats` runs of n_events steps: the test runs' steps one after another (re-indexed),
    each long run starting from a different test run, under that run's task, and periodic with
    period n_events - 15, so the events around step 10 (5..14) and the last ten (n-10..n-1) hold
    the same steps: the two windows differ by the run's length only, not by their steps' sizes."""
    pool = [s for t in trajs for s in t.steps]
    period = n_events - 15
    out = []
    for r in range(repeats):
        start = sum(len(t.steps) for t in trajs[:r])
        steps = [dataclasses.replace(pool[(start + i % period) % len(pool)], index=i) for i in range(n_events)]
        out.append(dataclasses.replace(trajs[r], id=f"long-{r}", steps=steps))
    return out


def latency_part(model, tok, trajs, bounds, n_events: int, repeats: int) -> dict:
    from eval.auditors.hf_steps import HFStepsAuditor

    aud = HFStepsAuditor(model=model, tokenizer=tok, threshold=1e9, reason="none", **bounds)
    runs = long_runs(trajs, n_events, repeats)
    aud.audit(runs[0], 0), aud.end(runs[0])      # warm
    lat: dict[int, list[float]] = {}
    new_seg, fed = [], []
    for run in runs:
        n_seg = 0
        for t in range(n_events):
            r = aud.audit(run, t)
            lat.setdefault(t, []).append(r.latency_s)
            fed.append(r.prompt_tokens - r.cached_tokens)
            segs_now = len(aud.sessions[run.id].reading.segments)
            if t and segs_now > n_seg:
                new_seg.append(t)
            n_seg = segs_now
        aud.end(run)
    segs = sorted({t for t in new_seg})

    def window(lo, hi):
        v = [x for t in range(lo, hi) for x in lat.get(t, [])]
        return {"n": len(v), "p50_ms": round(1000 * _pct(v, 0.5), 1), "p99_ms": round(1000 * _pct(v, 0.99), 1),
                "max_ms": round(1000 * max(v), 1)}

    at10, atend = window(5, 15), window(n_events - 10, n_events)
    return {"events": n_events, "repeats": repeats, "bounds": bounds, "around_step_10": at10,
            f"around_step_{n_events}": atend, "p99_ratio": round(atend["p99_ms"] / at10["p99_ms"], 3),
            "p50_ratio": round(atend["p50_ms"] / at10["p50_ms"], 3),
            "new_segment_events": len(new_seg), "new_segment_steps": segs[:20],
            "tokens_fed_per_event_p50": statistics.median(fed), "tokens_fed_per_event_max": max(fed)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a JSONL of runs (a corpus's test.jsonl)")
    p.add_argument("--model", default="builtin:smollm2-135m", help="a model folder or builtin:NAME")
    p.add_argument("--config", default="configs/steps/smollm2-135m-cpu.yaml", help="the reading's bounds")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--min-steps", type=int, default=14)
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--part", choices=("walk", "latency", "both"), default="both")
    p.add_argument("--events", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a loaded machine with few cores, spinning threads slow each other down)")
    p.add_argument("--reencode-runs", type=int, default=1,
                   help="runs also walked re-encoding every prefix (the paper's walk; slow); its tokens are "
                        "counted for every run")
    a = p.parse_args()

    import torch

    from aftraj.readers import load_trajectories
    from aftraj.models import load_model_and_tokenizer as load_model
    from aftraj.models import resolve_model_spec
    from training.steps.config import load_steps_config

    torch.set_num_threads(a.threads)
    model, tok = load_model(resolve_model_spec(a.model), dtype="float32", device="cpu")
    bounds = load_steps_config(a.config).reading()
    trajs = load_trajectories(a.data, "jsonl")
    chosen = [t for t in trajs if a.min_steps <= len(t.steps) <= a.max_steps][: a.runs]
    out = {"model": a.model, "threads": a.threads, "date": time.strftime("%Y-%m-%d %H:%M"),
           "load_avg_1m_start": round(__import__("os").getloadavg()[0], 1)}
    if a.part in ("walk", "both"):
        out["walk"] = walk_part(model, tok, chosen, bounds, a.reencode_runs)
    if a.part in ("latency", "both"):
        out["latency"] = latency_part(model, tok, trajs, bounds, a.events, a.repeats)
    out["load_avg_1m_end"] = round(__import__("os").getloadavg()[0], 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
