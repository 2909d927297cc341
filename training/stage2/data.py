"""Stage-2 data (DESIGN §5): prompts are prefixes of safe and unsafe TRAIN trajectories, each
with its gold verdict (SAFE for t < k*, UNSAFE (k*, a*) for t >= k*), balanced by config and
rendered by the shared prompt builder with the token budget rule of stage 1 and evaluation
(`render(traj, t, prompt_budget(max_prompt_tokens))`, aftraj.tokens, tokens counted with the model's
tokenizer, then the templated prompt checked against `max_prompt_tokens`).

Trajectories come from `training.common.load_training_trajectories` (val/test families
are left out by `meta.split`); Who&When and runs imported by an adapter (no gold label) are
refused. An unsafe trajectory whose decisive agent a* does not act in steps 0..k* is skipped (its
gold answer at t = k* would be ungrounded, i.e. malformed for the reward) and counted in
stats.json as `skipped_decisive_agent_not_visible`. One record per prompt:

    {"prompt": [system, user], "data_source": "aftraj", "ability": "audit",
     "reward_model": {"style": "rule", "ground_truth": "{\"answer\": 3, \"agent\": \"Coder\"}"},
     "extra_info": {"index": i, "split": "train", "traj_id": …, "t": 3, "agents": [steps 0..t's agents]}}

written as verl parquet (`train.parquet`, `val.parquet`) and as a `datasets` dataset for TRL
(`trl/`, `datasets.load_from_disk`; `trl_dataset()`: prompt, ground_truth, t, agents, traj_id
columns; TRL passes the extra columns to the reward function).

    python -m training.stage2.data --config configs/stage2/tiny-cpu.yaml --out runs/stage2-data
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

from aftraj.boundary import is_from_who_and_when, refuse_unlabeled
from aftraj.prompt import render
from aftraj.schema import Trajectory
from aftraj.tokens import approx_tokens, chat_prompt_ids, check_prompt_length, prompt_budget, tokenizer_counter
from aftraj.verdict import gold_verdict, grounded
from training.common import load_training_trajectories
from training.reward import ground_truth_of

DATA_SOURCE = "aftraj"


@dataclass
class PrefixStats:
    n_trajectories: int = 0
    n_safe_trajectories: int = 0
    n_unsafe_trajectories: int = 0
    candidates_safe_gold: int = 0
    candidates_unsafe_gold: int = 0
    n_safe_gold: int = 0
    n_unsafe_gold: int = 0
    # unsafe trajectories left out because a* first acts after k*: the gold answer at t = k*
    # would name an agent not yet visible and score as malformed (the reward's grounding rule)
    skipped_decisive_agent_not_visible: int = 0


def prefix_candidates(trajs: Sequence[Trajectory]) -> tuple[list[tuple[int, int]], list[tuple[int, int]], PrefixStats]:
    """Every (trajectory index, t) of every training trajectory, split by gold verdict. Refuses
    Who&When, val/test and unlabeled (adapter-imported) trajectories; skips, and counts in
    `skipped_decisive_agent_not_visible`, an unsafe one whose a* does not act in steps 0..k*."""
    refuse_unlabeled(trajs, "stage 2 data")
    safe, unsafe, st = [], [], PrefixStats()
    for i, traj in enumerate(trajs):
        if is_from_who_and_when(traj):
            raise ValueError(f"trajectory {traj.id!r} comes from Who&When ({traj.source}); Who&When "
                             f"is for evaluation only and is never trained on")
        if traj.meta.get("split") in ("val", "test"):
            raise ValueError(f"trajectory {traj.id!r} is in the {traj.meta['split']} split; only "
                             f"train families enter stage 2")
        if traj.label.unsafe and not grounded(traj.label.decisive_step, traj.label.decisive_agent,
                                              traj.label.decisive_step,
                                              [s.agent for s in traj.steps[: traj.label.decisive_step + 1]]):
            st.skipped_decisive_agent_not_visible += 1
            continue
        st.n_trajectories += 1
        if traj.label.unsafe:
            st.n_unsafe_trajectories += 1
        else:
            st.n_safe_trajectories += 1
        for t in range(len(traj.steps)):
            (unsafe if traj.label.unsafe and t >= traj.label.decisive_step else safe).append((i, t))
    st.candidates_safe_gold, st.candidates_unsafe_gold = len(safe), len(unsafe)
    return safe, unsafe, st


def balanced_sample(safe: list, unsafe: list, *, max_prompts: int, unsafe_fraction: float,
                    seed: int) -> tuple[list, list]:
    """Draw the largest sample of at most `max_prompts` whose UNSAFE share is `unsafe_fraction`
    (rounded half up), at least one of each, without replacement; seeded. Exact arithmetic: the
    share is read as the decimal it prints as (0.7 is 7/10), so no prompt is lost to float error."""
    if not unsafe or not safe:
        raise ValueError(f"stage 2 needs prefixes of both gold verdicts; got {len(safe)} SAFE and "
                         f"{len(unsafe)} UNSAFE (does the data hold unsafe trajectories?)")
    if max_prompts < 2:
        raise ValueError(f"stage 2 needs max_prompts >= 2 (one prompt of each gold verdict), got {max_prompts}")
    f = Fraction(repr(float(unsafe_fraction)))
    if not 0 < f < 1:
        raise ValueError(f"unsafe_fraction must be strictly between 0 and 1, got {unsafe_fraction}")
    total = max(2, min(max_prompts, math.floor(len(unsafe) / f), math.floor(len(safe) / (1 - f))))
    n_u = min(len(unsafe), total - 1, max(1, math.floor(total * f + Fraction(1, 2))))
    n_s = min(len(safe), total - n_u)
    rng = random.Random(seed)
    return rng.sample(safe, n_s), rng.sample(unsafe, n_u)


def build_records(trajs: Sequence[Trajectory], *, max_prompts: int, unsafe_fraction: float, seed: int,
                  budget: int | None = None, count_tokens: Callable[[str], int] = approx_tokens
                  ) -> tuple[list[dict], PrefixStats]:
    """verl-style records (see the module doc), shuffled with `seed`."""
    safe, unsafe, st = prefix_candidates(trajs)
    if not unsafe and st.skipped_decisive_agent_not_visible:
        raise ValueError(f"stage 2 needs UNSAFE prefixes, but all {st.skipped_decisive_agent_not_visible} unsafe "
                         f"trajectories were skipped: their decisive agent does not act in steps 0..k*")
    s, u = balanced_sample(safe, unsafe, max_prompts=max_prompts, unsafe_fraction=unsafe_fraction, seed=seed)
    st.n_safe_gold, st.n_unsafe_gold = len(s), len(u)
    picks = s + u
    random.Random(seed + 1).shuffle(picks)
    out = []
    for idx, (i, t) in enumerate(picks):
        traj = trajs[i]
        gold = gold_verdict(traj, t)
        agents = list(dict.fromkeys(step.agent for step in traj.steps[: t + 1]))
        out.append({
            "prompt": render(traj, t, budget, count_tokens=count_tokens),
            "data_source": DATA_SOURCE, "ability": "audit",
            "reward_model": {"style": "rule", "ground_truth": ground_truth_of(gold)},
            "extra_info": {"index": idx, "split": "train", "traj_id": traj.id, "t": t, "agents": agents}})
    return out, st


def check_prompt_lengths(records: list[dict], tokenizer, max_prompt_tokens: int) -> int:
    """The longest templated prompt; raises if one is over `max_prompt_tokens`."""
    longest = 0
    for r in records:
        ids = chat_prompt_ids(tokenizer, r["prompt"])
        x = r["extra_info"]
        check_prompt_length(ids, max_prompt_tokens, f"prompt for {x['traj_id']} (t={x['t']})")
        longest = max(longest, len(ids))
    return longest


def build_stage2_data(cfg, tokenizer, out_dir: str | Path) -> dict:
    """Build (or reuse) `out_dir`/{records.jsonl, train.parquet, val.parquet, trl/, stats.json}."""
    out = Path(out_dir)
    stats_path = out / "stats.json"
    if stats_path.exists():
        return json.loads(stats_path.read_text())
    trajs, src = load_training_trajectories(cfg.data, max_trajectories=cfg.max_trajectories,
                                            synthetic_n=cfg.synthetic_trajectories, seed=cfg.seed)
    records, st = build_records(trajs, max_prompts=cfg.max_prompts, unsafe_fraction=cfg.unsafe_fraction,
                                seed=cfg.seed, budget=prompt_budget(cfg.max_prompt_tokens, tokenizer),
                                count_tokens=tokenizer_counter(tokenizer))
    longest = check_prompt_lengths(records, tokenizer, cfg.max_prompt_tokens)
    out.mkdir(parents=True, exist_ok=True)
    write_records(records, out / "records.jsonl")
    write_parquet(records, out / "train.parquet")
    write_parquet(records[: cfg.val_prompts], out / "val.parquet")
    trl_dataset(records).save_to_disk(str(out / "trl"))
    stats = {"data": src, **asdict(st), "n_prompts": len(records), "longest_prompt_tokens": longest,
             "val_note": "val.parquet is a monitor slice of the train prompts (verl needs val_files); "
                         "held-out evaluation is `aftraj eval` on the test split"}
    stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def write_records(records: list[dict], path: Path) -> None:
    tmp = path.with_suffix(".partial")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tmp.rename(path)


def write_parquet(records: list[dict], path: Path) -> None:
    """verl's RLHFDataset layout: prompt (chat messages), data_source, ability, reward_model, extra_info."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)


def trl_dataset(records: list[dict]):
    """A `datasets.Dataset` for TRL's GRPOTrainer: the conversational `prompt` plus the columns
    the reward function reads (ground_truth, t, agents, traj_id)."""
    from datasets import Dataset

    return Dataset.from_dict({
        "prompt": [r["prompt"] for r in records],
        "ground_truth": [r["reward_model"]["ground_truth"] for r in records],
        "t": [r["extra_info"]["t"] for r in records],
        "agents": [r["extra_info"]["agents"] for r in records],
        "traj_id": [r["extra_info"]["traj_id"] for r in records]})


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from aftraj.models import resolve_model_spec
    from training.stage2.config import load_stage2_config

    p = argparse.ArgumentParser(prog="python -m training.stage2.data", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--data", help="overrides the config's `data`")
    a = p.parse_args(argv)
    cfg = load_stage2_config(a.config, {"data": a.data} if a.data else None)
    tok = AutoTokenizer.from_pretrained(resolve_model_spec(cfg.model))
    print(json.dumps(build_stage2_data(cfg, tok, a.out), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
