"""Every-prefix decision training (see the package docstring). One packed run a time
(`aftraj.scoring.Pack`): the run's longest prompt once (causal, its cache kept), then each
prefix's own suffix tokens (~20) as blocks that see the prompt up to their own last step; the
head runs at each prefix's decision position only. The input of the top `trainable_layers` layers is captured once for every
packed token (the bottom is frozen), so a step runs those layers only.

    from training.prefixes.trainer import train
    res = train(load_prefixes_config("configs/prefixes/tiny-cpu.yaml"))

With `twin_weight` > 0 a run and its verified-safe twin share a step, and a pairwise term asks
that the run's log-odds at k* exceed the twin's at k* (the same prefix up to k*-1, a different step
k*): the content contrast the cross-entropy alone does not ask for (docs/design.md §8).

Writes OUT/metrics.jsonl (one line a logged step), OUT/data.json (the rows' counts; with a
`heldout_split`, the held-out rows' AUC before and after training), OUT/heldout.jsonl (every
held-out row's log-odds: `aftraj eval tune-threshold OUT` picks the walk threshold on them and
measures post vs twin), OUT/final/ (the whole model: `AutoModelForCausalLM.from_pretrained`, an
`aftraj eval --auditor hf` model).
"""

from __future__ import annotations

import json
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path

from aftraj.errors import UsageError
from aftraj.ranking import auc
from aftraj.schema import Trajectory
from training.prefixes.config import PrefixesConfig


@dataclass
class PrefixRun:
    """One run's rows: prefix t, its decision tokens (SAFE's, ALARM's: the canonical completions'
    first divergence), its target (True: ALARM), all in one `Pack`."""
    traj_id: str
    ts: list[int]
    safe_tok: list[int]
    alarm_tok: list[int]
    alarm: list[bool]
    pack: object

    def log_odds(self, logits) -> list[float]:
        """log p(ALARM) − log p(SAFE) at each row's decision token, from its (rows, vocab) logits."""
        import torch

        lp = torch.log_softmax(logits.detach().float(), -1)
        idx = torch.arange(len(self.ts), device=lp.device)
        return (lp[idx, self.alarm_tok] - lp[idx, self.safe_tok]).tolist()

    @property
    def targets(self) -> list[int]:
        return [a if y else s for s, a, y in zip(self.safe_tok, self.alarm_tok, self.alarm)]


def prefix_run(traj: Trajectory, tok, max_prompt_tokens: int) -> PrefixRun | None:
    """The rows of `traj`: unsafe, prefixes 0..k* (ALARM at k*, the canonical alarm at step t
    blaming step t's agent, i.e. (k*, a*)); safe, every prefix. A prefix's ids are its chat
    prompt (a full render, as the hf auditor reads it within its budget) and the canonical
    completions' common start. Prefixes past max_prompt_tokens are dropped; None when nothing
    is left, or when an unsafe run's k* is among the dropped."""
    from aftraj.prompt import render
    from aftraj.scoring import Pack, decision_ids
    from aftraj.tokens import chat_prompt_ids
    from aftraj.verdict import canonical_verdict, norm_agent

    lb = traj.label
    k = lb.decisive_step if lb.unsafe else None
    if k is not None and norm_agent(traj.steps[k].agent) != norm_agent(lb.decisive_agent or ""):
        raise UsageError(f"trajectory {traj.id!r}: label.decisive_agent {lb.decisive_agent!r} is not "
                         f"step {k}'s agent {traj.steps[k].agent!r}")
    last = k if k is not None else len(traj.steps) - 1
    seqs, ts, safe, alarm = [], [], [], []
    for t in range(last + 1):
        p = chat_prompt_ids(tok, render(traj, t))
        if len(p) > max_prompt_tokens:
            break                                   # prompts only grow with t
        s, a, d = decision_ids(tok, t, canonical_verdict(t, t, traj.steps[t].agent))
        seqs.append(p + s[:d])
        ts.append(t)
        safe.append(s[d])
        alarm.append(a[d])
    if not ts or (k is not None and ts[-1] != k):
        return None
    return PrefixRun(traj.id, ts, safe, alarm, [t == k for t in ts], Pack(seqs))


