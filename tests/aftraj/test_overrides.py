"""`--set KEY=VALUE` (aftraj/overrides.py), the one parser every training stage and the ablation use."""

from __future__ import annotations

import pytest

from aftraj.errors import UsageError
from aftraj.overrides import parse_set


def test_values_are_yaml():
    assert parse_set(["a=1", "b=1e-3", "c=[x, y]", "d=null", " e =text", "f=k=v", "g=", "h=2E+2", "i=x1e3"]) == \
        {"a": 1, "b": 1e-3, "h": 200.0, "i": "x1e3", "c": ["x", "y"], "d": None, "e": "text", "f": "k=v", "g": None}
    assert parse_set([]) == {}


@pytest.mark.parametrize("item,match", [("novalue", "expected KEY=VALUE"), ("=3", "key is empty"),
                                        ("a=[1,", "not YAML")])
def test_malformed_items_are_named(item, match):
    with pytest.raises(UsageError, match=match):
        parse_set(["ok=1", item])


@pytest.mark.parametrize("argv", [["train", "stage1", "--config", "configs/stage1/tiny-cpu.yaml"],
                                  ["train", "stage2", "--config", "configs/stage2/tiny-cpu.yaml"],
                                  ["train", "warmup", "--config", "configs/warmup/tiny-cpu.yaml"],
                                  ["ablation", "--config", "configs/ablation/quick.yaml", "--out", "unused"]])
def test_every_command_uses_it(argv, capsys):
    from aftraj.cli import main

    assert main([*argv, "--set", "novalue"]) == 2
    assert "--set 'novalue': expected KEY=VALUE" in capsys.readouterr().err
