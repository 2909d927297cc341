"""Write a built corpus: corpus.jsonl (our schema), train/val/test.jsonl, a Hugging Face dataset
repository (README.md card with `configs:` + data/{train,val,test}-*.parquet, so
`datasets.load_dataset(folder)` gives the three splits), and the released AFTraj-2K parquet layout
(aftraj_safe.parquet, aftraj_unsafe.parquet, splits_test.json: `aftraj.released`, which reads it
back as the release's own loader does). Everything is byte-stable: fixed order, fixed key order,
no timestamps.

    from aftraj.corpus.export import export_corpus
    export_corpus(trajs, split_of, "out/demo")
    aftraj export --to aftraj-parquet corpus.jsonl --out released/     # any readable source
"""

from __future__ import annotations

import shutil
from pathlib import Path

from aftraj.corpus.splits import SPLITS
from aftraj.released import write_aftraj_parquet
from aftraj.schema import Trajectory, to_hf_dataset, write_jsonl

# --------------------------------------------------------------------------- Hub dataset repository

# One split name everywhere (issue 25): the files (val.jsonl), `--split val`, stats.json and the
# Hub layout all say "val" (the Hub accepts any name; "validation" is only a convention).
HUB_SPLITS = {"train": "train", "val": "val", "test": "test"}   # ours -> the Hub's names


def write_hub_dataset(trajs: list[Trajectory], split_of: dict[str, str], out: Path,
                      stats: dict | None = None) -> dict[str, int]:
    """Make `out` a dataset repository: data/{train,val,test}-00000-of-00001.parquet
    (one schema, `aftraj.schema.to_hf_rows`: free-form objects as JSON strings) and a README.md
    dataset card whose YAML `configs:` names the three splits, so `datasets.load_dataset(out)`
    (or `push_to_hub`) gives them with these row counts. Returns {hub split: rows}."""
    import datasets

    datasets.disable_progress_bars()
    ds = to_hf_dataset(trajs)
    data = out / "data"
    if data.exists():
        shutil.rmtree(data)
    data.mkdir(parents=True)
    counts, sizes = {}, {}
    for ours, hub in HUB_SPLITS.items():
        idx = [i for i, t in enumerate(trajs) if split_of[t.family_id] == ours]
        part = ds.select(idx).flatten_indices()
        path = data / f"{hub}-00000-of-00001.parquet"
        part.to_parquet(str(path))
        counts[hub] = len(idx)
        # what `datasets` records for a split: its Arrow bytes, and the file's size for download
        sizes[hub] = {"num_bytes": int(part.data.nbytes), "download_size": path.stat().st_size}
    (out / "README.md").write_text(dataset_card(trajs, counts, ds.features, stats, sizes), encoding="utf-8")
    return counts


