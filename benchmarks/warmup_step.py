"""Format warm-up cost per example, float32 vs bf16 autocast (`mixed_precision: auto` resolves to
bf16 on a CPU with AVX512-BF16 or AMX-BF16): one forward and backward of one example (prompt +
completion, the loss on the completion only, as `training.warmup.trainer.completion_loss`) through
the LoRA-wrapped model of a warm-up config, in one process, rounds alternating (fp32, bf16, fp32,
...) because the machine's load swings. Also the loss of each on the same example (bf16 autocast
keeps float32 weights and gradients; only the matmuls run in bf16).

    python benchmarks/warmup_step.py [--config configs/warmup/smollm2-135m-cpu.yaml] [--prompt 2000]
        [--completion 100] [--rounds 3]
last line: fp32_s=… bf16_s=… speedup=… loss_fp32=… loss_bf16=… load=…
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/warmup/smollm2-135m-cpu.yaml")
    ap.add_argument("--model", default=None, help="overrides the config's model")
    ap.add_argument("--prompt", type=int, default=2000, help="prompt tokens")
    ap.add_argument("--completion", type=int, default=100, help="completion tokens")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch

    from training.common import load_model, wrap_trainable
    from aftraj.models import resolve_model_spec
    from training.warmup.config import load_warmup_config
    from training.warmup.trainer import _batch, completion_loss

    cfg = load_warmup_config(args.config, {"model": args.model} if args.model else None)
    torch.manual_seed(0)
    model = wrap_trainable(cfg, load_model(cfg, resolve_model_spec(cfg.model)))
    model.train()
    vocab = model.config.vocab_size
    item = (torch.randint(100, vocab - 1, (args.prompt,)).tolist(),
            torch.randint(100, vocab - 1, (args.completion,)).tolist())
    batch = _batch([item], 0)

    def step(bf16: bool) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = completion_loss(model, batch, torch.device("cpu"))
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    loss = {False: step(False), True: step(True)}        # warm both paths once
    times = {False: [], True: []}
    for _ in range(args.rounds):
        for bf16 in (False, True):
            t0 = time.perf_counter()
            loss[bf16] = step(bf16)
            times[bf16].append(time.perf_counter() - t0)
    fp32, bf16 = statistics.median(times[False]), statistics.median(times[True])
    print(json.dumps({"fp32_s": [round(x, 2) for x in times[False]], "bf16_s": [round(x, 2) for x in times[True]]}))
    print(f"fp32_s={fp32:.2f} bf16_s={bf16:.2f} speedup={fp32 / bf16:.2f} loss_fp32={loss[False]:.4f} "
          f"loss_bf16={loss[True]:.4f} load={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
