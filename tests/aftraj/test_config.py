"""aftraj/config.py, the one config layer: nested sections, type checks, `key=value` overrides,
one ConfigError naming file and dotted key, and ModelConfig shared by the training configs."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from aftraj.config import (ConfigError, ModelConfig, apply_overrides, build, load, need, parse_set,
                           read_yaml)
from aftraj.errors import UsageError

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Inner:
    n: int = 1
    rate: float = 0.5

    def __post_init__(self):
        need(self.n >= 1, "n", f"must be >= 1, got {self.n}")


@dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner = field(default_factory=Inner)
    items: tuple[Inner, ...] = ()
    tags: tuple[str, ...] = ()
    limit: int | None = None


def test_nested_sections_lists_and_tuples_are_built():
    cfg = build(Outer, {"name": "x", "inner": {"n": 3, "rate": 1}, "items": [{"n": 2}, {}], "tags": ["a", "b"]})
    assert cfg == Outer("x", Inner(3, 1), (Inner(2), Inner()), ("a", "b"))
    assert build(Outer, {"name": "x", "inner": None}).inner == Inner()     # `inner:` alone: the defaults


@pytest.mark.parametrize("raw,text", [
    ({"name": "x", "inner": {"n": 0}}, "inner.n: must be >= 1, got 0"),
    ({"name": "x", "items": [{}, {"n": 0}]}, "items[1].n: must be >= 1, got 0"),
    ({"name": "x", "inner": {"m": 1}}, "inner.m: unknown key (known: n, rate)"),
    ({"name": "x", "colour": 1}, "colour: unknown key (known: inner, items, limit, name, tags)"),
    ({"name": "x", "inner": {"n": True}}, "inner.n: must be int, got bool True"),
    ({"name": "x", "inner": {"rate": "fast"}}, "inner.rate: must be float, got str 'fast'"),
    ({"name": "x", "tags": [1]}, "tags: must be tuple[str, ...], got tuple (1,)"),
    ({"name": "x", "limit": 1.5}, "limit: must be int | None, got float 1.5"),
    ({"name": "x", "inner": 3}, "inner: must be a mapping, got int"),
    ({"name": "x", "items": {"n": 1}}, "items: must be a list of Inner mappings, got dict"),
    ({"inner": {}}, "name: is required"),
    ([1], "must be a mapping, got list"),
])
def test_errors_name_the_dotted_key_in_one_format(raw, text):
    with pytest.raises(ConfigError) as e:
        build(Outer, raw)
    assert str(e.value) == text
    with pytest.raises(ConfigError) as e:
        build(Outer, raw, source="c.yaml")
    assert str(e.value) == f"c.yaml: {text}" and e.value.source == "c.yaml"


# every config loader, with a config of the repository it reads
LOADERS = [("aftraj.corpus.config", "load_corpus_config", "configs/corpus/demo-small.yaml"),
           ("aftraj.structural.config", "load_structural_config", "configs/structural/default.yaml"),
           ("aftraj.drivers.ablation", "load_config", "configs/ablation/cpu.yaml"),
           ("serve.config", "load_serve_config", "configs/serve/gateway-local.yaml"),
           ("training.stage1.config", "load_stage1_config", "configs/stage1/tiny-cpu.yaml"),
           ("training.stage2.config", "load_stage2_config", "configs/stage2/tiny-cpu.yaml"),
           ("training.steps.config", "load_steps_config", "configs/steps/tiny-cpu.yaml"),
           ("training.prefixes.config", "load_prefixes_config", "configs/prefixes/tiny-cpu.yaml"),
           ("training.warmup.config", "load_warmup_config", "configs/warmup/tiny-cpu.yaml")]


def test_config_error_is_a_usage_error_and_the_only_one():
    """One ConfigError, aftraj.config's: no other class of that name anywhere, no module-local
    `_need` helper, and no config module re-exports it (importers take it from aftraj.config)."""
    assert issubclass(ConfigError, UsageError)
    defined = []
    for p in [*REPO.glob("aftraj/**/*.py"), *REPO.glob("training/**/*.py"), *REPO.glob("serve/**/*.py"),
              *REPO.glob("eval/**/*.py")]:
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("ConfigError"):
                defined.append(f"{p.relative_to(REPO)}:{node.name}")
            if isinstance(node, ast.FunctionDef) and node.name == "_need" and \
                    [a.arg for a in node.args.args] == ["cond", "key", "msg"]:
                defined.append(f"{p.relative_to(REPO)}:_need")
    assert defined == ["aftraj/config.py:ConfigError"], defined
    import importlib

    for mod_name, _, _ in LOADERS:
        assert "ConfigError" not in getattr(importlib.import_module(mod_name), "__all__", ()), mod_name


@pytest.mark.parametrize("mod_name,loader,config", LOADERS, ids=[m for m, _, _ in LOADERS])
def test_every_config_loader_raises_the_one_config_error(mod_name, loader, config, tmp_path):
    """A repository config that loads, given one unknown key: aftraj.config's ConfigError itself
    (not a subclass, not another class of that name), naming the file and the key."""
    import importlib

    load = getattr(importlib.import_module(mod_name), loader)
    src = REPO / config
    load(src)
    bad = tmp_path / src.name
    bad.write_text(src.read_text(encoding="utf-8") + "\ncolour: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load(bad)
    assert type(e.value) is ConfigError
    assert e.value.source is not None and Path(e.value.source).name == src.name
    assert "colour: unknown" in str(e.value), str(e.value)


def test_read_yaml_names_the_file(tmp_path):
    p = tmp_path / "c.yaml"
    with pytest.raises(ConfigError, match=r"c\.yaml: cannot read"):
        read_yaml(p)
    p.write_text("a: [1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: not valid YAML"):
        read_yaml(p)
    p.write_text("- 1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: the file must hold a mapping, got list"):
        read_yaml(p)
    p.write_text("")
    assert read_yaml(p) == {}


def test_overrides_are_dotted_keys_applied_before_validation(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: x\ninner: {n: 2}\n")
    assert load(Outer, p, parse_set(["inner.rate=1e-3", "name=y"])) == Outer("y", Inner(2, 1e-3))
    assert load(Outer, p, {"items": [{"n": 5}]}).items == (Inner(5),)
    with pytest.raises(ConfigError) as e:
        load(Outer, p, {"inner.n": 0})
    assert str(e.value) == f"{p}: inner.n: must be >= 1, got 0"
    raw = {"a": {"b": 1}, "c": 2}
    assert apply_overrides(raw, {"a.d": 3, "e.f": 4}) == {"a": {"b": 1, "d": 3}, "c": 2, "e": {"f": 4}}
    with pytest.raises(ConfigError, match=r"c\.x: cannot set c\.x: c is not a section"):
        apply_overrides(raw, {"c.x": 1})


def test_the_corpus_override_reaches_a_section():
    from aftraj.corpus.config import load_corpus_config

    cfg = load_corpus_config(REPO / "configs/corpus/demo-small.yaml", {"sandbox.workers": 1, "seed": 7})
    assert (cfg.sandbox.workers, cfg.seed) == (1, 7)
    with pytest.raises(ConfigError, match=r"demo-small\.yaml: sandbox\.workers: must be an integer >= 1"):
        load_corpus_config(REPO / "configs/corpus/demo-small.yaml", {"sandbox.workers": 0})


def test_model_fields_are_defined_once_and_kept_flat():
    from training.stage1.config import Stage1Config, load_stage1_config
    from training.stage2.config import Stage2Config
    from training.warmup.config import WarmupConfig

    model_keys = [f.name for f in dataclasses.fields(ModelConfig)]
    assert {"model", "dtype", "attn_implementation", "finetune", "lora_r", "lora_alpha", "lora_dropout",
            "lora_target_modules", "gradient_checkpointing"} == set(model_keys)
    for cls in (Stage1Config, Stage2Config, WarmupConfig):
        assert issubclass(cls, ModelConfig)
        assert [f.name for f in dataclasses.fields(cls)][:len(model_keys)] == model_keys
    # only the warm-up changes defaults (a small LoRA); no class re-declares the model checks
    assert (WarmupConfig().finetune, WarmupConfig().lora_r, Stage1Config(max_steps=1).finetune) == ("lora", 8, "full")
    for cls in (Stage1Config, Stage2Config, WarmupConfig):
        with pytest.raises(ConfigError, match="dtype: must be one of float32, bfloat16, float16; got 'fp8'"):
            cls(dtype="fp8", **({"max_steps": 1} if cls is Stage1Config else {}))
        with pytest.raises(ConfigError, match="lora_alpha: must be >= 1"):
            cls(lora_alpha=0, **({"max_steps": 1} if cls is Stage1Config else {}))
    cfg = load_stage1_config(REPO / "configs/stage1/tiny-cpu.yaml", {"lora_r": 4, "dtype": "bfloat16"})
    assert (cfg.lora_r, cfg.dtype) == (4, "bfloat16")
    assert cfg.model_config() == ModelConfig(**{k: getattr(cfg, k) for k in model_keys})
    assert set(cfg.to_dict()) == {f.name for f in dataclasses.fields(Stage1Config)}
