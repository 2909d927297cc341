"""Stage-1 data: tokenised preference pairs, the batch schedule (every micro-batch holds both
subsets) and the collator. Where trajectories come from is shared by every stage
(`training.common.load_training_trajectories`).

- `tokenize_records`: prompt ids exactly as the auditor sees them at inference and completion ids
  closed with the EOS token (`aftraj.tokens.chat_prompt_ids` / `completion_ids`, the one
  tokenisation), so the trained sequence is byte for byte what is served.
- `micro_batch_indices`: a pure function of (seed, step, micro-batch, rank), so a resumed run
  sees exactly the batches an uninterrupted one would.

    python -c "from training.stage1.data import micro_batch_indices as m; print(m(step=1, micro=0, rank=0, world=1, accum=1, pre=[0], post=[1], split=(1, 1), seed=0))"
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from aftraj.tokens import chat_prompt_ids, check_prompt_length, completion_ids, first_divergence

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


def tokenize_records(records: list[dict], tokenizer, *, max_prompt_tokens: int,
                     max_completion_tokens: int) -> tuple[list[TokenizedPair], dict]:
    pairs, n_cut = [], 0
    for i, r in enumerate(records):
        p = chat_prompt_ids(tokenizer, r["messages"])
        check_prompt_length(p, max_prompt_tokens, f"prompt for {r['traj_id']} (t={r['t']})")
        c, cut_c = completion_ids(tokenizer, r["chosen"], max_completion_tokens)
        j, cut_r = completion_ids(tokenizer, r["rejected"], max_completion_tokens)
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
    for p, c in zip(prompts, comps, strict=True):
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
