"""Step-scored decision training (see the package docstring). A run is read once as its
step-tagged sequence (`aftraj.prompt.StepReading`): one forward gives the decision logits at every
step's tag, and the loss is the cross-entropy of the decision token there (SAFE before k*, ALARM
at k*; after k* per `after_kstar`; SAFE at every step of a safe run), ALARM rows weighted to
balance the classes, plus the twin term: a run and its verified-safe twin (`aftraj.boundary.
find_twins`) in one forward, -log sigmoid(log-odds(run, k*) - log-odds(twin, k*)).

    from training.steps.trainer import train
    res = train(load_steps_config("configs/steps/tiny-cpu.yaml"))

Frozen layers (below `trainable_layers`) run without autograd, so a step costs one forward of the
run and the backward of the top layers; nothing is cached between epochs (memory stays one run's
activations whatever the corpus). The head runs at the tags only (`logits_to_keep`).

Writes OUT/config.json, OUT/data.json (rows, tokens, timings), OUT/metrics.jsonl (one line a logged
step), OUT/checkpoint/ (with `save_steps`), OUT/heldout_steps.jsonl (with `heldout_split`: every
held-out run's log-odds at every step, in `score_precision`, one forward a segment), OUT/final/ (the model,
`AutoModelForCausalLM.from_pretrained`, with final/steps_reading.json: the reading's bounds and
decision tokens the `hf-steps` auditor reads with).
"""

from __future__ import annotations

import json
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path

from aftraj.errors import UsageError
from aftraj.schema import Trajectory
from training.steps.config import StepsConfig


@dataclass
class StepRun:
    """One run's step-tagged reading as training reads it: its segments' ids, and the trained rows
    (segment, tag position, step t, ALARM?) in step order."""
    traj_id: str
    segs: list[list[int]]
    rows: list[tuple[int, int, int, bool]]
    k: int | None

    @property
    def tokens(self) -> int:
        return sum(map(len, self.segs))

    def row_of(self, t: int) -> int | None:
        return next((i for i, r in enumerate(self.rows) if r[2] == t), None)


def step_run(traj: Trajectory, tok, cfg: StepsConfig, *, every_step: bool = False) -> StepRun:
    """The rows of `traj`: every step up to k* (unsafe, `after_kstar: skip`) or to the end, each
    scored where it arrives in the reading. `every_step`: the whole run, every step a row (the
    held-out scoring: the walk reads a run to its end)."""
    from aftraj.prompt import step_reading
    from aftraj.verdict import norm_agent

    lb = traj.label
    k = lb.decisive_step if lb.unsafe else None
    if k is not None and norm_agent(traj.steps[k].agent) != norm_agent(lb.decisive_agent or ""):
        raise UsageError(f"trajectory {traj.id!r}: label.decisive_agent {lb.decisive_agent!r} is not "
                         f"step {k}'s agent {traj.steps[k].agent!r}")
    last = k if (k is not None and cfg.after_kstar == "skip" and not every_step) else len(traj.steps) - 1
    r = step_reading(tok, traj, last, **cfg.reading())
    sticky = cfg.after_kstar == "alarm" and not every_step
    rows = [(si, pos, t, k is not None and (t == k or (sticky and t > k)))
            for t, (si, pos) in enumerate(r.scored_at)]
    return StepRun(traj.id, [s.ids for s in r.segments], rows, k)