def dataset_card(trajs: list[Trajectory], counts: dict[str, int], features, stats: dict | None,
                 sizes: dict[str, dict] | None = None) -> str:
    """The README.md of the dataset repository. `dataset_info.splits` carries name, num_bytes and
    num_examples per split (what `datasets` reads; without num_bytes it warns and ignores them)."""
    import yaml

    cfg = (stats or {}).get("config") or {}
    name = cfg.get("name") or "aftraj-corpus"
    meta = {
        "license": "apache-2.0", "language": ["en"], "pretty_name": f"AgentForesight corpus: {name}",
        "task_categories": ["text-classification"],
        "tags": ["multi-agent", "failure-attribution", "online-auditing", "agentforesight"],
        "size_categories": ["n<1K" if len(trajs) < 1000 else "1K<n<10K" if len(trajs) < 10000 else "10K<n<100K"],
        "configs": [{"config_name": "default", "default": True, "data_files": [
            {"split": hub, "path": f"data/{hub}-*.parquet"} for hub in HUB_SPLITS.values()]}],
        "dataset_info": {"features": features._to_yaml_list(),
                         "splits": [{"name": hub, "num_bytes": (sizes or {}).get(hub, {}).get("num_bytes", 0),
                                     "num_examples": n} for hub, n in counts.items()]},
    }
    if sizes:
        meta["dataset_info"]["download_size"] = sum(v["download_size"] for v in sizes.values())
        meta["dataset_info"]["dataset_size"] = sum(v["num_bytes"] for v in sizes.values())
    n_safe = sum(not t.label.unsafe for t in trajs)
    rows = ["| domain | trajectories | safe | unsafe |", "|---|---|---|---|"]
    for d in sorted({t.domain for t in trajs}):
        ts = [t for t in trajs if t.domain == d]
        rows.append(f"| {d} | {len(ts)} | {sum(not t.label.unsafe for t in ts)} | "
                    f"{sum(t.label.unsafe for t in ts)} |")
    sources = {}
    for t in trajs:
        sources[t.label.label_source] = sources.get(t.label.label_source, 0) + 1
    how = (f"Built by `aftraj corpus build` (config `{name}`, seed {stats.get('seed', cfg.get('seed', '?'))}, "
           f"policy backend `{(cfg.get('policy') or {}).get('backend', '?')}`)" if stats else
           "Written by `aftraj` from trajectories in its schema")
    body = f"""# AgentForesight corpus: {name}

Multi-agent trajectories for online auditing (AgentForesight, arXiv 2605.08715): safe runs, and
unsafe runs labelled with the decisive step k* and agent a*. One row per trajectory, in the
schema of `aftraj/schema.py` (`steps` is the list of steps; `meta`, `label.provenance` and
`steps[].arguments` / `steps[].meta` are JSON strings).

## How it was built

{how}: rollouts of multi-agent templates, safe runs kept only when the outcome checker, the tool
contract and sub-goal coherence all hold; unsafe runs from injected errors that still fail after
a replay, and from diagnosed natural failures whose proposed fix flips the replay. Splits are by
task family (no task on both sides). `stats.md` / `stats.json` beside this card hold every
figure of the build.

## Stats

{len(trajs)} trajectories ({n_safe} safe, {len(trajs) - n_safe} unsafe); label sources
{", ".join(f"{k} {v}" for k, v in sorted(sources.items()))}; splits
{", ".join(f"{k} {v}" for k, v in counts.items())}.

{chr(10).join(rows)}

## Use

```python
import datasets
from aftraj.schema import from_hf_dataset

ds = datasets.load_dataset("path/to/this/folder")        # train / val / test
trajs = from_hf_dataset(ds["test"])                        # back to aftraj Trajectory objects
```

Also here: `corpus.jsonl` (every split, our lossless JSON Lines), `train.jsonl` / `val.jsonl` /
`test.jsonl`, and the released AFTraj-2K parquet layout (`aftraj_safe.parquet`,
`aftraj_unsafe.parquet`, `splits_test.json`).

## Licence

Apache-2.0, as the code that generated it. Corpora built from public task pools (MATH-500,
HumanEval+, MBPP+, HotpotQA, GAIA) also carry those pools' licences.
"""
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n\n" + body


def export_corpus(trajs: list[Trajectory], split_of: dict[str, str], out: str | Path, *, jsonl: bool = True,
                  hf: bool = True, parquet: bool = True, stats: dict | None = None) -> dict[str, str]:
    """Write every format; returns {what: path}. `trajs` must already be in their final order.
    `hf` makes the folder a Hub dataset repository (`write_hub_dataset`); `stats` (the build's)
    goes into its card."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    write_jsonl(trajs, out / "corpus.jsonl")
    written["corpus"] = str(out / "corpus.jsonl")
    if jsonl:
        for s in SPLITS:
            write_jsonl([t for t in trajs if split_of[t.family_id] == s], out / f"{s}.jsonl")
            written[s] = str(out / f"{s}.jsonl")
    if hf:
        if (out / "hf").exists():   # the unsplit save_to_disk folder of earlier versions
            shutil.rmtree(out / "hf")
        write_hub_dataset(trajs, split_of, out, stats)
        written["hf"] = str(out / "data")
    if parquet:
        write_aftraj_parquet(trajs, split_of, out)
        written["parquet"] = str(out)
    return written
