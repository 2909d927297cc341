"""Stage-1 data: where trajectories come from, tokenised preference pairs, the batch schedule
(every micro-batch holds both subsets) and the collator.

- `load_training_trajectories(spec)`: a corpus folder (train.jsonl if present, else
  corpus.jsonl), a JSONL file, or `builtin:synthetic` (seeded hand-made unsafe runs with known
  k*, a*, for the CPU demo until a corpus is built), read with `aftraj.readers`. Records whose
  `meta.split` is val or test (corpus.jsonl holds every split) are left out, and counted.
- `tokenize_record`: prompt ids exactly as the auditor sees them at inference (the chat
  template with the generation prompt opened), completion ids tokenised on their own and closed
  with the EOS token, so the trained sequence is byte for byte what is served.
- `micro_batch_indices`: a pure function of (seed, step, micro-batch, rank), so a resumed run
  sees exactly the batches an uninterrupted one would.

    python -c "from training.stage1.data import synthetic_trajectories; print(synthetic_trajectories(2)[0])"
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from aftraj.adapters.base import refuse_unlabeled
from aftraj.readers import load_trajectories
from aftraj.schema import Label, Step, Trajectory

# --------------------------------------------------------------------------- trajectories


def resolve_data_path(spec: str | Path) -> Path:
    """A corpus folder (train.jsonl, else corpus.jsonl) or a JSONL file."""
    p = Path(spec).expanduser()
    if p.is_dir():
        for name in ("train.jsonl", "corpus.jsonl"):
            if (p / name).is_file():
                return p / name
        raise FileNotFoundError(f"{p}: a corpus folder needs train.jsonl or corpus.jsonl")
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such data file or corpus folder")
    return p


def load_training_trajectories(spec: str, *, max_trajectories: int | None = None,
                               synthetic_n: int = 24, seed: int = 0) -> tuple[list[Trajectory], str]:
    """(trajectories, description of the source). Refuses runs imported by an adapter (placeholder
    label, meta.unlabeled), naming the first: their SAFE is not gold."""
    if spec == "builtin:synthetic":
        trajs, src = synthetic_trajectories(synthetic_n, seed=seed), f"builtin:synthetic(n={synthetic_n}, seed={seed})"
    else:
        path = resolve_data_path(spec)
        trajs, src = load_trajectories(path, "jsonl"), str(path)
        held_out = [t for t in trajs if t.meta.get("split") in ("val", "test")]
        if held_out:   # corpus.jsonl holds every split: train on the train families only
            trajs = [t for t in trajs if t.meta.get("split") not in ("val", "test")]
            src += f" (excluded {len(held_out)} val/test trajectories by meta.split)"
    refuse_unlabeled(trajs, src)
    if max_trajectories is not None:
        trajs = trajs[:max_trajectories]
    return trajs, src


_SLIPS = ("computation slip", "verdict misread", "wrong entity", "premature termination")


def synthetic_trajectories(n: int, *, seed: int = 0) -> list[Trajectory]:
    """Seeded MathSolver+Verifier runs; every fourth one is safe, the rest unsafe with a known
    k* and a* (k* = 0 for one in eight unsafe runs, to exercise that case)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(2, 9)
        truth = (a + b) * c
        task = f"Compute ({a} + {b}) * {c}. Answer with the number only."
        n_steps = rng.randint(4, 7)
        safe = i % 4 == 3
        k = None if safe else (0 if i % 8 == 0 else rng.randint(1, n_steps - 2))
        steps = []
        for j in range(n_steps):
            agent = ("user" if j == 0 else ("MathSolver" if j % 2 else "Verifier"))
            if j == 0:
                content = task
            elif k is not None and j >= k:
                wrong = truth + rng.choice((-10, -1, 1, 10)) * c
                content = (f"{a} + {b} = {a + b + (1 if j == k else 0)}; times {c} gives {wrong}."
                           if agent == "MathSolver" else f"I agree that the result is {wrong}.")
            else:
                content = (f"First {a} + {b} = {a + b}." if agent == "MathSolver"
                           else f"Checked: {a} + {b} = {a + b}, correct so far.")
            kind = "final_answer" if j == n_steps - 1 else "message"
            steps.append(Step(index=j, agent=agent, kind=kind, content=content))
        if k == 0:  # the request itself is corrupted: it asks for the wrong operation
            steps[0] = Step(index=0, agent="user", kind="message",
                            content=task.replace(f"* {c}", f"- {c}"))
        label = (Label(verdict="SAFE", label_source="verified_safe") if safe else
                 Label(verdict="UNSAFE", label_source="injected", decisive_step=k,
                       decisive_agent=steps[k].agent,
                       reason=f"{rng.choice(_SLIPS)} at step {k}: the sum or product is wrong.",
                       provenance={"generator": "training.stage1.data.synthetic_trajectories"}))
        out.append(Trajectory(id=f"synthetic-{seed}-{i}", family_id=f"synthetic-{seed}-{i}",
                              domain="math", source="synthetic-stage1", task=task, steps=steps,
                              label=label, final_answer=steps[-1].content,
                              outcome="success" if safe else "failure", reference_answer=str(truth)))
    return out


# --------------------------------------------------------------------------- tokenising


