"""Stage-2 cost on CPU with SmolLM2-135M (LoRA): where a GRPO step's time goes, to choose group
size and completion length for configs/stage2/smollm2-135m-cpu.yaml. Times, for real stage-2
prompts (the shared prompt builder, synthetic runs): generation of G completions of L tokens for
one prompt (what TRL does per prompt), and one policy forward+backward plus one reference forward
over those G sequences (what the GRPO loss costs). Prints wall and process-CPU seconds per part and
the estimated step time for each (G, L, prompts per step); the machine's load shows in wall/CPU.

    python benchmarks/stage2_cpu_cost.py [--model builtin:smollm2-135m] [--lengths 32 64 96] [--groups 2 4]
"""

from __future__ import annotations

import argparse
import json
import time


def _timed(fn, *args):
    w, c = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - w, time.process_time() - c


def _generate(model, tok, ids, g: int, length: int):
    """G sampled completions of exactly `length` tokens for one prompt (what TRL does per prompt)."""
    import torch

    return model.generate(input_ids=ids.repeat(g, 1), attention_mask=torch.ones_like(ids).repeat(g, 1), do_sample=True,
                          max_new_tokens=length, min_new_tokens=length, top_k=0, pad_token_id=tok.pad_token_id)


def _loss_step(model, gen, length: int) -> None:
    """One policy forward+backward over the completions and one reference forward (adapter off)."""
    import torch

    out = model(input_ids=gen).logits[:, -length - 1:-1].float().log_softmax(-1).mean()
    out.backward()
    with torch.no_grad(), model.disable_adapter():
        model(input_ids=gen)
    model.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aftraj.models import resolve_model_spec
    from aftraj.tokens import prompt_budget, tokenizer_counter
    from training.common import synthetic_trajectories
    from training.stage2.data import build_records

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 96])
    ap.add_argument("--groups", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--prompts-per-step", type=int, default=2)
    a = ap.parse_args(argv)

    path = resolve_model_spec(a.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                             task_type="CAUSAL_LM"))
    recs, _ = build_records(synthetic_trajectories(24), max_prompts=8, unsafe_fraction=0.5, seed=0,
                            budget=prompt_budget(2048), count_tokens=tokenizer_counter(tok))
    ids = tok.apply_chat_template(recs[0]["prompt"], add_generation_prompt=True, return_dict=True,
                                  return_tensors="pt")["input_ids"]
    print(json.dumps({"threads": torch.get_num_threads(), "prompt_tokens": ids.shape[1]}))
    for g in a.groups:
        for length in a.lengths:
            torch.manual_seed(0)
            model.eval()
            gen, gw, gc = _timed(_generate, model, tok, ids, g, length)
            model.train()
            _, tw, tc = _timed(_loss_step, model, gen, length)
            step_w = a.prompts_per_step * (gw + tw)
            print(json.dumps({"G": g, "L": length, "gen_wall_s": round(gw, 2), "gen_cpu_s": round(gc, 2),
                              "loss_wall_s": round(tw, 2), "loss_cpu_s": round(tc, 2),
                              "est_step_wall_s": round(step_w, 1),
                              "est_step_cpu_s": round(a.prompts_per_step * (gc + tc), 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