def select_runs(trajs: list[Trajectory], tok, cfg: StepsConfig, caps: tuple | None = None,
                every_step: bool = False) -> tuple[list[StepRun], dict]:
    """Every run of the split (capped by `max_unsafe_runs` / `max_safe_runs`, `caps`): unsafe runs
    in order, then safe runs, the twins of the unsafe runs taken first."""
    from aftraj.boundary import find_twins, is_from_who_and_when, refuse_unlabeled

    refuse_unlabeled(trajs, "step-scored training")
    who = next((t for t in trajs if is_from_who_and_when(t)), None)
    if who is not None:
        raise UsageError(f"trajectory {who.id!r} comes from Who&When ({who.source}): evaluation only, never trained on")
    cap = dict(zip(("unsafe", "safe"), caps or (cfg.max_unsafe_runs, cfg.max_safe_runs), strict=True))
    twin_of = find_twins(trajs)
    unsafe = [t for t in trajs if t.label.unsafe]
    twins = {twin_of[t.id].id for t in unsafe if t.id in twin_of}
    safe = [t for t in trajs if not t.label.unsafe]
    order = (unsafe[: cap["unsafe"]] if cap["unsafe"] is not None else unsafe)
    first = {twin_of[t.id].id for t in order if t.id in twin_of}
    safe = [t for t in safe if t.id in first] + [t for t in safe if t.id in twins - first] + \
        [t for t in safe if t.id not in twins]
    order += safe[: cap["safe"]] if cap["safe"] is not None else safe
    runs = [step_run(t, tok, cfg, every_step=every_step) for t in order]
    rows = sum(len(r.rows) for r in runs)
    alarms = sum(y for r in runs for *_, y in r.rows)
    return runs, {"unsafe": sum(r.k is not None for r in runs), "safe": sum(r.k is None for r in runs),
                  "twins": sum(r.traj_id in twins for r in runs), "rows": rows, "alarm_rows": alarms,
                  "safe_rows": rows - alarms, "tokens": sum(r.tokens for r in runs),
                  "segments": sum(len(r.segs) for r in runs)}


def twin_pairs(runs: list[StepRun], twin_of: dict[str, Trajectory]) -> list[tuple[int, int, int, int]]:
    """(unsafe run, its twin run, the unsafe run's k* row, the twin's row at k*) for every unsafe
    run whose verified-safe twin is among `runs` (indices into `runs` and into each run's rows)."""
    at = {r.traj_id: i for i, r in enumerate(runs)}
    out = []
    for i, r in enumerate(runs):
        tw = twin_of.get(r.traj_id)
        if r.k is None or tw is None or tw.id not in at:
            continue
        j = at[tw.id]
        ri, rj = r.row_of(r.k), runs[j].row_of(r.k)
        if ri is not None and rj is not None:
            out.append((i, j, ri, rj))
    return out


def weights(runs: list[StepRun], alarm_weight) -> float:
    """The weight of an ALARM row (SAFE rows weigh 1): "balanced" is SAFE rows / ALARM rows."""
    rows = sum(len(r.rows) for r in runs)
    alarms = sum(y for r in runs for *_, y in r.rows)
    if alarm_weight == "balanced":
        return (rows - alarms) / alarms if alarms else 1.0
    return float(alarm_weight)


def row_logits(model, runs: list[StepRun], *, padded: bool = False) -> list:
    """Per run, the (rows, vocab) next-token logits at its rows' tags, the head at the tags only.
    Each segment its own forward (the causal kernel, no mask: on CPU a masked forward takes the
    slow attention path), or with `padded` every segment of `runs` in one right-padded forward,
    pads masked (a causal model's real tokens never see the pads after them: the same logits)."""
    import torch

    device = next(model.parameters()).device
    seqs = [(ri, si, s) for ri, r in enumerate(runs) for si, s in enumerate(r.segs)]
    at: dict[tuple[int, int], object] = {}
    if padded and len(seqs) > 1:
        width = max(len(s) for _, _, s in seqs)
        keep = sorted({pos for r in runs for _, pos, _, _ in r.rows})
        col = {p: j for j, p in enumerate(keep)}
        ids = torch.tensor([s + [0] * (width - len(s)) for _, _, s in seqs], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for _, _, s in seqs], device=device)
        out = model(input_ids=ids, attention_mask=mask, use_cache=False,
                    logits_to_keep=torch.tensor(keep, device=device)).logits
        row_of = {(ri, si): b for b, (ri, si, _) in enumerate(seqs)}
        return [out[[row_of[(ri, si)] for si, _, _, _ in r.rows], [col[p] for _, p, _, _ in r.rows]]
                for ri, r in enumerate(runs)]
    for ri, si, s in seqs:
        keep = [pos for sj, pos, _, _ in runs[ri].rows if sj == si]
        if keep:
            out = model(input_ids=torch.tensor([s], device=device), use_cache=False,
                        logits_to_keep=torch.tensor(keep, device=device)).logits[0]
            at[(ri, si)] = out
    res = []
    for ri, r in enumerate(runs):
        parts = [at[(ri, si)] for si in range(len(r.segs)) if (ri, si) in at]
        res.append(torch.cat(parts) if len(parts) > 1 else parts[0])
    return res


