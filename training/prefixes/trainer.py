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
        return [a if y else s for s, a, y in zip(self.safe_tok, self.alarm_tok, self.alarm, strict=True)]


def prefix_run(traj: Trajectory, tok, max_prompt_tokens: int) -> PrefixRun | None:
    """The rows of `traj`: unsafe, prefixes 0..k* (ALARM at k*, the canonical alarm at step t
    blaming step t's agent, i.e. (k*, a*)); safe, every prefix. A prefix's ids are its chat
    prompt, rendered within the one budget rule (`aftraj.tokens.prompt_budget(max_prompt_tokens)`,
    as the hf auditor reads it), and the canonical completions' common start. Rows are full renders
    only: the prefixes from the first one the budget would show as a bounded view are dropped;
    None when nothing is left, or when an unsafe run's k* is among the dropped."""
    from aftraj.prompt import PrefixCache, render_prompt
    from aftraj.scoring import Pack, decision_ids
    from aftraj.tokens import PromptBudgetError, chat_prompt_ids, prompt_budget, tokenizer_counter
    from aftraj.verdict import canonical_verdict, norm_agent

    lb = traj.label
    k = lb.decisive_step if lb.unsafe else None
    if k is not None and norm_agent(traj.steps[k].agent) != norm_agent(lb.decisive_agent or ""):
        raise UsageError(f"trajectory {traj.id!r}: label.decisive_agent {lb.decisive_agent!r} is not "
                         f"step {k}'s agent {traj.steps[k].agent!r}")
    last = k if k is not None else len(traj.steps) - 1
    budget, count, cache = prompt_budget(max_prompt_tokens, tok), tokenizer_counter(tok), PrefixCache()
    seqs, ts, safe, alarm = [], [], [], []
    for t in range(last + 1):
        try:
            shown = render_prompt(traj, t, budget, count_tokens=count, cache=cache)
        except PromptBudgetError:                   # not even a bounded view fits
            break
        if shown.coverage is not None:
            break                                   # a bounded view: prompts only grow with t
        p = chat_prompt_ids(tok, shown.messages)
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
    cap = dict(zip(("unsafe", "safe"), caps or (cfg.max_unsafe_runs, cfg.max_safe_runs), strict=True))
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
    """Write the run folder, capture the frozen layers' output for every training (and held-out)
    run, train the top layers for `num_epochs`, score the held-out rows and export final/."""
    import torch

    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n", encoding="utf-8")
    model, tok, device = _setup_model(cfg)
    d = _setup_data(cfg, model, tok, out, progress=progress)
    o = _setup_optimizer(cfg, model, d)
    history = _train_epochs(cfg, model, d, o, device, out / "metrics.jsonl", progress=progress)
    model.eval()
    if d.held:
        _score_heldout(cfg, model, d, out)
    return _finish(cfg, model, tok, device, d, o, history, out)


