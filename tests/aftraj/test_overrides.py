"""`--set KEY=VALUE` (aftraj/config.py), the one parser every training stage and the ablation use."""

from __future__ import annotations

import pytest

from aftraj.errors import UsageError
from aftraj.config import parse_set


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


def test_cli_overrides_flags_win_over_set_and_absent_flags_do_not_override():
    import argparse

    from aftraj.config import cli_overrides

    args = argparse.Namespace(set=["output_dir=a", "max_steps=3", "lr=1e-3"], out="b", data=None, max_steps=None)
    over = cli_overrides(args, {"output_dir": "out", "data": "data", "max_steps": "max_steps"})
    assert over == {"output_dir": "b", "max_steps": 3, "lr": 1e-3}
    assert cli_overrides(argparse.Namespace(set=[], out=None), {"output_dir": "out"}) == {}
    assert cli_overrides(argparse.Namespace(out="c"), {"output_dir": "out"}) == {"output_dir": "c"}
