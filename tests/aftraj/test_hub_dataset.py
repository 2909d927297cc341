"""A built corpus folder is a Hugging Face dataset repository: README.md dataset card with YAML
`configs:` for train/validation/test and the features, licence, how it was built and the
stats; `datasets.load_dataset(folder)` (offline) gives the three splits with the row counts of
stats.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

DEMO = Path(__file__).resolve().parents[2] / "configs" / "corpus" / "demo-small.yaml"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from aftraj.corpus.build import build_corpus
    from aftraj.corpus.config import load_corpus_config

    out = tmp_path_factory.mktemp("hub-corpus")
    (out / "hf").mkdir()   # the unsplit folder of earlier versions is replaced
    build_corpus(load_corpus_config(DEMO), out)
    return out


def test_load_dataset_on_a_built_corpus(built, tmp_path):
    import datasets

    out = built
    card = (out / "README.md").read_text()
    assert card.startswith("---\n")
    meta = yaml.safe_load(card.split("---\n")[1])
    assert [d["split"] for d in meta["configs"][0]["data_files"]] == ["train", "validation", "test"]
    assert meta["license"] == "apache-2.0"
    names = [f["name"] for f in meta["dataset_info"]["features"]]
    assert {"id", "family_id", "domain", "task", "steps", "label", "meta"} <= set(names)
    assert "## How it was built" in card and "## Stats" in card and "demo-small" in card
    assert not (out / "hf").exists()

    stats = json.loads((out / "stats.json").read_text())
    want = stats["total"]["splits"]
    ds = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "cache"))
    assert set(ds) == {"train", "validation", "test"}
    assert {"train": ds["train"].num_rows, "val": ds["validation"].num_rows,
            "test": ds["test"].num_rows} == want
    assert {s["name"]: s["num_examples"] for s in meta["dataset_info"]["splits"]} == {
        "train": want["train"], "validation": want["val"], "test": want["test"]}
    assert f"{sum(want.values())} trajectories" in card


def test_hub_rows_read_back_as_trajectories(built, tmp_path):
    import datasets

    from aftraj.readers import load_trajectories
    from aftraj.schema import from_hf_dataset

    ds = datasets.load_dataset(str(built), cache_dir=str(tmp_path / "cache"))
    by_id = {t.id: t for t in load_trajectories(built / "corpus.jsonl")}
    back = from_hf_dataset(ds["validation"])
    assert back and all(by_id[t.id] == t for t in back)