def _setup_model(cfg: PrefixesConfig):
    """(model, tokenizer, device): a CUDA GPU where there is one (its features, masks and targets
    stay on it), else the CPU."""
    import torch

    from aftraj.models import resolve_model_spec
    from training.common import load_model, load_tokenizer

    path = resolve_model_spec(cfg.model)
    tok = load_tokenizer(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return load_model(cfg, path).to(device), tok, device


@dataclass
class _Data:
    """The training runs and their captured features; the held-out runs likewise; data.json's dict."""
    trajs: list[Trajectory]
    runs: list[PrefixRun]
    cached: list
    held: list[PrefixRun]
    held_trajs: dict[str, Trajectory]
    held_cached: list
    w_alarm: float
    data: dict
    t_capture: float            # when the capture began (train_s counts from it)


def _setup_data(cfg: PrefixesConfig, model, tok, out: Path, *, progress: bool) -> _Data:
    from training.common import load_training_trajectories

    trajs, src = load_training_trajectories(cfg.data, synthetic_n=cfg.synthetic_trajectories, seed=cfg.seed)
    t0 = time.perf_counter()
    runs, counts = select_runs(trajs, tok, cfg)
    if not runs or counts["alarm_rows"] == 0:
        raise UsageError(f"{src}: no unsafe run has its k* prompt within max_prompt_tokens="
                         f"{cfg.max_prompt_tokens} ({counts})")
    w_alarm = _weights(runs, cfg.alarm_weight)
    held, held_trajs, hcounts = [], {}, {}
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
    # training precision (bf16 autocast moves the decision log-odds by more than a run's
    # post-vs-twin gap)
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
    return _Data(trajs, runs, cached, held, held_trajs, held_cached, w_alarm, data, t1)


@dataclass
class _Optim:
    """The trainable parameters, AdamW and its cosine schedule, and every epoch's steps (each a
    list of run groups; a twin pair's runs share a group, `pairs_of` keyed by the group's twin)."""
    params: list
    opt: object
    sched: object
    plan: list[list[list[list[int]]]]
    pairs_of: dict[int, list[tuple[int, int, int, int]]]
    n_trainable: int

    @property
    def total(self) -> int:
        return sum(len(e) for e in self.plan)


def _setup_optimizer(cfg: PrefixesConfig, model, d: _Data) -> _Optim:
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from aftraj.boundary import find_twins
    from training.common import freeze_below

    n_trainable = freeze_below(model, cfg.trainable_layers)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    pairs = twin_pairs(d.runs, find_twins(d.trajs)) if cfg.twin_weight > 0 else []
    pairs_of: dict[int, list] = {}
    for pr in pairs:
        pairs_of.setdefault(pr[1], []).append(pr)           # keyed by the twin: its group holds them
    groups = step_groups(len(d.runs), pairs)
    plan = [epoch_batches(groups, cfg.runs_per_step, rng) for _ in range(cfg.num_epochs)]
    sched = get_cosine_schedule_with_warmup(opt, cfg.warmup_steps, sum(len(e) for e in plan))
    d.data["twin_pairs"] = len(pairs)
    return _Optim(params, opt, sched, plan, pairs_of, n_trainable)


def _train_epochs(cfg: PrefixesConfig, model, d: _Data, o: _Optim, device, log_path: Path, *,
                  progress: bool) -> list[dict]:
    """Every step of the plan; each logged step's record to `log_path` (and stdout with `progress`)."""
    history, step = [], 0
    model.train()
    with log_path.open("w", encoding="utf-8") as log:
        for epoch, batches in enumerate(o.plan):
            for b, batch in enumerate(batches):
                t_step = time.perf_counter()
                rec, twin = _train_step(cfg, model, d, o, batch, device)
                step += 1
                rec = {"step": step, "epoch": epoch + (b + 1) / len(batches), **rec,
                       "step_s": round(time.perf_counter() - t_step, 3), **twin}
                history.append(rec)
                if step % cfg.logging_steps == 0 or step == o.total:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    if progress:
                        print(json.dumps(rec), flush=True)
    return history


def _train_step(cfg: PrefixesConfig, model, d: _Data, o: _Optim, batch: list[list[int]],
                device) -> tuple[dict, dict]:
    """One optimizer step over `batch`'s run groups (one backward a group: a run and its twin
    together): the step's record (but for its number, epoch and time), and its twin margins."""
    import torch
    import torch.nn.functional as F

    from aftraj.scoring import autocast, packed_logits, top_layers_only

    runs, w_alarm = d.runs, d.w_alarm
    members = [i for g in batch for i in g]
    w_total = sum(len(runs[i].ts) - sum(runs[i].alarm) + w_alarm * sum(runs[i].alarm) for i in members)
    n_pairs = sum(len(o.pairs_of.get(i, ())) for i in members)
    loss_sum, lo_a, lo_s, margins = 0.0, [], [], []
    for g in batch:
        loss, decision = 0.0, {}
        for i in g:
            r, (feat, mask, _) = runs[i], d.cached[i]
            with top_layers_only(model, cfg.trainable_layers), autocast(cfg.mixed_precision, device):
                logits = packed_logits(model, r.pack, embeds=feat, mask=mask).float()
            ce = F.cross_entropy(logits, torch.tensor(r.targets, device=device), reduction="none")
            w = torch.tensor([w_alarm if y else 1.0 for y in r.alarm], device=device)
            loss = loss + (w * ce).sum() / w_total
            if g[0] in o.pairs_of:
                decision[i] = torch.log_softmax(logits, -1)
            with torch.no_grad():
                lo = r.log_odds(logits)
            lo_a += [v for v, y in zip(lo, r.alarm, strict=True) if y]
            lo_s += [v for v, y in zip(lo, r.alarm, strict=True) if not y]
        for i, j, ri, rj in o.pairs_of.get(g[0], ()):
            u, t = runs[i], runs[j]
            m = ((decision[i][ri, u.alarm_tok[ri]] - decision[i][ri, u.safe_tok[ri]])
                 - (decision[j][rj, t.alarm_tok[rj]] - decision[j][rj, t.safe_tok[rj]]))
            loss = loss + cfg.twin_weight * F.softplus(-m) / n_pairs
            margins.append(float(m.detach()))
        loss.backward()
        loss_sum += float(loss.detach())
    gnorm = float(torch.nn.utils.clip_grad_norm_(o.params, cfg.max_grad_norm))
    o.opt.step()
    o.sched.step()
    o.opt.zero_grad(set_to_none=True)
    rec = {"loss": round(loss_sum, 5), "grad_norm": round(gnorm, 4), "lr": o.sched.get_last_lr()[0],
           "log_odds_alarm_rows": round(sum(lo_a) / len(lo_a), 4) if lo_a else None,
           "log_odds_safe_rows": round(sum(lo_s) / len(lo_s), 4) if lo_s else None}
    twin = {}
    if margins:     # log-odds at k* minus the twin's at k*: > 0 where the step reads content
        twin = {"twin_pairs": len(margins), "twin_margin": round(sum(margins) / len(margins), 4),
                "twin_wins": round(sum(m > 0 for m in margins) / len(margins), 4)}
    return rec, twin


def _score_heldout(cfg: PrefixesConfig, model, d: _Data, out: Path) -> None:
    """Every held-out row's log-odds before and after training (OUT/heldout.jsonl), in float32,
    and their AUCs in data.json's `heldout`."""
    import torch

    from aftraj.scoring import packed_logits, top_layers_only

    rows = []
    with torch.no_grad(), top_layers_only(model, cfg.trainable_layers):      # float32 (the capture's note)
        for r, (feat, mask, before) in zip(d.held, d.held_cached, strict=True):
            after = r.log_odds(packed_logits(model, r.pack, embeds=feat, mask=mask).float())
            steps = d.held_trajs[r.traj_id].steps
            rows += [{"id": r.traj_id, "t": t, "alarm": y, "step_agent": steps[t].agent,
                      "log_odds_before": round(b, 4), "log_odds_after": round(a, 4)}
                     for t, y, b, a in zip(r.ts, r.alarm, before, after, strict=True)]
    with (out / "heldout.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(x) + "\n" for x in rows)
    d.data["heldout"].update(before=heldout_summary(rows, "log_odds_before"),
                             after=heldout_summary(rows, "log_odds_after"))


def _finish(cfg: PrefixesConfig, model, tok, device, d: _Data, o: _Optim, history: list[dict],
            out: Path) -> PrefixesResult:
    """final/ (the whole model) and data.json with the run's totals."""
    import torch

    from aftraj.scoring import resolve_mixed_precision
    from training.common import export_folder

    final = export_folder(model, tok, out / "final", lora=False, dtype=cfg.export_dtype)
    summary = {"steps": len(history), "mixed_precision": resolve_mixed_precision(cfg.mixed_precision),
               "trainable_parameters": o.n_trainable, "train_s": round(time.perf_counter() - d.t_capture, 1),
               "peak_rss_gib": round(_rss_gib(), 2), "device": device.type}
    if device.type == "cuda":
        summary["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
    d.data.update(summary)
    (out / "data.json").write_text(json.dumps(d.data, indent=1) + "\n", encoding="utf-8")
    return PrefixesResult(out, final, history, d.data)