@dataclass
class TokenizedPair:
    index: int
    is_pre: bool
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    is_twin: bool = False
    decision_at: int | None = None   # first completion token where chosen and rejected diverge,
                                     # when their decisions differ (SAFE vs ALARM); None otherwise

    @property
    def subset(self) -> str:
        return "pre" if self.is_pre else "twin" if self.is_twin else "post"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None when one is a prefix of the other):
    for a SAFE and an ALARM completion of one prompt, the decision token."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def prompt_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def completion_token_ids(tokenizer, text: str, max_tokens: int) -> tuple[list[int], bool]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return (ids[:max_tokens], True) if len(ids) > max_tokens else (ids, False)


def tokenize_records(records: list[dict], tokenizer, *, max_prompt_tokens: int,
                     max_completion_tokens: int) -> tuple[list[TokenizedPair], dict]:
    pairs, n_cut = [], 0
    for i, r in enumerate(records):
        p = prompt_token_ids(tokenizer, r["messages"])
        if len(p) > max_prompt_tokens:
            raise ValueError(f"prompt for {r['traj_id']} (t={r['t']}) is {len(p)} tokens, over "
                             f"max_prompt_tokens={max_prompt_tokens} after the chat template")
        c, cut_c = completion_token_ids(tokenizer, r["chosen"], max_completion_tokens)
        j, cut_r = completion_token_ids(tokenizer, r["rejected"], max_completion_tokens)
        n_cut += cut_c + cut_r
        decides = _decision_of(r["chosen"]) != _decision_of(r["rejected"])
        pairs.append(TokenizedPair(i, r["subset"] == "pre", p, c, j, is_twin=r["subset"] == "twin",
                                   decision_at=first_divergence(c, j) if decides else None))
    lens = [len(x.prompt_ids) for x in pairs] or [0]
    return pairs, {"n_pairs": len(pairs), "completions_cut": n_cut, "prompt_tokens_max": max(lens),
                   "prompt_tokens_mean": sum(lens) / len(lens)}


def _decision_of(text: str) -> str | None:
    from aftraj.verdict import ParseFailure, parse_verdict

    v = parse_verdict(text)
    return None if isinstance(v, ParseFailure) else v.decision


# --------------------------------------------------------------------------- batch schedule


def _stream_item(n: int, pos: int, seed: int, tag: int) -> int:
    """Item `pos` of an endless stream of per-epoch permutations of range(n)."""
    epoch, off = divmod(pos, n)
    perm = list(range(n))
    random.Random(f"{seed}/{tag}/{epoch}").shuffle(perm)
    return perm[off]


def micro_batch_indices(*, step: int, micro: int, rank: int, world: int, accum: int,
                        pre: list[int], post: list[int], split: tuple[int, ...], seed: int,
                        twin: list[int] | None = None) -> list[int]:
    """Indices (into the pair list) of one micro-batch: `split[0]` pre pairs, `split[1]` post
    pairs, then `split[2]` twin pairs (when `split` has a third count). `step` counts optimizer
    steps from 1. Deterministic; resuming needs only `step`."""
    if not pre or not post:
        raise ValueError(f"every batch must hold both subsets, but the data has {len(pre)} "
                         f"pre-boundary and {len(post)} post-boundary pairs")
    n_twin = split[2] if len(split) > 2 else 0
    if n_twin and not twin:
        raise ValueError("the twin subset is on (weight_twin > 0) but the data holds no twin pair: no "
                         "unsafe run has a verified-safe twin in its family")
    g = ((step - 1) * accum + micro) * world + rank
    out = [pre[_stream_item(len(pre), g * split[0] + j, seed, 0)] for j in range(split[0])]
    out += [post[_stream_item(len(post), g * split[1] + j, seed, 1)] for j in range(split[1])]
    out += [twin[_stream_item(len(twin), g * n_twin + j, seed, 2)] for j in range(n_twin)]
    return out


# --------------------------------------------------------------------------- collator


def collate(pairs: list[TokenizedPair], pad_id: int, ref_logps: torch.Tensor | None = None) -> dict:
    """Rows: the B chosen sequences, then the B rejected ones (TRL's layout). Prompts are
    left-padded and completions right-padded, so all completions share the last C columns."""
    prompts = [p.prompt_ids for p in pairs] * 2
    comps = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    width_p, width_c = max(map(len, prompts)), max(map(len, comps))
    ids, att, cids, cmask = [], [], [], []
    for p, c in zip(prompts, comps):
        lp, lc = width_p - len(p), width_c - len(c)
        ids.append([pad_id] * lp + p + c + [pad_id] * lc)
        att.append([0] * lp + [1] * (len(p) + len(c)) + [0] * lc)
        cids.append(c + [pad_id] * lc)
        cmask.append([1] * len(c) + [0] * lc)
    attention_mask = torch.tensor(att)
    batch = {"input_ids": torch.tensor(ids), "attention_mask": attention_mask,
             "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
             "completion_ids": torch.tensor(cids), "completion_mask": torch.tensor(cmask),
             "is_pre": torch.tensor([p.is_pre for p in pairs]),
             "is_twin": torch.tensor([p.is_twin for p in pairs]),
             "decision_at": torch.tensor([-1 if p.decision_at is None else p.decision_at for p in pairs]),
             "index": torch.tensor([p.index for p in pairs])}
    if ref_logps is not None:
        batch["ref_chosen"] = ref_logps[batch["index"], 0]
        batch["ref_rejected"] = ref_logps[batch["index"], 1]
    return batch