def select_runs(trajs: list[Trajectory], tok, cfg: PrefixesConfig, caps: tuple | None = None) -> tuple[list[PrefixRun], dict]:
    """The eligible runs, unsafe and safe, capped by `max_unsafe_runs` / `max_safe_runs` (`caps`),
    and their counts. Unsafe runs in the split's order; safe runs the twins of the unsafe runs
    taken first (a twin is identical up to k*-1 and differs at k*: the content control), then the
    other twins, then the rest, in order."""
    from aftraj.boundary import find_twins

    runs, n = [], {"unsafe": 0, "safe": 0, "skipped_long": 0, "twins": 0}
    cap = dict(zip(("unsafe", "safe"), caps or (cfg.max_unsafe_runs, cfg.max_safe_runs)))
    twin_of = find_twins(trajs)
    unsafe = [t for t in trajs if t.label.unsafe]
    twins = {twin_of[t.id].id for t in unsafe if t.id in twin_of}

    def take(traj: Trajectory) -> None:
        kind = "unsafe" if traj.label.unsafe else "safe"
        if cap[kind] is not None and n[kind] >= cap[kind]:
            return
        r = prefix_run(traj, tok, cfg.prompt_cap(traj.label.unsafe))
        if r is None:
            n["skipped_long"] += 1
            return
        n[kind] += 1
        n["twins"] += traj.id in twins
        runs.append(r)

    for traj in unsafe:
        take(traj)
    first = {twin_of[r.traj_id].id for r in runs if r.traj_id in twin_of}
    safe = [t for t in trajs if not t.label.unsafe]
    for traj in ([t for t in safe if t.id in first] + [t for t in safe if t.id in twins - first]
                 + [t for t in safe if t.id not in twins]):
        take(traj)
    rows = sum(len(r.ts) for r in runs)
    alarms = sum(sum(r.alarm) for r in runs)
    return runs, {**n, "rows": rows, "alarm_rows": alarms, "safe_rows": rows - alarms,
                  "packed_tokens": sum(len(r.pack) for r in runs),
                  "unpacked_tokens": sum(r.pack.pos[i] + 1 for r in runs for i in r.pack.last)}


def capture(model, runs: list[PrefixRun], n_top: int, *, progress: bool = False, mixed_precision: str = "no") -> list:
    """Per run (features (1, N, d) = the input of decoder layer L - n_top for every packed token,
    the blocks' mask (M x N, `Pack.mask`), the decision log-odds ALARM − SAFE of the model as it is, one per row). Under bf16
    autocast (`mixed_precision`) the features stay float32 (the residual stream), computed from
    bf16 matmuls."""
    import torch

    from aftraj.scoring import autocast, packed_logits, release_freed_memory

    layers = model.model.layers
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    seen: list = []
    hook = layers[len(layers) - n_top].register_forward_pre_hook(
        lambda _m, a, kw: seen.append((a[0] if a else kw["hidden_states"]).detach().clone()), with_kwargs=True)
    out, t0 = [], time.perf_counter()
    try:
        for r in runs:
            seen.clear()
            p = next(model.parameters())
            mask = r.pack.mask(impl, p.dtype).to(p.device)      # built once, kept where the model is
            with torch.no_grad(), autocast(mixed_precision, p.device):
                lo = r.log_odds(packed_logits(model, r.pack, mask=mask).float())
            out.append((torch.cat(seen, dim=1).float(), mask, lo))     # the base's forward, the blocks'
            release_freed_memory()          # freed activations between the kept features: back to the OS
            if progress and len(out) % 25 == 0:
                print(json.dumps({"captured_runs": len(out), "of": len(runs), "s": round(time.perf_counter() - t0, 1)}),
                      flush=True)
    finally:
        hook.remove()
    return out


def heldout_summary(rows: list[dict], key: str) -> dict:
    """ALARM-vs-SAFE AUC of `key` over held-out rows, and over agent steps only (a tool result is
    never the decisive step here). The walk threshold the rows pick and the post-vs-twin control:
    `aftraj eval tune-threshold RUN` (eval/prefix_rows.py)."""
    agent = [r for r in rows if r["step_agent"] != "environment"]
    return {"auc": auc([r[key] for r in rows if r["alarm"]], [r[key] for r in rows if not r["alarm"]]),
            "auc_agent_steps": auc([r[key] for r in agent if r["alarm"]], [r[key] for r in agent if not r["alarm"]])}


def _weights(runs: list[PrefixRun], alarm_weight) -> float:
    rows = sum(len(r.ts) for r in runs)
    alarms = sum(sum(r.alarm) for r in runs)
    if alarm_weight == "balanced":
        return (rows - alarms) / alarms if alarms else 1.0
    return float(alarm_weight)


def twin_pairs(runs: list[PrefixRun], twin_of: dict[str, Trajectory]) -> list[tuple[int, int, int, int]]:
    """(unsafe run, its twin run, the unsafe run's k* row, the twin's row at k*) for every unsafe
    run whose verified-safe twin (`aftraj.boundary.find_twins`) is among `runs` with step k* kept
    (indices into `runs` and into each run's rows)."""
    at = {r.traj_id: i for i, r in enumerate(runs)}
    out = []
    for i, r in enumerate(runs):
        tw = twin_of.get(r.traj_id)
        if not any(r.alarm) or tw is None or tw.id not in at:
            continue
        j, k = at[tw.id], r.ts[-1]
        if k in runs[j].ts:
            out.append((i, j, len(r.ts) - 1, runs[j].ts.index(k)))
    return out


