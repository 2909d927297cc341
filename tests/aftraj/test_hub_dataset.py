"""A built corpus folder is a Hugging Face dataset repository: README.md dataset card with YAML
`configs:` for train/val/test (one split name everywhere: files, `--split val`, stats) and the features, licence, how it was built and the
stats; `datasets.load_dataset(folder)` (offline) gives the three splits with the row counts of
stats.json, and no warning (the card's `dataset_info.splits` lacked num_bytes: "Ignoring part of
dataset_info", issue 25)."""

from __future__ import annotations

import json

import pytest
import yaml


@pytest.fixture(scope="module")
def built(demo_build):
    """The session's demo build (tests/conftest.py), whose folder held an unsplit `hf/` of earlier
    versions before the build."""
    return demo_build.out


def test_load_dataset_on_a_built_corpus(built, tmp_path):
    import datasets

    out = built
    card = (out / "README.md").read_text()
    assert card.startswith("---\n")
    meta = yaml.safe_load(card.split("---\n")[1])
    assert [d["split"] for d in meta["configs"][0]["data_files"]] == ["train", "val", "test"]
    assert meta["license"] == "apache-2.0"
    names = [f["name"] for f in meta["dataset_info"]["features"]]
    assert {"id", "family_id", "domain", "task", "steps", "label", "meta"} <= set(names)
    assert "## How it was built" in card and "## Stats" in card and "demo-small" in card
    assert not (out / "hf").exists()

    stats = json.loads((out / "stats.json").read_text())
    want = stats["total"]["splits"]
    ds = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "cache"))
    assert set(ds) == {"train", "val", "test"} and set(want) == {"train", "val", "test"}
    assert {k: ds[k].num_rows for k in ds} == want
    splits = {s["name"]: s for s in meta["dataset_info"]["splits"]}
    assert {k: s["num_examples"] for k, s in splits.items()} == want
    for k, s in splits.items():   # what datasets records for the split, within a few per cent
        assert s["num_bytes"] > 0 and abs(s["num_bytes"] - ds[k].info.splits[k].num_bytes) < 0.05 * s["num_bytes"]
    assert sorted(p.name for p in (out / "data").iterdir()) == [
        "test-00000-of-00001.parquet", "train-00000-of-00001.parquet", "val-00000-of-00001.parquet"]
    assert f"{sum(want.values())} trajectories" in card


def test_hub_rows_read_back_as_trajectories(built, tmp_path):
    import datasets

    from aftraj.readers import load_trajectories
    from aftraj.schema import from_hf_dataset

    ds = datasets.load_dataset(str(built), cache_dir=str(tmp_path / "cache"))
    by_id = {t.id: t for t in load_trajectories(built / "corpus.jsonl")}
    back = from_hf_dataset(ds["val"])
    assert back and all(by_id[t.id] == t for t in back)


def test_load_dataset_gives_no_warning(built, tmp_path, capfd):
    """Nothing on stderr and no warning record from `datasets` (its logger does not propagate:
    a handler is attached to it), with its progress bars off."""
    import logging
    import warnings

    import datasets

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    h = Keep(level=logging.WARNING)
    logging.getLogger("datasets").addHandler(h)
    datasets.disable_progress_bars()
    capfd.readouterr()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = datasets.load_dataset(str(built), cache_dir=str(tmp_path / "fresh-cache"))
    finally:
        logging.getLogger("datasets").removeHandler(h)
        datasets.enable_progress_bars()
    assert set(ds) == {"train", "val", "test"}
    assert [r.getMessage() for r in records] == []
    assert [str(w.message) for w in caught] == []
    assert capfd.readouterr().err == ""
