"""Corpus configs: both shipped YAMLs validate; bad keys and values name the file and key."""

from __future__ import annotations

import pytest

from aftraj.config import ConfigError
from aftraj.corpus.config import ERROR_TYPES, config_from_dict, load_corpus_config
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_shipped_configs_load():
    big = load_corpus_config(REPO / "configs/corpus/aftraj-2k-scripted.yaml")
    small = load_corpus_config(REPO / "configs/corpus/demo-small.yaml")
    assert big.tasks.math + big.tasks.coding + big.tasks.agentic >= 1100
    assert small.policy.backend == big.policy.backend == "scripted"
    assert set(big.injection.types) == set(ERROR_TYPES) and len(ERROR_TYPES) >= 6
    assert big.max_steps == 40


@pytest.mark.parametrize("raw, key", [
    ({"name": "x", "tasks": {"math": -1}}, "tasks.math"),
    ({"name": "x", "tasks": {"maths": 3}}, "tasks.maths"),
    ({"name": "x", "policy": {"backend": "openai"}}, "policy.base_url"),
    ({"name": "x", "policy": {"backend": "gpt"}}, "policy.backend"),
    ({"name": "x", "slips": {"catch_rate": 1.5}}, "slips.catch_rate"),
    ({"name": "x", "injection": {"types": ["typo"]}}, "injection.types"),
    ({"name": "x", "splits": {"train": 0.5, "val": 0.1, "test": 0.1}}, "splits"),
    ({"name": "x", "max_steps": 41}, "max_steps"),
    ({"name": "x", "public_pools": [{"kind": "math500", "path": "m.jsonl"}]}, "public_pools"),
    ({"seed": 1}, "name"),
    ({"name": "x", "colour": 1}, "colour"),
    ({"name": "x", "export": {"hf": "no"}}, "export.hf"),
    ({"name": "x", "sandbox": {"timeout_s": True}}, "sandbox.timeout_s"),
])
def test_bad_values_name_the_key(raw, key):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert str(e.value).startswith(key), str(e.value)


def test_file_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nsandbox:\n  memory_mb: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: sandbox.memory_mb"):
        load_corpus_config(p)
