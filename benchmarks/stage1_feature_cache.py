"""Stage-1 per-pair cost with and without the frozen-layer feature cache (`feature_cache: true`,
`aftraj.scoring.pair_features`): with only the top N decoder layers trainable, one forward and
backward of a pair through the whole model (`batching: per_pair`) vs through the top N layers
from the cached input of layer L-N, on the same model, prompt and completions, in one process,
rounds alternating (uncached, cached, uncached, ...) because the machine's load swings. Also the
one-off cost of capturing a pair's features (a no-grad forward of the whole model, done with the
reference log-probs) and the features' size.

    python benchmarks/stage1_feature_cache.py [--model builtin:smollm2-135m] [--prompt 1100]
        [--trainable-layers 2] [--rounds 3]
last line: uncached_s=… cached_s=… speedup=… capture_s=… feature_mb_per_pair=… load=…

Measured 2026-12-01 (2-core AVX2 machine, fp32, SmolLM2-135M, 1,100-token prompt, 70/60-token
completions, top 2 layers, load ~7 from a demo run beside it): see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--prompt", type=int, default=1100, help="prompt tokens")
    ap.add_argument("--trainable-layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from aftraj.scoring import pair_features, pair_token_logps, top_layers_only
    from training.common import freeze_below
    from aftraj.models import resolve_model_spec
    from training.stage1.trainer import nbytes

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_spec(args.model), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    freeze_below(model, args.trainable_layers)
    vocab = model.config.vocab_size
    prompt = torch.randint(100, vocab - 1, (args.prompt,)).tolist()
    comps = [torch.randint(100, vocab - 1, (70,)).tolist(), torch.randint(100, vocab - 1, (60,)).tolist()]

    t0 = time.perf_counter()
    feats, _ = pair_features(model, prompt, comps, args.trainable_layers)
    capture = time.perf_counter() - t0

    def uncached():
        c, r = pair_token_logps(model, prompt, comps)
        (c.sum() - r.sum()).backward()

    def cached():
        with top_layers_only(model, args.trainable_layers):
            c, r = pair_token_logps(model, prompt, comps, embeds=feats)
        (c.sum() - r.sum()).backward()

    times = {"uncached": [], "cached": []}
    for _ in range(args.rounds):
        for name, f in (("uncached", uncached), ("cached", cached)):
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    u, c = statistics.median(times["uncached"]), statistics.median(times["cached"])
    print(json.dumps({"rounds": times, "threads": torch.get_num_threads()}))
    print(f"uncached_s={u:.3f} cached_s={c:.3f} speedup={u / c:.1f} capture_s={capture:.3f} "
          f"feature_mb_per_pair={nbytes([feats]) / 2 ** 20:.2f} load={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
