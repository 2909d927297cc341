"""Teacher-forced scoring of completions under a causal LM: the per-token log-probs that stage 1's
per-pair loss (`training/stage1/loss.py`, `trainer.py`) and the boundary probe (`eval/probe.py`)
both read. torch is imported when called, so the core package imports without it.

    from aftraj.scoring import pair_token_logps
    safe_lp, alarm_lp = pair_token_logps(model, prompt_ids, [safe_ids, alarm_ids])
"""

from __future__ import annotations


def pair_token_logps(model, prompt_ids: list[int], completions: list[list[int]], *, embeds=None) -> list:
    """Per-token log-probs of each completion after one prompt, with no padding mask: the prompt
    runs once (one row, the causal kernel) and its KV cache is shared by the completions, which run
    together right-padded (a padded tail is never attended by the real tokens before it, so no mask
    is needed). Gradients flow through the cache into the prompt's forward. Equal to scoring each
    prompt + completion on its own (tests/training/test_stage1_loss.py), at about a third of the
    cost for ~700-token prompts and ~60-token completions. Returns one tensor per completion.

    `embeds` = (prompt (1, P, d), completions (n, W-1, d)): the inputs of the model's first layer
    for the two forwards, in place of the token embeddings (stage 1's frozen-layer features,
    `training/stage1/features.py`; the ids still pick the scored tokens)."""
    import torch

    device = next(model.parameters()).device
    p = torch.tensor([prompt_ids], device=device)
    first_in = {"input_ids": p} if embeds is None else {"inputs_embeds": embeds[0]}
    out = model(**first_in, use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1:]                                   # predicts completion token 0
    cache = out.past_key_values
    n, width = len(completions), max(map(len, completions))
    ids = torch.tensor([c + [c[-1]] * (width - len(c)) for c in completions], device=device)
    if width > 1:
        cache.batch_repeat_interleave(n)
        pos = torch.arange(len(prompt_ids), len(prompt_ids) + width - 1, device=device).expand(n, -1)
        rest_in = {"input_ids": ids[:, :-1]} if embeds is None else {"inputs_embeds": embeds[1]}
        rest = model(**rest_in, past_key_values=cache, position_ids=pos, use_cache=True).logits
        logits = torch.cat([first.expand(n, -1, -1), rest], dim=1)
    else:
        logits = first.expand(n, -1, -1)
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[..., None])[..., 0]
    return [lp[i, : len(c)] for i, c in enumerate(completions)]