def step_groups(n: int, pairs: list[tuple[int, int, int, int]]) -> list[list[int]]:
    """The runs that must share a step: a twin with every unsafe run it is the twin of; every other
    run alone. A group stands at its twin's place in run order, so without pairs it is [[0], [1], ...]."""
    group = {}
    for i, j, _, _ in pairs:
        group.setdefault(j, [j]).append(i)
    member = {m: g[0] for g in group.values() for m in g}
    return [group[member[i]] if i in member else [i] for i in range(n) if i not in member or member[i] == i]


def epoch_batches(groups: list[list[int]], runs_per_step: int, rng: random.Random) -> list[list[list[int]]]:
    """One epoch's steps: the groups shuffled, taken in order until a step holds `runs_per_step`
    runs (a group is never split, so a step may hold a few more). Without pairs, the same steps as
    slicing a shuffled run order."""
    order = list(groups)
    rng.shuffle(order)
    steps, cur, n = [], [], 0
    for g in order:
        cur.append(g)
        n += len(g)
        if n >= runs_per_step:
            steps.append(cur)
            cur, n = [], 0
    if cur:
        steps.append(cur)
    return steps


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


@dataclass
class PrefixesResult:
    output_dir: Path
    final_dir: Path
    history: list[dict]
    data: dict


