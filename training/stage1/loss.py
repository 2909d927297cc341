"""The BPPO loss (DESIGN §5) and the completion log-probabilities it is computed from.

    L = Σ_s w_s · E_(x,y+,y-)∈D_s [ -log σ( β((log πθ(y+|x) - log πref(y+|x))
                                           - (log πθ(y-|x) - log πref(y-|x))) ) ]  + λ · NLL(y+)

over s ∈ {pre, post, twin} (twin: the amended DESIGN §5's content control, weight 0 = off), exactly as written: the weights are not normalised. With weights summing
to 1 (the configs use 0.5 and 0.5) the loss is on DPO's scale, ln 2 when the policy equals the
reference; one subset with weight 1 is exactly TRL's `sigmoid` DPO loss. A subset absent from
the batch adds nothing (the trainer puts both in every batch). NLL(y+) is the mean negative
log-likelihood per chosen-completion token (TRL's `sft` term).

Two optional terms for small models whose summed margins hide the decision (DESIGN §5 amended,
not in the paper): `decision_coef` · CE on the decision token, the first completion token where
the chosen and rejected completions diverge (found by the tokenizer: `aftraj.tokens.first_divergence`),
averaged over the pairs that have one (`decision_balance`: averaged per class first, the SAFE-chosen
pairs (pre, twin) and the ALARM-chosen ones (post) weighing one half each, so a batch of pre + post
+ twin does not teach SAFE 2:1); and `margin_tokens`: the DPO log-probabilities summed
over the first N completion tokens only (`sequence_logps`), so the template text after the
decision cannot dominate the margin.

    from training.stage1.loss import bppo_loss
    loss, metrics = bppo_loss(pc, pr, rc, rr, is_pre, beta=0.1, weight_pre=0.5, weight_post=0.5)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def completion_logps(model, batch: dict, *, return_per_token: bool = False):
    """Summed log-probabilities of the completion tokens, one per row of the batch.

    The batch layout (see `data.collate`) left-pads prompts and right-pads completions, so every
    row's completion occupies the same last C columns: the model computes logits for those
    C + 1 positions only (`logits_to_keep`), never the (rows × prompt length × vocab) block,
    which is what makes 8192-token prompts with a 152k vocabulary affordable.
    """
    ids, mask = batch["completion_ids"], batch["completion_mask"]
    c = ids.shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], logits_to_keep=c + 1, use_cache=False)
    logits = out.logits[:, :c]                       # position j predicts completion token j
    targets = ids.masked_fill(mask == 0, -100)
    per_token = -F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                 ignore_index=-100, reduction="none").view(ids.shape)
    logps = per_token.sum(dim=1)
    return (logps, per_token) if return_per_token else logps


def sequence_logps(per_token: torch.Tensor, mask: torch.Tensor, margin_tokens: int | None = None) -> torch.Tensor:
    """Per-row sums of per-token log-probs over the completion (right-padded: `mask` marks real
    tokens), over its first `margin_tokens` tokens when given."""
    m = mask.to(per_token.dtype)
    if margin_tokens is not None:
        m = m * (torch.arange(per_token.shape[1], device=per_token.device) < margin_tokens).to(m.dtype)
    return (per_token * m).sum(dim=1)


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-pair sigmoid DPO loss -log σ(β(Δθ - Δref))."""
    logits = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -F.logsigmoid(beta * logits)


def bppo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
              ref_rejected: torch.Tensor, is_pre: torch.Tensor, *, beta: float, weight_pre: float,
              weight_post: float, chosen_token_logps: torch.Tensor | None = None,
              chosen_mask: torch.Tensor | None = None, nll_coef: float = 0.0,
              is_twin: torch.Tensor | None = None, weight_twin: float = 0.0,
              decision_logps: torch.Tensor | None = None, has_decision: torch.Tensor | None = None,
              decision_coef: float = 0.0, decision_balance: bool = False,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-subset DPO loss (pre, post, twin); returns (loss, detached metrics).
    `decision_logps`: the chosen completion's log-prob at its decision token, one per pair
    (`has_decision` marks the pairs that have one); the term is -mean over those pairs, or with
    `decision_balance` the mean over the two classes present (SAFE chosen: pre and twin; ALARM
    chosen: post) of each class's -mean."""
    per_pair = dpo_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
    is_pre = is_pre.to(torch.bool)
    is_twin = torch.zeros_like(is_pre) if is_twin is None else is_twin.to(torch.bool)
    total_w = 0.0
    loss = per_pair.new_zeros(())
    metrics: dict[str, torch.Tensor] = {}
    chosen_r = beta * (policy_chosen - ref_chosen).detach()
    rejected_r = beta * (policy_rejected - ref_rejected).detach()
    for name, sel, w in (("pre", is_pre, weight_pre), ("post", ~is_pre & ~is_twin, weight_post),
                         ("twin", is_twin, weight_twin)):
        if sel.any():
            sub = per_pair[sel].mean()
            loss = loss + w * sub
            total_w = total_w + w
            metrics[f"dpo_{name}"] = sub.detach()
            metrics[f"reward_acc_{name}"] = (chosen_r[sel] > rejected_r[sel]).float().mean()
            metrics[f"margin_{name}"] = (chosen_r[sel] - rejected_r[sel]).mean()
    if total_w <= 0:
        raise ValueError("the batch holds no subset with a positive weight")
    metrics["dpo"] = loss.detach()
    if nll_coef > 0:
        if chosen_token_logps is None or chosen_mask is None:
            raise ValueError("nll_coef > 0 needs chosen_token_logps and chosen_mask")
        nll = -(chosen_token_logps * chosen_mask).sum() / chosen_mask.sum().clamp(min=1)
        loss = loss + nll_coef * nll
        metrics["nll"] = nll.detach()
    if decision_coef > 0:
        if decision_logps is None or has_decision is None:
            raise ValueError("decision_coef > 0 needs decision_logps and has_decision")
        sel = has_decision.to(torch.bool)
        if decision_balance:
            alarm = ~is_pre & ~is_twin
            parts = [-decision_logps[m].mean() for m in (sel & alarm, sel & ~alarm) if m.any()]
            ce = torch.stack(parts).mean() if parts else None
        else:
            ce = -decision_logps[sel].mean() if sel.any() else None
        if ce is not None:
            loss = loss + decision_coef * ce
            metrics["decision_ce"] = ce.detach()
    metrics["reward_chosen"] = chosen_r.mean()
    metrics["reward_rejected"] = rejected_r.mean()
    return loss, metrics
