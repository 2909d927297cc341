"""Where a floor finds its train and val records (eval/auditors/floors.py, reading.py): the split
beside the evaluated data, or a `train=PATH` / `val=PATH` file's records of that split. A leaf:
it registers no auditor and imports no other auditor module.

    python -c "from eval.auditors.splits import split_beside; print(len(split_beside('out/aftraj-2k', 'val')))"
"""

from __future__ import annotations

from pathlib import Path

from aftraj.schema import Trajectory


def split_beside(data: str | Path | None, split: str = "train") -> list[Trajectory]:
    """The `split` records next to `data`: DIR/<split>.jsonl for DIR/<other>.jsonl or DIR, else
    the records of corpus.jsonl whose meta.split is `split`. Raises ValueError when there is none."""
    from aftraj.schema import iter_jsonl

    if data is None:
        raise ValueError(f"a floor needs the data path (--data) or {split}=PATH to fit on")
    p = Path(data)
    folder = p if p.is_dir() else p.parent
    if p.is_file() and p.name == f"{split}.jsonl":
        return list(iter_jsonl(p))
    if p.is_file() and (folder / f"{split}.jsonl").is_file():
        return list(iter_jsonl(folder / f"{split}.jsonl"))
    if p.is_dir() and (p / f"{split}.jsonl").is_file():
        return list(iter_jsonl(p / f"{split}.jsonl"))
    # the file itself (a corpus.jsonl), else the corpus.jsonl beside it (DIR/test.jsonl) or in DIR
    for corpus in dict.fromkeys([p, folder / "corpus.jsonl"] if p.is_file() else [p / "corpus.jsonl"]):
        if corpus.is_file():
            got = [t for t in iter_jsonl(corpus) if t.meta.get("split") == split]
            if got:
                return got
    raise ValueError(f"no {split} split found for {data} (expected {split}.jsonl beside it, or records "
                     f"with meta.split == {split!r}); pass {split}=PATH")


def records_of_file(path: str | Path, split: str = "train") -> list[Trajectory]:
    """The records of a `train=PATH` (`val=PATH`) file: those with meta.split == `split` when the
    file holds splits (a corpus.jsonl), the whole file when none has a split. Raises ValueError
    when the file has splits but none of `split`."""
    from aftraj.readers import load_trajectories

    trajs = load_trajectories(path)
    if not any("split" in t.meta for t in trajs):
        return trajs
    got = [t for t in trajs if t.meta.get("split") == split]
    if not got:
        splits = sorted({str(t.meta.get("split")) for t in trajs})
        raise ValueError(f"{path}: holds splits {', '.join(splits)} but no record with meta.split == {split!r}; "
                         f"a floor {'fits on train' if split == 'train' else 'tunes on ' + split} records only")
    return got