def train(cfg: PrefixesConfig, *, progress: bool = False) -> PrefixesResult:
    import torch
    import torch.nn.functional as F
    from transformers import get_cosine_schedule_with_warmup

    from aftraj.boundary import find_twins
    from aftraj.scoring import autocast, packed_logits, resolve_mixed_precision, top_layers_only
    from training.common import export_folder, freeze_below, load_model, load_tokenizer, load_training_trajectories
    from aftraj.models import resolve_model_spec

    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n", encoding="utf-8")
    path = resolve_model_spec(cfg.model)
    tok = load_tokenizer(path)
    # a CUDA GPU where there is one (its features, masks and targets stay on it), else the CPU
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(cfg, path).to(device)
    trajs, src = load_training_trajectories(cfg.data, synthetic_n=cfg.synthetic_trajectories, seed=cfg.seed)
    t0 = time.perf_counter()
    runs, counts = select_runs(trajs, tok, cfg)
    if not runs or counts["alarm_rows"] == 0:
        raise UsageError(f"{src}: no unsafe run has its k* prompt within max_prompt_tokens="
                         f"{cfg.max_prompt_tokens} ({counts})")
    w_alarm = _weights(runs, cfg.alarm_weight)
    held, held_trajs = [], {}
    if cfg.heldout_split:
        from aftraj.readers import load_trajectories

        hp = Path(cfg.data) / f"{cfg.heldout_split}.jsonl"
        if not hp.is_file():
            raise FileNotFoundError(f"{hp}: heldout_split {cfg.heldout_split!r} needs this file in the corpus folder")
        hts = load_trajectories(hp, "jsonl")
        held_trajs = {t.id: t for t in hts}
        held, hcounts = select_runs(hts, tok, cfg, (cfg.max_heldout_runs, cfg.max_heldout_runs))
    model.eval()
    t1 = time.perf_counter()
    cached = capture(model, runs, cfg.trainable_layers, progress=progress, mixed_precision=cfg.mixed_precision)
    # the held-out rows are a measurement (and pick the walk's threshold): float32 whatever the
    # training precision. bf16 autocast moves the decision log-odds by more than a run's post-vs-twin
    # gap: the same stage-1 model probed 71.1 % post > twin in float32, 51.1 % under bf16 (2026-12-02)
    held_cached = capture(model, held, cfg.trainable_layers, progress=progress)
    data = {"source": src, **counts, "alarm_weight": w_alarm, "tokenize_s": round(t1 - t0, 1),
            "capture_s": round(time.perf_counter() - t1, 1),
            "feature_bytes": sum(f.numel() * f.element_size() for f, _, _ in cached),
            "peak_rss_gib_after_capture": round(_rss_gib(), 2)}
    if held:
        data["heldout"] = {"split": cfg.heldout_split, **hcounts}
    (out / "data.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    if progress:
        print(json.dumps({"data": data}), flush=True)

    n_trainable = freeze_below(model, cfg.trainable_layers)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    pairs = twin_pairs(runs, find_twins(trajs)) if cfg.twin_weight > 0 else []
    pairs_of = {}
    for pr in pairs:
        pairs_of.setdefault(pr[1], []).append(pr)           # keyed by the twin: its group holds them
    groups = step_groups(len(runs), pairs)
    plan = [epoch_batches(groups, cfg.runs_per_step, rng) for _ in range(cfg.num_epochs)]
    total = sum(len(e) for e in plan)
    sched = get_cosine_schedule_with_warmup(opt, cfg.warmup_steps, total)
    data["twin_pairs"] = len(pairs)
    history, step = [], 0
    model.train()
    with (out / "metrics.jsonl").open("w", encoding="utf-8") as log:
        for epoch, batches in enumerate(plan):
            for b, batch in enumerate(batches):
                t_step = time.perf_counter()
                members = [i for g in batch for i in g]
                w_total = sum(len(runs[i].ts) - sum(runs[i].alarm) + w_alarm * sum(runs[i].alarm) for i in members)
                n_pairs = sum(len(pairs_of.get(i, ())) for i in members)
                loss_sum, lo_a, lo_s, margins = 0.0, [], [], []
                for g in batch:                     # one backward a group: a run and its twin together
                    loss, decision = 0.0, {}
                    for i in g:
                        r, (feat, mask, _) = runs[i], cached[i]
                        with top_layers_only(model, cfg.trainable_layers), autocast(cfg.mixed_precision, device):
                            logits = packed_logits(model, r.pack, embeds=feat, mask=mask).float()
                        ce = F.cross_entropy(logits, torch.tensor(r.targets, device=device), reduction="none")
                        w = torch.tensor([w_alarm if y else 1.0 for y in r.alarm], device=device)
                        loss = loss + (w * ce).sum() / w_total
                        if g[0] in pairs_of:
                            decision[i] = torch.log_softmax(logits, -1)
                        with torch.no_grad():
                            lo = r.log_odds(logits)
                        lo_a += [v for v, y in zip(lo, r.alarm) if y]
                        lo_s += [v for v, y in zip(lo, r.alarm) if not y]
                    for i, j, ri, rj in pairs_of.get(g[0], ()):
                        u, t = runs[i], runs[j]
                        m = ((decision[i][ri, u.alarm_tok[ri]] - decision[i][ri, u.safe_tok[ri]])
                             - (decision[j][rj, t.alarm_tok[rj]] - decision[j][rj, t.safe_tok[rj]]))
                        loss = loss + cfg.twin_weight * F.softplus(-m) / n_pairs
                        margins.append(float(m.detach()))
                    loss.backward()
                    loss_sum += float(loss.detach())
                gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                rec = {"step": step, "epoch": epoch + (b + 1) / len(batches), "loss": round(loss_sum, 5),
                       "grad_norm": round(gnorm, 4), "lr": sched.get_last_lr()[0],
                       "log_odds_alarm_rows": round(sum(lo_a) / len(lo_a), 4) if lo_a else None,
                       "log_odds_safe_rows": round(sum(lo_s) / len(lo_s), 4) if lo_s else None,
                       "step_s": round(time.perf_counter() - t_step, 3)}
                if margins:     # log-odds at k* minus the twin's at k*: > 0 where the step reads content
                    rec.update(twin_pairs=len(margins), twin_margin=round(sum(margins) / len(margins), 4),
                               twin_wins=round(sum(m > 0 for m in margins) / len(margins), 4))
                history.append(rec)
                if step % cfg.logging_steps == 0 or step == total:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    if progress:
                        print(json.dumps(rec), flush=True)
    model.eval()
    if held:
        rows = []
        with torch.no_grad(), top_layers_only(model, cfg.trainable_layers):      # float32 (above)
            for r, (feat, mask, before) in zip(held, held_cached):
                after = r.log_odds(packed_logits(model, r.pack, embeds=feat, mask=mask).float())
                steps = held_trajs[r.traj_id].steps
                rows += [{"id": r.traj_id, "t": t, "alarm": y, "step_agent": steps[t].agent,
                          "log_odds_before": round(b, 4), "log_odds_after": round(a, 4)}
                         for t, y, b, a in zip(r.ts, r.alarm, before, after)]
        with (out / "heldout.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(x) + "\n" for x in rows)
        data["heldout"].update(before=heldout_summary(rows, "log_odds_before"),
                               after=heldout_summary(rows, "log_odds_after"))
    final = export_folder(model, tok, out / "final", lora=False, dtype=cfg.export_dtype)
    summary = {"steps": step, "mixed_precision": resolve_mixed_precision(cfg.mixed_precision),
               "trainable_parameters": n_trainable, "train_s": round(time.perf_counter() - t1, 1),
               "peak_rss_gib": round(_rss_gib(), 2), "device": device.type}
    if device.type == "cuda":
        summary["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
    data.update(summary)
    (out / "data.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return PrefixesResult(out, final, history, data)
