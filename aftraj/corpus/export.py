"""Write a built corpus: corpus.jsonl (our schema), train/val/test.jsonl, a Hugging Face dataset
repository (README.md card with `configs:` + data/{train,val,test}-*.parquet, so
`datasets.load_dataset(folder)` gives the three splits), and the released AFTraj-2K parquet layout (aftraj_safe.parquet,
aftraj_unsafe.parquet, splits_test.json) that `aftraj.readers.iter_aftraj_parquet` reads back
and the release's own loader reads. Everything is byte-stable: fixed order, fixed key order,
no timestamps.

    from aftraj.corpus.export import export_corpus
    export_corpus(trajs, split_of, "out/demo")
    aftraj export --to aftraj-parquet corpus.jsonl --out released/     # any readable source
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from aftraj.corpus.splits import SPLITS
from aftraj.schema import Trajectory, to_hf_dataset, write_jsonl

# AFTraj's unsafe_source spelling for our label sources (a row read from the release keeps its own)
_UNSAFE_SOURCE = {"injected": "injected", "diagnosed": "diagnosed"}


def release_action(step) -> str | None:
    """A step's `action` string in the released layout: the release's own string when the step
    was read from it, else our tool call as the release spells one."""
    if "action" in step.meta:           # read from the release: its string, byte for byte
        return step.meta["action"]
    if step.kind == "tool_call" and step.tool is not None:
        return json.dumps([{"name": step.tool, "arguments": json.dumps(step.arguments or {}, sort_keys=True)}],
                          sort_keys=True)
    if step.kind == "tool_result" and step.tool is not None:
        return json.dumps([{"name": step.tool}])   # which tool answered (the reader keeps it)
    return None


def _turn(step, null_content: bool) -> dict:
    role = "environment" if step.kind == "tool_result" else step.agent
    return {"role": role, "thought": step.thought, "action": release_action(step),
            "content": None if null_content else step.content}


def aftraj_row(t: Trajectory) -> dict:
    """One row in the released column layout (`aftraj.readers.AFTRAJ_COLUMNS`). A trajectory
    read from the release gives back its row unchanged: id, domain spelling, thought, action,
    tools, num_turns and the label columns of safe rows are kept in `meta['aftraj']`."""
    lb, rel = t.label, t.meta.get("aftraj") or {}
    nulls = set(rel.get("null_content") or ())
    if "tools" in rel:
        tools = rel["tools"]
    else:
        tools = [{"name": n, "description": None} for n in sorted({s.tool for s in t.steps if s.tool})]
    if lb.unsafe:
        source = lb.provenance.get("unsafe_source", _UNSAFE_SOURCE.get(lb.label_source, lb.label_source))
        tail = (lb.decisive_step, lb.decisive_agent, lb.reason, source)
    else:
        tail = (-1, rel.get("mistake_agent"), rel.get("mistake_reason"), rel.get("unsafe_source"))
    return {
        "conv_id": t.id, "domain": rel.get("domain", t.domain), "task": t.task,
        "gold_answer": t.reference_answer,
        "num_turns": rel["num_turns"] if "num_turns" in rel else len(t.steps),
        "turns": [_turn(s, s.index in nulls) for s in t.steps], "tools": tools,
        "mistake_step": tail[0], "mistake_agent": tail[1], "mistake_reason": tail[2],
        "unsafe_source": tail[3],
    }


def aftraj_schema():
    """The released parquet schema (column order of `aftraj.readers.AFTRAJ_COLUMNS`)."""
    import pyarrow as pa

    turn = pa.struct([("role", pa.string()), ("thought", pa.string()), ("action", pa.string()),
                      ("content", pa.string())])
    tool = pa.struct([("name", pa.string()), ("description", pa.string())])
    return pa.schema([("conv_id", pa.string()), ("domain", pa.string()), ("task", pa.string()),
                      ("gold_answer", pa.string()), ("num_turns", pa.int64()),
                      ("turns", pa.list_(turn)), ("tools", pa.list_(tool)),
                      ("mistake_step", pa.int64()), ("mistake_agent", pa.string()),
                      ("mistake_reason", pa.string()), ("unsafe_source", pa.string())])


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_aftraj_parquet(trajs: list[Trajectory], split_of: dict[str, str] | None, out: Path) -> dict[str, int]:
    """The released layout in `out`: aftraj_safe.parquet, aftraj_unsafe.parquet and
    splits_test.json ({"test_safe": […], "test_unsafe": […]}), which the release's own loader
    reads; plus splits.json (every split by conv_id) and, where a family is not its id,
    families.json, so our reader gets the train/val/test families back. `split_of` maps
    family_id -> split (a corpus build); None takes each trajectory's meta['split'].
    Returns {file: rows}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    schema, counts = aftraj_schema(), {}
    for name, unsafe in (("aftraj_safe.parquet", False), ("aftraj_unsafe.parquet", True)):
        rows = [aftraj_row(t) for t in trajs if t.label.unsafe == unsafe]
        table = pa.Table.from_pylist(rows, schema=schema)
        _write_atomic(out / name, lambda p, table=table: pq.write_table(
            table, p, compression="zstd", write_statistics=False))
        counts[name] = len(rows)
    split = {t.id: (split_of[t.family_id] if split_of is not None else t.meta.get("split")) for t in trajs}
    if any(v is not None for v in split.values()):
        test = {"test_safe": [t.id for t in trajs if split[t.id] == "test" and not t.label.unsafe],
                "test_unsafe": [t.id for t in trajs if split[t.id] == "test" and t.label.unsafe]}
        by_split: dict[str, list[str]] = {}
        for t in trajs:
            if split[t.id] is not None:
                by_split.setdefault(split[t.id], []).append(t.id)
        for name, obj in (("splits_test.json", test), ("splits.json", by_split)):
            _write_atomic(out / name, lambda p, obj=obj: p.write_text(json.dumps(obj, indent=1) + "\n"))
    families = {t.id: t.family_id for t in trajs if t.family_id != t.id}
    if families:
        _write_atomic(out / "families.json",
                      lambda p: p.write_text(json.dumps(families, indent=1, sort_keys=True) + "\n"))
    else:
        (out / "families.json").unlink(missing_ok=True)
    return counts


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
