"""Per-sample cost of the sandbox against an earlier design, measured side by side in one run.

    .venv/bin/python benchmarks/sandbox_cost.py                        # 240 samples a design and mode
    .venv/bin/python benchmarks/sandbox_cost.py --n 600 --workers 2 --isolation none
    .venv/bin/python benchmarks/sandbox_cost.py --ref 2f8b9f7 --ref bca5676  # also the reverted design

The current design (the working tree's aftraj/corpus/sandbox.py: a zygote per runner, one fork
per sample) runs against each --ref, the sandbox as it was at that commit, read with `git show`
(default 2f8b9f7: the last commit before the zygote, whose runner forked itself, ctypes and all,
per sample; bca5676 is the reverted design that executed a fresh interpreter per sample). Every
design gets its own warm Sandbox; the samples are cut into --rounds batches and each batch runs
on every design in turn, the order rotating, so that a change of the machine's load falls on all
of them alike. Samples are trivial (`def f(x): return x + i`, two tests), distinct (no cache hit).

Printed per isolation mode: ms_per_sample for each design, the ratio current/ref, the start-up of
one runner (first sample included), and the load average before and after. Wall clock.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aftraj.corpus import sandbox as current  # noqa: E402

FILES = ("sandbox.py", "sandbox_runner.py", "sandbox_zygote.py")


def load_ref(ref: str, folder: Path):
    """The sandbox module as it was at commit `ref` (git show), importable on its own."""
    dest = folder / f"sandbox_at_{ref}"
    dest.mkdir()
    for name in FILES:
        try:
            text = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:aftraj/corpus/{name}"], check=True,
                                  capture_output=True, text=True).stdout
        except subprocess.CalledProcessError as e:
            if name == "sandbox_zygote.py":
                continue                       # older designs had no zygote
            raise SystemExit(f"benchmarks/sandbox_cost.py: cannot read aftraj/corpus/{name} at {ref}: "
                             f"{e.stderr.strip()} (a git checkout is needed for the comparison)") from e
        (dest / name).write_text(text)
    spec = importlib.util.spec_from_file_location(f"sandbox_at_{ref}", dest / "sandbox.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def items(tag: int, start: int, n: int):
    return [(f"def f(x):\n    return x + {i}  # {tag}\n", (f"assert f(1) == {i + 1}", "assert f(0) >= 0"))
            for i in range(start, start + n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=240, help="samples per design and mode")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--isolation", nargs="+", default=["namespaces", "none"])
    ap.add_argument("--ref", action="append", help="commit of an earlier design (repeatable; default 2f8b9f7)")
    args = ap.parse_args()
    refs = args.ref or ["2f8b9f7"]
    per_round = max(1, args.n // args.rounds)
    with tempfile.TemporaryDirectory(prefix="sandbox-cost-") as tmp:
        designs = [("current", current)] + [(f"ref {r}", load_ref(r, Path(tmp))) for r in refs]
        for iso in args.isolation:
            load0 = os.getloadavg()
            boxes, startup = {}, {}
            for name, mod in designs:
                t0 = time.perf_counter()
                sb = mod.Sandbox(timeout_s=2, isolation="auto" if iso == "namespaces" else iso, workers=args.workers)
                warm = sb.run_many(items(-1, 0, max(2, args.workers)))   # every worker's runner started
                startup[name] = time.perf_counter() - t0
                if iso == "namespaces" and sb.isolation != "namespaces":
                    print("isolation=namespaces unavailable here: skipped")
                    sb.close()
                    break
                assert all(r.passed for r in warm), [r.results for r in warm]
                boxes[name] = sb
            else:
                spent = {name: 0.0 for name in boxes}
                for k in range(args.rounds):
                    order = list(boxes)[k % len(boxes):] + list(boxes)[:k % len(boxes)]
                    for name in order:
                        batch = items(k, k * per_round, per_round)
                        t0 = time.perf_counter()
                        runs = boxes[name].run_many(batch)
                        spent[name] += time.perf_counter() - t0
                        assert all(r.passed for r in runs), (name, [r.results for r in runs if not r.passed][:3])
                load1 = os.getloadavg()
                n = per_round * args.rounds
                ms = {name: 1000 * spent[name] / n for name in boxes}
                print(f"isolation={iso} workers={args.workers} samples_per_design={n} rounds={args.rounds} "
                      f"loadavg_before={load0[0]:.2f},{load0[1]:.2f},{load0[2]:.2f} "
                      f"loadavg_after={load1[0]:.2f},{load1[1]:.2f},{load1[2]:.2f}")
                for name in boxes:
                    print(f"  {name:>14}: ms_per_sample={ms[name]:.2f} runner_startup_s={startup[name]:.2f}")
                for name in boxes:
                    if name != "current":
                        print(f"  ratio current/{name.split()[1]}={ms['current'] / ms[name]:.2f}")
            for sb in boxes.values():
                sb.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