# every this many optimizer steps the C heap's free pages go back to the OS: runs of every length
# leave freed activations scattered through the heap (1.3 GiB free in a 2.4 GiB heap after 25
# steps), which a later longer run cannot reuse; once a step would cost its page faults again
RELEASE_EVERY = 25


def _ceil_to(n: int, b: int) -> int:
    return -(-n // b) * b


class _Stop(Exception):
    """Raised by the hook at the first trainable layer: the frozen bottom has run."""


class Trunk:
    """The frozen bottom of the model (below the top `n_top` layers) run once a token, its KV cache
    and the top's input features of the last sequence kept, so the next sequence runs the bottom
    on its own tokens after their common beginning only: every run opens with the same chat
    template and system prompt (~380 SmolLM2 tokens of ~2,000), and a run and its twin (one
    optimizer step, one after the other) share every step before k*. The top layers then run on
    the whole sequence's features, with autograd (`top_layers_only`); the bottom never has any.
    Equal to a plain forward (tests/training/test_steps.py recomputes step 1's loss from plain
    forwards of each cut run).

    Shapes are bucketed: a sequence is right-padded to a multiple of `bucket` tokens (a causal
    model's real tokens never see the pads after them), the reused beginning is cut to a multiple
    of it, and the rows read at the tags are padded to a multiple of 8. Under bf16 on CPU, oneDNN
    keeps kernels for every matrix shape it has seen, never freed: with every run's own length the
    heap grew ~12 MB a new length (a 1,645-run epoch peaked at 9.2 GiB); bucketed, a handful of
    shapes cover every run, for ~2 % more tokens (benchmarks/README.md, "steps training memory")."""

    ROW_BUCKET = 8

    def __init__(self, model, n_top: int, min_shared: int = 16, bucket: int = 64):
        from aftraj.scoring import decoder_layers

        self.model, self.n_top, self.min_shared, self.bucket = model, n_top, min_shared, max(1, bucket)
        self.layers = decoder_layers(model)[1]
        self.ids: list[int] = []
        self.cache = None
        self.feats = None
        self.reused = self.computed = 0            # bottom tokens taken from the cache / run

    def features(self, ids: list[int]):
        """(1, len(ids), d): the input of the first trainable layer at every token, no grad."""
        import os

        import torch
        from transformers import DynamicCache

        from aftraj.scoring import past

        # the shared prefix's length (the first difference, else the shorter one)
        n = next((j for j, (x, y) in enumerate(zip(self.ids, ids, strict=False)) if x != y),
                 min(len(self.ids), len(ids)))
        n = min(n, len(ids) - 1) // self.bucket * self.bucket
        if self.cache is None or n < self.min_shared:
            self.cache, n = DynamicCache(config=self.model.config), 0
        elif self.cache.get_seq_length() > n:
            self.cache.crop(n - self.cache.get_seq_length())     # negative: tokens to drop (every transformers 5)
        seen = []

        def grab(_m, a, kw):
            seen.append((a[0] if a else kw["hidden_states"]).detach())
            raise _Stop

        device = next(self.model.parameters()).device
        hook = self.layers[len(self.layers) - self.n_top].register_forward_pre_hook(grab, with_kwargs=True)
        # transformers' SDPA copies grouped KV heads under a mask unless told not to (a cache with
        # several new tokens is that case): eval/hf_compat.py's masked_gqa, for the bottom's forward
        gqa = os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")
        os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1" if device.type == "cpu" else (gqa or "0")
        try:
            with torch.no_grad():
                self.model(input_ids=torch.tensor([ids[n:]], device=device),
                           position_ids=torch.arange(n, len(ids), device=device)[None],
                           **past(self.model, self.cache), use_cache=True)
        except _Stop:
            pass
        finally:
            hook.remove()
            if gqa is None:
                os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA", None)
            else:
                os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = gqa
        feats = seen[0] if n == 0 else torch.cat([self.feats[:, :n], seen[0]], dim=1)
        self.ids, self.feats = list(ids), feats
        self.reused += n
        self.computed += len(ids) - n
        return feats

    def row_logits(self, runs: list[StepRun]) -> list:
        """`row_logits` (one forward a segment) with the bottom from `features`."""
        import torch

        from aftraj.scoring import top_layers_only

        device = next(self.model.parameters()).device
        res = []
        for r in runs:
            parts = []
            for si, s in enumerate(r.segs):
                keep = [pos for sj, pos, _, _ in r.rows if sj == si]
                if not keep:
                    continue
                feats = self.features(s + s[-1:] * (_ceil_to(len(s), self.bucket) - len(s)))
                rows = keep + keep[-1:] * (_ceil_to(len(keep), self.ROW_BUCKET) - len(keep))
                with top_layers_only(self.model, self.n_top):
                    out = self.model(inputs_embeds=feats, position_ids=torch.arange(feats.shape[1], device=device)[None],
                                     use_cache=False, logits_to_keep=torch.tensor(rows, device=device)).logits[0]
                parts.append(out[:len(keep)])
            res.append(torch.cat(parts) if len(parts) > 1 else parts[0])
        return res


def log_odds(logp, decisions: tuple[int, int]):
    """log p(ALARM) - log p(SAFE) of (rows, vocab) log-probs."""
    return logp[:, decisions[1]] - logp[:, decisions[0]]


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


@dataclass
class StepsResult:
    output_dir: Path
    final_dir: Path | None
    history: list[dict]
    data: dict


def plan_steps(runs: list[StepRun], pairs, cfg: StepsConfig) -> list[list[list[int]]]:
    """Every optimizer step of the run, in order: each a list of groups (a twin with the unsafe
    runs it is the twin of; every other run alone), `runs_per_step` runs a step, reshuffled each
    epoch from `seed` (so a resumed run replans the same steps)."""
    from training.prefixes.trainer import epoch_batches, step_groups

    rng = random.Random(cfg.seed)
    groups = step_groups(len(runs), pairs)
    return [b for _ in range(cfg.num_epochs) for b in epoch_batches(groups, cfg.runs_per_step, rng)]


class _Checkpoint:
    """OUT/checkpoint/: the trainable weights, optimizer, schedule, step and history (one process:
    torch.save; under accelerate: `save_state`)."""

    def __init__(self, out: Path, acc=None):
        self.dir, self.acc = out / "checkpoint", acc

    def exists(self) -> bool:
        return (self.dir / "trainer.json").is_file()

    def save(self, model, opt, sched, step: int, history: list) -> None:
        import torch

        self.dir.mkdir(parents=True, exist_ok=True)
        if self.acc is not None:
            self.acc.save_state(str(self.dir / "accelerate"))           # the (sharded) model
            torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "rng": torch.get_rng_state()},
                       self.dir / f"rank{self.acc.process_index}.pt")     # this rank's optimizer shards
        else:
            trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            torch.save({"trainable": trainable, "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "rng": torch.get_rng_state()}, self.dir / "state.pt")
        if self.acc is None or self.acc.is_main_process:
            (self.dir / "trainer.json").write_text(json.dumps({"step": step, "history": history}) + "\n")
        if self.acc is not None:
            self.acc.wait_for_everyone()

    def load(self, model, opt, sched) -> tuple[int, list]:
        import torch

        meta = json.loads((self.dir / "trainer.json").read_text())
        if self.acc is not None:
            self.acc.load_state(str(self.dir / "accelerate"))
            mine = self.dir / f"rank{self.acc.process_index}.pt"
            if not mine.is_file():
                raise UsageError(f"{mine}: no optimizer state for this rank: resume with the same number of processes")
            st = torch.load(mine, weights_only=False)
            opt.load_state_dict(st["opt"])
            sched.load_state_dict(st["sched"])
            torch.set_rng_state(st["rng"])
        else:
            st = torch.load(self.dir / "state.pt", weights_only=False)
            params = dict(model.named_parameters())
            missing = set(st["trainable"]) ^ {n for n, p in params.items() if p.requires_grad}
            if missing:
                raise UsageError(f"{self.dir}: the checkpoint's trainable parameters differ from this config's "
                                 f"({sorted(missing)[:3]}…): resume with the same trainable_layers")
            with torch.no_grad():
                for n, v in st["trainable"].items():
                    params[n].copy_(v)
            opt.load_state_dict(st["opt"])
            sched.load_state_dict(st["sched"])
            torch.set_rng_state(st["rng"])
        return meta["step"], meta["history"]


@dataclass
class _Session:
    """What one training run holds between its phases (set-up, steps, export)."""
    cfg: StepsConfig
    out: Path
    acc: object
    main: bool
    device: object
    tok: object
    decisions: tuple[int, int]
    model: object
    runs: list[StepRun]
    w_alarm: float
    pairs_of: dict
    plan: list
    data: dict
    trunk: Trunk | None = None
    params: list | None = None
    opt: object = None
    sched: object = None
    runs_done: int = 0
    tokens_done: int = 0

    @property
    def rank_world(self) -> tuple[int, int]:
        return (self.acc.process_index, self.acc.num_processes) if self.acc is not None else (0, 1)


def _setup(cfg: StepsConfig) -> _Session:
    """The output folder, the model on its device, the trained rows of every run, the twin pairs
    and the plan of every optimizer step."""
    import torch

    from aftraj.boundary import find_twins
    from aftraj.prompt import step_decision_ids
    from training.common import launched_distributed, load_model, load_tokenizer, load_training_trajectories, \
        make_accelerator
    from aftraj.models import resolve_model_spec

    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    acc = make_accelerator(cfg, out) if launched_distributed() else None
    main = acc is None or acc.is_main_process
    if main:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n", encoding="utf-8")
    path = resolve_model_spec(cfg.model)
    tok = load_tokenizer(path)
    device = acc.device if acc is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(cfg, path)
    if acc is None:
        model = model.to(device)
    trajs, src = load_training_trajectories(cfg.data, synthetic_n=cfg.synthetic_trajectories, seed=cfg.seed)
    t0 = time.perf_counter()
    runs, counts = select_runs(trajs, tok, cfg)
    if not counts["alarm_rows"]:
        raise UsageError(f"{src}: no unsafe run to train the ALARM decision on ({counts})")
    w_alarm = weights(runs, cfg.alarm_weight)
    pairs = twin_pairs(runs, find_twins(trajs)) if cfg.twin_weight > 0 else []
    pairs_of: dict[int, list] = {}
    for pr in pairs:
        pairs_of.setdefault(pr[1], []).append(pr)          # keyed by the twin: its group holds them
    plan = plan_steps(runs, pairs, cfg)
    data = {"source": src, **counts, "alarm_weight": w_alarm, "twin_pairs": len(pairs), "steps_planned": len(plan),
            "tokenize_s": round(time.perf_counter() - t0, 1)}
    return _Session(cfg, out, acc, main, device, tok, step_decision_ids(tok), model, runs, w_alarm, pairs_of,
                    plan, data)


def _setup_optimizer(s: _Session) -> None:
    """Freeze below `trainable_layers`, prepare the model under accelerate, AdamW and the cosine
    schedule over the trainable parameters; in one process with frozen layers the Trunk."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from training.common import freeze_below

    cfg = s.cfg
    s.data["trainable_parameters"] = (freeze_below(s.model, cfg.trainable_layers) if cfg.trainable_layers
                                      else sum(p.numel() for p in s.model.parameters()))
    if cfg.gradient_checkpointing:
        s.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if s.acc is not None:
        # the optimizer over the *prepared* model's parameters: FSDP1 (use_orig_params: false)
        # replaces them with flat shards, and accelerate remaps an earlier optimizer for FSDP2 only
        # (training/stage1/trainer.py does the same); its state is saved per rank (_Checkpoint)
        s.model = s.acc.prepare(s.model)
    s.params = [p for p in s.model.parameters() if p.requires_grad]
    s.opt = torch.optim.AdamW(s.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    s.sched = get_cosine_schedule_with_warmup(s.opt, cfg.warmup_steps, len(s.plan))
    # one process with frozen layers: the bottom once a token, shared beginnings once (Trunk)
    s.trunk = Trunk(s.model, cfg.trainable_layers) if s.acc is None and cfg.trainable_layers else None


def _group_loss(s: _Session, g: list[int], w_total: float, n_pairs: int, scale: float, stats: dict):
    """One group's loss (one forward): the weighted decision cross-entropy at every row and the
    twin term of the pairs the group holds; the log-odds and margins go to `stats` when `scale`."""
    import torch
    import torch.nn.functional as F

    from aftraj.scoring import autocast

    runs, decisions = s.runs, s.decisions
    with autocast(s.cfg.mixed_precision, s.device):
        # under FSDP every rank must run the same number of forwards: a group is one (padded)
        # forward whatever its segments
        logits = (s.trunk.row_logits([runs[i] for i in g]) if s.trunk is not None
                  else row_logits(s.model, [runs[i] for i in g], padded=s.acc is not None))
    loss, lp = 0.0, {}
    for i, lg in zip(g, logits, strict=True):
        lp[i] = torch.log_softmax(lg.float(), -1)
        y = torch.tensor([int(a) for *_, a in runs[i].rows], device=lp[i].device)
        tgt = torch.tensor(decisions, device=lp[i].device)[y]
        w = torch.tensor([s.w_alarm if a else 1.0 for *_, a in runs[i].rows], device=lp[i].device)
        loss = loss + (w * F.nll_loss(lp[i], tgt, reduction="none")).sum() / w_total
        if scale:
            lo = log_odds(lp[i].detach(), decisions).tolist()
            stats["alarm"] += [v for v, (*_, a) in zip(lo, runs[i].rows, strict=True) if a]
            stats["safe"] += [v for v, (*_, a) in zip(lo, runs[i].rows, strict=True) if not a]
    for i, j, ri, rj in s.pairs_of.get(g[0], ()):
        m = log_odds(lp[i][ri:ri + 1], decisions) - log_odds(lp[j][rj:rj + 1], decisions)
        loss = loss + s.cfg.twin_weight * F.softplus(-m[0]) / n_pairs
        if scale:
            stats["margins"].append(float(m.detach()))
    return loss


def _train_step(s: _Session, step: int) -> dict:
    """Optimizer step `step` (0-based) of the plan; its log record."""
    import torch

    batch, t_step = s.plan[step], time.perf_counter()
    members = [i for g in batch for i in g]
    w_total = sum(s.w_alarm if y else 1.0 for i in members for *_, y in s.runs[i].rows)
    n_pairs = sum(len(s.pairs_of.get(i, ())) for i in members)
    rank, world = s.rank_world
    mine = batch[rank::world]
    # every rank runs as many forwards as the busiest (FSDP gathers in each): a rank with fewer
    # groups repeats one with its loss multiplied by 0
    loss_sum, stats = 0.0, {"alarm": [], "safe": [], "margins": []}
    for f in range(-(-len(batch) // world)):
        g, scale = (mine[f], 1.0) if f < len(mine) else (batch[0], 0.0)
        loss = _group_loss(s, g, w_total, n_pairs, scale, stats) * scale * world   # averaged over ranks: summed
        if s.acc is not None:
            s.acc.backward(loss)
        else:
            loss.backward()
        loss_sum += float(loss.detach()) / world
        s.runs_done += len(g) if scale else 0
        s.tokens_done += sum(s.runs[i].tokens for i in g) if scale else 0
    if s.acc is not None:
        gnorm = float(s.acc.clip_grad_norm_(s.params, s.cfg.max_grad_norm))
        loss_sum = float(s.acc.reduce(torch.tensor(loss_sum, device=s.device), "sum"))
    else:
        gnorm = float(torch.nn.utils.clip_grad_norm_(s.params, s.cfg.max_grad_norm))
    s.opt.step()
    s.sched.step()
    s.opt.zero_grad(set_to_none=True)
    lo_a, lo_s, margins = stats["alarm"], stats["safe"], stats["margins"]
    rec = {"step": step + 1, "epoch": round((step + 1) * s.cfg.num_epochs / len(s.plan), 4),
           "loss": round(loss_sum, 6), "grad_norm": round(gnorm, 4), "lr": s.sched.get_last_lr()[0],
           "runs": [s.runs[i].traj_id for i in members],
           "log_odds_alarm_rows": round(sum(lo_a) / len(lo_a), 4) if lo_a else None,
           "log_odds_safe_rows": round(sum(lo_s) / len(lo_s), 4) if lo_s else None,
           "step_s": round(time.perf_counter() - t_step, 3)}
    if margins:
        rec.update(twin_pairs=len(margins), twin_margin=round(sum(margins) / len(margins), 4))
    return rec


def _finish(s: _Session, *, progress: bool) -> Path:
    """OUT/final/ (the model and steps_reading.json) and, with `heldout_split`, the held-out
    scores the walk's calibration reads."""
    import torch

    from aftraj.prompt import STEP_DECISIONS, STEP_READING_VERSION, STEP_TAG
    from aftraj.scoring import resolve_mixed_precision
    from training.common import export_folder, save_final

    cfg = s.cfg
    reading = {"version": STEP_READING_VERSION, "tag": STEP_TAG, "decision_words": list(STEP_DECISIONS),
               "decision_ids": list(s.decisions), **cfg.reading(),
               "mixed_precision": resolve_mixed_precision(cfg.score_precision)}
    if s.acc is not None:
        final = save_final(cfg, s.acc, s.model, s.tok, s.out / "final")
    else:
        final = export_folder(s.model, s.tok, s.out / "final", lora=False, dtype=cfg.export_dtype)
    if s.main:
        (final / "steps_reading.json").write_text(json.dumps(reading, indent=1) + "\n", encoding="utf-8")
    if cfg.heldout_split and s.main:
        from aftraj.scoring import release_freed_memory

        release_freed_memory()
        scorer = s.model
        if s.acc is not None:     # the shards gathered into final/: one process reads it whole
            from transformers import AutoModelForCausalLM

            scorer = AutoModelForCausalLM.from_pretrained(final, dtype=getattr(torch, cfg.export_dtype)).to(s.device)
        s.data["heldout"] = score_heldout(scorer.eval(), s.tok, cfg, s.decisions, s.out, progress=progress)
    if s.acc is not None:
        s.acc.wait_for_everyone()
    return final


def train(cfg: StepsConfig, *, progress: bool = False, resume: bool = False) -> StepsResult:
    import torch

    from aftraj.scoring import release_freed_memory, resolve_mixed_precision

    s = _setup(cfg)
    _setup_optimizer(s)
    ckpt = _Checkpoint(s.out, s.acc)
    total, step, history = len(s.plan), 0, []
    if resume:
        if not ckpt.exists():
            raise UsageError(f"{ckpt.dir}: no checkpoint to resume from (save_steps: {cfg.save_steps})")
        step, history = ckpt.load(s.model, s.opt, s.sched)
    stop = total if cfg.max_steps is None else min(total, cfg.max_steps)
    t1 = time.perf_counter()
    s.model.train()
    with (s.out / "metrics.jsonl").open("a" if resume else "w", encoding="utf-8") as log:
        while step < stop:
            rec = _train_step(s, step)
            step += 1
            history.append(rec)
            if s.main and (step % cfg.logging_steps == 0 or step == stop):
                log.write(json.dumps(rec) + "\n")
                log.flush()
                if progress:
                    print(json.dumps({k: v for k, v in rec.items() if k != "runs"}), flush=True)
            if cfg.save_steps and step % cfg.save_steps == 0 and step < total:
                ckpt.save(s.model, s.opt, s.sched, step, history)
            if step % RELEASE_EVERY == 0:
                release_freed_memory()
    train_s = time.perf_counter() - t1
    world, data = s.rank_world[1], s.data
    if s.trunk is not None:
        data.update(trunk_tokens_run=s.trunk.computed, trunk_tokens_reused=s.trunk.reused)
    data.update(steps=step, runs_trained=s.runs_done * world, tokens_trained=s.tokens_done * world,
                train_s=round(train_s, 3),
                runs_per_minute=round(60 * s.runs_done * world / train_s, 2) if train_s > 0 else None,
                mixed_precision=resolve_mixed_precision(cfg.mixed_precision), device=s.device.type)
    s.model.eval()
    final = _finish(s, progress=progress) if step >= total else None
    data["peak_rss_gib"] = round(_rss_gib(), 2)
    if s.device.type == "cuda":
        data["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
    if s.main:
        (s.out / "data.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return StepsResult(s.out, final, history, data)


def score_heldout(model, tok, cfg: StepsConfig, decisions, out: Path, *, progress: bool = False) -> dict:
    """Every step of every held-out run (`heldout_split` of the corpus folder), in
    `score_precision` (the auditor's default precision then), one forward a segment: OUT/heldout_steps.jsonl, one row a step ({id, t, alarm, step_agent,
    log_odds}), what the walk's calibration reads."""
    import torch

    from aftraj.readers import load_trajectories

    hp = Path(cfg.data) / f"{cfg.heldout_split}.jsonl"
    if not hp.is_file():
        raise FileNotFoundError(f"{hp}: heldout_split {cfg.heldout_split!r} needs this file in the corpus folder")
    trajs = load_trajectories(hp, "jsonl")
    by_id = {t.id: t for t in trajs}
    runs, counts = select_runs(trajs, tok, cfg, (cfg.max_heldout_runs, cfg.max_heldout_runs), every_step=True)
    from aftraj.scoring import autocast, release_freed_memory

    t0, rows = time.perf_counter(), []
    trunk = Trunk(model, cfg.trainable_layers) if cfg.trainable_layers else None
    device = next(model.parameters()).device
    with torch.no_grad(), autocast(cfg.score_precision, device):
        for n, r in enumerate(runs):
            lg = trunk.row_logits([r])[0] if trunk is not None else row_logits(model, [r])[0]
            lo = log_odds(torch.log_softmax(lg.float(), -1), decisions).tolist()
            steps = by_id[r.traj_id].steps
            rows += [{"id": r.traj_id, "t": t, "alarm": t == r.k, "step_agent": steps[t].agent,
                      "log_odds": round(v, 4)} for (_, _, t, _), v in zip(r.rows, lo, strict=True)]
            if (n + 1) % RELEASE_EVERY == 0:
                release_freed_memory()
            if progress and (n + 1) % 25 == 0:
                print(json.dumps({"heldout_runs": n + 1, "of": len(runs), "s": round(time.perf_counter() - t0, 1)}),
                      flush=True)
    with (out / "heldout_steps.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(x) + "\n" for x in rows)
    from aftraj.ranking import auc

    return {"split": cfg.heldout_split, **counts, "score_s": round(time.perf_counter() - t0, 1),
            "score_precision": cfg.score_precision,
            "auc_k_vs_safe_rows": auc([x["log_odds"] for x in rows if x["alarm"]],
                                      [x["log_odds"] for x in rows if not x["alarm"]
                                       and (by_id[x["id"]].label.unsafe is False
                                            or x["t"] < by_id[x["id"]].label.decisive_step)])}
