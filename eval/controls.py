"""Controls for the linear probe's post-vs-twin figure (issue 21): what a reader with no model can
get from the same held-out twin pairs.

- length: "the longer step k* alarms" (post and twin share steps 0..k*-1 and the agent at k*, so
  the content of step k* is all they differ in; a length rule looks at its size only);
- bag of tokens: L2 logistic regression (eval.probe.fit_logistic, the linear probe's own fit and
  defaults) on log(1 + count) of each tokenizer id in the rendered prompt, fitted on the same train
  pairs the linear probe uses (same filter, same seeded sample) and scored by post-beats-twin.

    python -m eval.controls --tokenizer runs/ablation-cpu/warmup/final \\
        --train runs/ablation-cpu/corpus/train.jsonl --heldout runs/ablation-cpu/probe-data/heldout.jsonl \\
        --train-pairs 120 --max-post-tokens 1100 --out reports/ablation-cpu/controls.json

(It made `reports/ablation-cpu/controls.json`, the controls of the CPU ablation's ladder.)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from aftraj.errors import UsageError
from aftraj.guard import run_guarded
from aftraj.schema import read_jsonl
from eval.probe import beats, fit_logistic, probe_prompts


def _check_inputs(a: argparse.Namespace) -> None:
    """Every input is there before torch loads and the prompts are rendered (a missing file was
    a traceback from open() after that)."""
    for opt, path, want in (("--tokenizer", a.tokenizer, "folder"), ("--train", a.train, "file"),
                            ("--heldout", a.heldout, "file")):
        p = Path(path)
        if not (p.is_dir() if want == "folder" else p.is_file()):
            raise UsageError(f"{opt} {path}: no such {want}")
    if a.out is not None and not a.out.parent.is_dir():
        raise UsageError(f"--out {a.out}: the folder {a.out.parent} does not exist")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--train-pairs", type=int, default=120)
    ap.add_argument("--max-post-tokens", type=int, default=1100)
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    _check_inputs(a)

    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer)

    def count(s: str) -> int:
        return len(tok(s, add_special_tokens=False)["input_ids"])

    def pairs(path: str) -> list[dict]:
        return [i for i in probe_prompts(read_jsonl(path), budget=None, count_tokens=count,
                                         max_post_tokens=a.max_post_tokens) if "twin" in i["prompts"]]

    tr, te = pairs(a.train), pairs(a.heldout)
    if len(tr) > a.train_pairs:            # the linear probe's sample (eval.probe.linear_probe)
        tr = random.Random(a.seed).sample(tr, a.train_pairs)

    def size(i: dict, s: str) -> float:
        return float(len(i["runs"][s].steps[i["traj"].label.decisive_step].content))

    length = [{"post": {"d": size(i, "post")}, "twin": {"d": size(i, "twin")}} for i in te]

    vocab = len(tok)

    def feats(items: list[dict]):
        rows = []
        for i in items:
            for s in ("post", "twin"):
                ids = tok("\n".join(m["content"] for m in i["prompts"][s].messages),
                          add_special_tokens=False)["input_ids"]
                v = torch.zeros(vocab)
                v.index_add_(0, torch.tensor(ids), torch.ones(len(ids)))
                rows.append(torch.log1p(v))
        return torch.stack(rows)

    x_tr, x_te = feats(tr), feats(te)
    keep = x_tr.std(0) > 0
    x_tr, x_te = x_tr[:, keep], x_te[:, keep]
    y = torch.tensor([1.0, 0.0] * len(tr))
    w, b, mean, std = fit_logistic(x_tr, y)
    s_tr, s_te = ((x_tr - mean) / std) @ w + b, ((x_te - mean) / std) @ w + b
    bow = [{"post": {"d": float(s_te[2 * j])}, "twin": {"d": float(s_te[2 * j + 1])}} for j in range(len(te))]
    res = {"n_train_pairs": len(tr), "n_heldout_pairs": len(te),
           "length_rule": beats(length, "post", "twin", "d", a.n_boot, a.seed),
           "bag_of_tokens": {**beats(bow, "post", "twin", "d", a.n_boot, a.seed),
                             "features": int(keep.sum()),
                             "train_accuracy": float(((s_tr > 0).float() == y).float().mean())}}
    text = json.dumps(res, indent=1) + "\n"
    if a.out:
        a.out.write_text(text, encoding="utf-8")
    print(text, end="")
    return res


def _cli(argv: list[str]) -> int:
    main(argv)
    return 0


if __name__ == "__main__":   # a missing or bad input: one line naming it, exit 2 (aftraj.guard)
    sys.exit(run_guarded(_cli, sys.argv[1:], "controls.py"))
