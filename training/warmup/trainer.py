"""Format warm-up training (NOT part of the paper's recipe): supervised loss on the completion
tokens only (prompt masked, chat template applied as in stage 1), then a greedy parse check on
seeded VAL-split prefixes. Model loading, LoRA wrapping, accelerate set-up and the final-folder
export (LoRA merged) are every stage's (`training.common`), as are the model card and the prompt
budget: prompts are rendered with `aftraj.tokens.prompt_budget(max_prompt_tokens)` and the
templated prompt is checked against `max_prompt_tokens`, as in stage 1 and stage 2. Writes RUN/final (a full model folder:
`aftraj eval --auditor hf --model RUN/final`, `aftraj train stage1 --model RUN/final`,
`aftraj train stage2 --init RUN/final` take it) and RUN/warmup_stats.json.

    aftraj train warmup --config configs/warmup/smollm2-135m-cpu.yaml --data CORPUS --out RUN
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch

from aftraj.prompt import render
from aftraj.readers import load_trajectories
from aftraj.verdict import ParseFailure, parse_verdict
from aftraj.tokens import chat_prompt_ids, check_prompt_length, completion_ids, prompt_budget, tokenizer_counter
from training.common import (load_model, load_tokenizer, load_training_trajectories, make_accelerator,
                             resolve_data_path, save_final, synthetic_trajectories, wrap_trainable)
from aftraj.models import resolve_model_spec
from training.warmup.config import WarmupConfig
from training.warmup.data import check_prefixes, warmup_examples


def _val_trajectories(cfg: WarmupConfig):
    """The VAL split: val.jsonl of a corpus folder, or corpus.jsonl's meta.split == 'val'; for
    builtin:synthetic, fresh runs from another seed."""
    if cfg.data == "builtin:synthetic":
        return synthetic_trajectories(max(8, cfg.synthetic_trajectories // 2), seed=cfg.seed + 1000)
    p = Path(cfg.data)
    if p.is_dir() and (p / "val.jsonl").exists():
        return load_trajectories(p / "val.jsonl", "jsonl")
    trajs = load_trajectories(resolve_data_path(cfg.data), "jsonl")
    val = [t for t in trajs if t.meta.get("split") == "val"]
    if not val:
        raise ValueError(f"{cfg.data}: no val split (val.jsonl or meta.split == 'val') for the parse check")
    return val


def _batch(items: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    """Left-padded batch: every completion ends at the last position, so the loss needs logits of
    the last `keep` positions only (`logits_to_keep`): a 49k-word vocabulary over 4 x 2,000 prompt
    positions would otherwise take GiBs for logits nobody scores."""
    width = max(len(p) + len(c) for p, c in items)
    keep = max(len(c) for _, c in items) + 1
    ids, mask, target = [], [], []
    for p, c in items:
        pad = width - len(p) - len(c)
        ids.append([pad_id] * pad + p + c)
        mask.append([0] * pad + [1] * (len(p) + len(c)))
        # targets of the last `keep` - 1 next-token predictions: completion tokens only
        target.append([-100] * (keep - 1 - len(c)) + c)
    mask_t = torch.tensor(mask)
    return {"input_ids": torch.tensor(ids), "attention_mask": mask_t,
            "position_ids": (mask_t.cumsum(-1) - 1).clamp(min=0), "target": torch.tensor(target),
            "keep": keep}


def completion_loss(model, batch: dict, device) -> torch.Tensor:
    """Mean cross-entropy over the completion tokens (the prompt is masked)."""
    mask = batch["attention_mask"]
    mask = None if bool(mask.all()) else mask.to(device)   # no padding: SDPA's causal kernel, no
    out = model(input_ids=batch["input_ids"].to(device), attention_mask=mask,          # O(n^2) mask
                position_ids=batch["position_ids"].to(device), logits_to_keep=batch["keep"], use_cache=False)
    logits = out.logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                             batch["target"].to(device).reshape(-1), ignore_index=-100)


MAX_FAILURES_SHOWN = 8   # parse failures kept verbatim (first 400 characters) in the stats


def parse_check(model, tok, prefixes, *, budget: int, max_new_tokens: int, count_tokens) -> dict:
    """Greedy decoding on each prefix; parse rate and failure codes (shared verdict parser)."""
    model.eval()
    codes, ok, failures = Counter(), 0, []
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for tr, t in prefixes:
        ids = chat_prompt_ids(tok, render(tr, t, budget, count_tokens=count_tokens))
        with torch.no_grad():
            gen = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                                 eos_token_id=tok.eos_token_id,
                                 # plain greedy, as the evaluation decodes: never the checkpoint's own
                                 # generation_config (Qwen2.5's sets repetition_penalty 1.05)
                                 repetition_penalty=1.0, no_repeat_ngram_size=0)
        text = tok.decode(gen[0, len(ids):], skip_special_tokens=True)
        v = parse_verdict(text, t)
        if isinstance(v, ParseFailure):
            codes[v.code] += 1
            if len(failures) < MAX_FAILURES_SHOWN:
                failures.append({"id": tr.id, "t": t, "code": v.code, "text": text[:400]})
        else:
            ok += 1
    n = len(prefixes)
    return {"n": n, "parsed": ok, "parse_rate": ok / n if n else None,
            "failure_codes": dict(sorted(codes.items())), "failures": failures}


def check_model(cfg: WarmupConfig, model_path: str | Path | None = None) -> dict:
    """The parse check alone on `model_path` (default: the config's model, e.g. the raw base),
    on the same seeded val prefixes as after a warm-up; written to RUN/parse_check.json."""
    path = resolve_model_spec(model_path or cfg.model)
    tok = load_tokenizer(path)
    prefixes = check_prefixes(_val_trajectories(cfg), cfg.parse_check_prompts, seed=cfg.seed)
    t0 = time.perf_counter()
    res = parse_check(load_model(cfg, path), tok, prefixes, budget=prompt_budget(cfg.max_prompt_tokens, tok),
                      max_new_tokens=cfg.parse_check_max_new_tokens, count_tokens=tokenizer_counter(tok))
    res = {"model": str(path), **res, "parse_check_seconds": round(time.perf_counter() - t0, 1)}
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parse_check.json").write_text(json.dumps(res, indent=2) + "\n")
    return res


def warmup_items(cfg: WarmupConfig, tok) -> tuple[list[dict], list[tuple[list[int], list[int]]], str]:
    """(examples, their (prompt ids, completion ids), the data's description): prompts rendered
    with the one budget rule (`prompt_budget(max_prompt_tokens)`, counted with `tok`), each
    templated prompt checked against `max_prompt_tokens` as stage 1 and stage 2 check theirs."""
    trajs, src = load_training_trajectories(cfg.data, synthetic_n=cfg.synthetic_trajectories, seed=cfg.seed)
    examples = warmup_examples(trajs, cfg.max_steps * cfg.batch_size, seed=cfg.seed,
                               alarm_fraction=cfg.alarm_fraction, budget=prompt_budget(cfg.max_prompt_tokens, tok),
                               count_tokens=tokenizer_counter(tok))
    items = []
    for e in examples:
        ids = chat_prompt_ids(tok, e["messages"])
        check_prompt_length(ids, cfg.max_prompt_tokens, f"prompt for {e['traj_id']} (t={e['t']})")
        items.append((ids, completion_ids(tok, e["completion"], cfg.max_completion_tokens)[0]))
    return examples, items, src


def warmup(cfg: WarmupConfig, *, progress: bool = True) -> dict:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    torch.manual_seed(cfg.seed)
    path = resolve_model_spec(cfg.model)
    tok = load_tokenizer(path)
    _, items, src = warmup_items(cfg, tok)
    acc = make_accelerator(cfg, out)
    model = wrap_trainable(cfg, load_model(cfg, path))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    model, opt = acc.prepare(model, opt)
    pad_id = tok.pad_token_id
    history, t_train = [], time.perf_counter()
    from tqdm.auto import tqdm

    for step in tqdm(range(cfg.max_steps), desc="warm-up", disable=not progress, leave=False):
        t0 = time.perf_counter()
        chunk = items[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        n_tok = sum(len(c) for _, c in chunk)
        loss = 0.0
        for item in chunk:   # one example at a time: a padded batch makes CPU SDPA keep a dense
            with acc.autocast():   # mixed_precision bf16: CPU/GPU bf16 autocast, float32 weights
                part = completion_loss(model, _batch([item], pad_id), acc.device) * len(item[1]) / n_tok
            acc.backward(part)   # attention matrix per layer (16 GiB for 4 x 2,000 tokens)
            loss += float(part.detach())
        acc.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        opt.zero_grad()
        history.append({"step": step + 1, "loss": loss, "seconds": round(time.perf_counter() - t0, 2)})
        if (step + 1) % cfg.logging_steps == 0:
            with open(out / "log.jsonl", "a") as f:
                f.write(json.dumps(history[-1]) + "\n")
    train_s = time.perf_counter() - t_train
    final = save_final(cfg, acc, model, tok, out / "final")
    from training.model_card import write_model_card

    write_model_card(final, stage="format warm-up (not in the paper)", base_model=str(cfg.model),
                     data=src, config=cfg.to_dict(), steps=cfg.max_steps, base_model_path=path)
    merged = load_model(cfg, final)
    prefixes = check_prefixes(_val_trajectories(cfg), cfg.parse_check_prompts, seed=cfg.seed)
    t_check = time.perf_counter()
    check = parse_check(merged, tok, prefixes, budget=prompt_budget(cfg.max_prompt_tokens, tok),
                        max_new_tokens=cfg.parse_check_max_new_tokens, count_tokens=tokenizer_counter(tok))
    stats = {"data": src, "model": str(cfg.model), "steps": cfg.max_steps, "batch_size": cfg.batch_size,
             "train_seconds": round(train_s, 1),
             "seconds_per_step": round(train_s / cfg.max_steps, 2),
             "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
             "parse_check_seconds": round(time.perf_counter() - t_check, 1),
             "final": str(final), **check}
    (out / "warmup_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats
