"""Write a built corpus: corpus.jsonl (our schema), train/val/test.jsonl, a Hugging Face
`datasets` export (hf/), and the released AFTraj-2K parquet layout (aftraj_safe.parquet,
aftraj_unsafe.parquet, splits_test.json) that `aftraj.readers.iter_aftraj_parquet` reads back.
Everything is byte-stable: fixed order, fixed key order, no timestamps.

    from aftraj.corpus.export import export_corpus
    export_corpus(trajs, split_of, "out/demo")
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from aftraj.corpus.splits import SPLITS
from aftraj.schema import Trajectory, to_hf_dataset, write_jsonl

# AFTraj's unsafe_source spelling for our label sources
_UNSAFE_SOURCE = {"injected": "injected", "diagnosed": "diagnosed"}


def _turn(step) -> dict:
    action = ""
    if step.kind == "tool_call" and step.tool is not None:
        action = json.dumps([{"name": step.tool, "arguments": json.dumps(step.arguments or {}, sort_keys=True)}],
                            sort_keys=True)
    elif step.kind == "tool_result" and step.tool is not None:
        action = json.dumps([{"name": step.tool}])   # which tool answered (the reader keeps it)
    role = "environment" if step.kind == "tool_result" else step.agent
    return {"role": role, "thought": "", "action": action, "content": step.content}


def aftraj_row(t: Trajectory, split: str) -> dict:
    lb = t.label
    tools = sorted({s.tool for s in t.steps if s.tool})
    return {
        "conv_id": t.id, "family_id": t.family_id, "domain": t.domain, "task": t.task,
        "gold_answer": t.reference_answer, "turns": [_turn(s) for s in t.steps],
        "tools": json.dumps(tools), "num_turns": len(t.steps),
        "mistake_step": lb.decisive_step if lb.unsafe else None,
        "mistake_agent": lb.decisive_agent if lb.unsafe else None,
        "mistake_reason": lb.reason if lb.unsafe else None,
        "unsafe_source": _UNSAFE_SOURCE.get(lb.label_source, lb.label_source) if lb.unsafe else None,
        "split": split,
    }


def _parquet_schema():
    import pyarrow as pa

    turn = pa.struct([("role", pa.string()), ("thought", pa.string()), ("action", pa.string()),
                      ("content", pa.string())])
    return pa.schema([("conv_id", pa.string()), ("family_id", pa.string()), ("domain", pa.string()),
                      ("task", pa.string()), ("gold_answer", pa.string()), ("turns", pa.list_(turn)),
                      ("tools", pa.string()), ("num_turns", pa.int64()), ("mistake_step", pa.int64()),
                      ("mistake_agent", pa.string()), ("mistake_reason", pa.string()),
                      ("unsafe_source", pa.string()), ("split", pa.string())])


def write_aftraj_parquet(trajs: list[Trajectory], split_of: dict[str, str], out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _parquet_schema()
    for name, unsafe in (("aftraj_safe.parquet", False), ("aftraj_unsafe.parquet", True)):
        rows = [aftraj_row(t, split_of[t.family_id]) for t in trajs if t.label.unsafe == unsafe]
        table = pa.Table.from_pylist(rows, schema=schema)
        pq.write_table(table, out / name, compression="zstd", write_statistics=False)
    test_ids = sorted(t.id for t in trajs if split_of[t.family_id] == "test")
    (out / "splits_test.json").write_text(json.dumps(test_ids, indent=0) + "\n")


def export_corpus(trajs: list[Trajectory], split_of: dict[str, str], out: str | Path, *, jsonl: bool = True,
                  hf: bool = True, parquet: bool = True) -> dict[str, str]:
    """Write every format; returns {what: path}. `trajs` must already be in their final order."""
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
        import datasets

        datasets.disable_progress_bars()
        if (out / "hf").exists():
            shutil.rmtree(out / "hf")
        to_hf_dataset(trajs).save_to_disk(str(out / "hf"))
        written["hf"] = str(out / "hf")
    if parquet:
        write_aftraj_parquet(trajs, split_of, out)
        written["parquet"] = str(out)
    return written
