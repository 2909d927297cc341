"""The one config layer: typed dataclasses read from YAML, with nested sections, type checks,
`key=value` overrides and one error, `ConfigError`, naming the file and the (dotted) key.

Every config of the project loads here: the corpus build (aftraj/corpus/config.py), the
detector policy (aftraj/detectors.py), the structural monitor (aftraj/structural/config.py), the
training stages and the warm-up (training/*/config.py, whose model fields are `ModelConfig`'s),
the ablation (eval/ablation.py), the serving configs (serve/config.py) and the accelerate launch
configs (training/accelerate_config.py).

    from aftraj.config import load, parse_set
    cfg = load(Stage1Config, "configs/stage1/tiny-cpu.yaml", parse_set(["max_steps=3"]))
    cfg = load(CorpusConfig, "configs/corpus/demo-small.yaml", {"policy.base_url": "http://x/v1"})

A config class is a dataclass whose `__post_init__` checks values with `need(cond, key, msg)`
(keys relative to the class); a field typed as another dataclass is a nested section (a YAML
mapping, its errors named `section.key`), one typed `tuple[Section, ...]` a list of them
(`section[i].key`). Before a class is built, every given value is checked against its field's
type hint (`int`, `float` (an int is accepted), `str | None`, `list[str]`, `tuple[int, ...]`, ...);
a YAML list for a tuple field becomes a tuple. An unknown key, a value of the wrong type, a
value out of range, a file that cannot be read: all are one `ConfigError` whose text is

    <file>: <dotted.key>: <what is wrong>

(`<file>: ` only when there is a file, `<key>: ` only when one key is to blame).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aftraj.errors import UsageError


class ConfigError(UsageError):
    """A config value, key or file that does not fit; `str()` names the file and the dotted key.

    `message` says what is wrong; `key` the dotted key (None: the whole file or mapping);
    `source` the file (None: a mapping in memory)."""

    def __init__(self, message: str, *, key: str | None = None, source: str | Path | None = None):
        self.message, self.key = message, key
        self.source = None if source is None else str(source)
        super().__init__(": ".join(p for p in (self.source, key, message) if p))

    def within(self, prefix: str | None = None, source: str | Path | None = None) -> ConfigError:
        """The same error seen from the enclosing section `prefix` and/or the file `source`."""
        return ConfigError(self.message, key=join_key(prefix, self.key),
                           source=self.source if source is None else source)


def join_key(prefix: str | None, key: str | None) -> str | None:
    """`policy` + `backend` -> `policy.backend`; `api_keys[0]` + `sha256`; either may be empty."""
    if not prefix:
        return key
    if not key:
        return prefix
    return f"{prefix}{'' if key.startswith('[') else '.'}{key}"


def need(cond: bool, key: str | None, msg: str) -> None:
    """Raise ConfigError(msg, key=key) unless `cond`: the one check every config class uses."""
    if not cond:
        raise ConfigError(msg, key=key)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def need_int(v: Any, key: str, minimum: int) -> None:
    need(is_int(v) and v >= minimum, key, f"must be an integer >= {minimum}, got {v!r}")


def need_number(v: Any, key: str, lo: float, hi: float | None = None, *, open_low: bool = False) -> None:
    """A number in [lo, hi] ((lo, hi] with `open_low`; no upper bound when `hi` is None)."""
    ok = is_number(v) and (v > lo if open_low else v >= lo) and (hi is None or v <= hi)
    need(ok, key, f"must be a number in {'(' if open_low else '['}{lo}, {hi if hi is not None else '∞'}], got {v!r}")


def need_choice(v: Any, key: str, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    need(v in choices, key, f"must be one of {', '.join(map(str, choices))}; got {v!r}")


# --------------------------------------------------------------------------- type checks

def fits(v: Any, hint: Any) -> bool:
    """Whether `v` fits the type hint: unions, None, list[X], tuple[X, ...], dict, a dataclass,
    a plain class; a float field takes an int, an int field never takes a bool."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(fits(v, h) for h in typing.get_args(hint))
    if hint is type(None) or hint is None:
        return v is None
    if origin is list:
        args = typing.get_args(hint)
        return isinstance(v, list) and all(fits(x, args[0]) for x in v) if args else isinstance(v, list)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(v, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(fits(x, args[0]) for x in v)
        return len(args) == len(v) and all(fits(x, h) for x, h in zip(v, args, strict=True))
    if origin is dict:
        return isinstance(v, dict)
    if hint is float:
        return is_number(v)
    if hint is int:
        return is_int(v)
    return isinstance(v, origin or hint)


def hint_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def type_error(v: Any, hint: Any) -> str:
    """The message for a value that does not fit its hint. YAML 1.1 reads an unquoted no/yes/on/off
    as a boolean, so `--set mixed_precision=no` arrives as False: the message says to quote it."""
    msg = f"must be {hint_name(hint)}, got {type(v).__name__} {v!r}"
    if isinstance(v, bool) and fits("x", hint):
        msg += " (YAML reads an unquoted no/yes/on/off as a boolean: quote it, e.g. mixed_precision=\"no\")"
    return msg


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_types(cfg) -> None:
    """Every field of the dataclass instance `cfg` against its type hint (ConfigError naming the
    field); an int in a float field becomes a float. For mutable configs (the training stages),
    called from `__post_init__` so that a config built in code is checked as one read from YAML."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        v, hint = getattr(cfg, f.name), hints[f.name]
        if not fits(v, hint):
            raise ConfigError(type_error(v, hint), key=f.name)
        if hint is float and is_int(v):
            setattr(cfg, f.name, float(v))


# --------------------------------------------------------------------------- building

def _section(hint: Any) -> tuple[type | None, bool]:
    """(dataclass, is_list) when the hint is a section or a tuple/list of sections."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint, False
    if typing.get_origin(hint) in (tuple, list):
        args = typing.get_args(hint)
        if args and dataclasses.is_dataclass(args[0]) and isinstance(args[0], type):
            return args[0], True
    return None, False


def build(cls, raw: Any, *, key: str | None = None, source: str | Path | None = None, what: str | None = None):
    """The dataclass `cls` from the mapping `raw`: unknown keys refused, nested sections built,
    values type-checked, then `cls(**raw)` (its `__post_init__` checks the values). Every error is
    a ConfigError named `key.<field>` (and `source`, the file)."""
    try:
        return _build(cls, raw, key, what)
    except ConfigError as e:
        raise e.within(source=source) if source is not None else e from None


def _build(cls, raw: Any, key: str | None, what: str | None):
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"must be a mapping, got {type(raw).__name__}", key=key)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        label = f"unknown {what} key" if what and not key else "unknown key"
        raise ConfigError(f"{label} (known: {', '.join(sorted(fields))})", key=join_key(key, str(unknown[0])))
    hints = _hints(cls)
    kw = {}
    for name, v in raw.items():
        where, hint = join_key(key, name), hints[name]
        sub, many = _section(hint)
        if sub is not None and many:
            if v is None:
                v = []
            if not isinstance(v, (list, tuple)):
                raise ConfigError(f"must be a list of {sub.__name__} mappings, got {type(v).__name__}", key=where)
            v = tuple(_build(sub, item, f"{where}[{i}]", None) for i, item in enumerate(v))
            if typing.get_origin(hint) is list:
                v = list(v)
        elif sub is not None:
            f = fields[name]
            if v is None and f.default_factory is not dataclasses.MISSING:
                v = f.default_factory()             # `section:` with nothing under it: the defaults
            elif not isinstance(v, sub):
                v = _build(sub, v, where, None)
        else:
            if isinstance(v, list) and typing.get_origin(hint) is tuple or (
                    isinstance(v, list) and _optional_tuple(hint)):
                v = tuple(v)
            if not fits(v, hint):
                raise ConfigError(type_error(v, hint), key=where)
        kw[name] = v
    missing = [n for n, f in fields.items() if n not in kw and f.init
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError("is required", key=join_key(key, missing[0]))
    try:
        return cls(**kw)
    except ConfigError as e:
        raise e.within(key) from None


def _optional_tuple(hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(typing.get_origin(h) is tuple for h in typing.get_args(hint))
    return False


def read_yaml(path: str | Path) -> dict:
    """The mapping a YAML file holds ({} for an empty file); ConfigError naming the file when it
    cannot be read, is not YAML or holds something else than a mapping."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror or e}", source=path) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text: {e}", source=path) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {' '.join(str(e).split())}", source=path) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"the file must hold a mapping, got {type(raw).__name__}", source=path)
    return raw


def apply_overrides(raw: dict, overrides: Mapping[str, Any] | None) -> dict:
    """`raw` with each override set in place: `max_steps` at the top, `policy.base_url` in the
    section `policy` (created when absent). Returns `raw` (changed)."""
    for dotted, v in (overrides or {}).items():
        *parents, last = str(dotted).split(".")
        node, path = raw, []
        for p in parents:
            path.append(p)
            if node.get(p) is None:
                node[p] = {}
            if not isinstance(node[p], dict):
                raise ConfigError(f"cannot set {dotted}: {'.'.join(path)} is not a section", key=dotted)
            node = node[p]
        node[last] = v
    return raw


def load(cls, path: str | Path, overrides: Mapping[str, Any] | None = None, *, what: str | None = None):
    """Read the YAML file `path` into the config dataclass `cls`, with `overrides` (dotted keys,
    e.g. from `parse_set`) applied first. Errors name the file and the key."""
    raw = apply_overrides(read_yaml(path), overrides)
    return build(cls, raw, source=path, what=what)


# --------------------------------------------------------------------------- key=value overrides

_FLOAT = re.compile(r"\A[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+\Z")


def parse_set(items: Iterable[str]) -> dict:
    """{key: YAML value} of `--set KEY=VALUE` strings (`lr=1e-4`, `targets=[q_proj,v_proj]`,
    `policy.model=x`); a malformed item is a UsageError naming it."""
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        if not k.strip():
            raise UsageError(f"--set {item!r}: the key is empty")
        try:
            val = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise UsageError(f"--set {item!r}: the value is not YAML ({' '.join(str(e).split())})") from None
        if isinstance(val, str) and _FLOAT.match(val.strip()):
            val = float(val)        # YAML 1.1 reads 1e-3 (no dot) as a string
        out[k.strip()] = val
    return out


def cli_overrides(args, flags: dict[str, str]) -> dict:
    """A command's overrides: its `--set` items, then each dedicated flag that was given
    ({config key: argparse attribute}, e.g. {"output_dir": "out"}); a flag wins over `--set`."""
    over = parse_set(getattr(args, "set", None) or [])
    for key, attr in flags.items():
        if (val := getattr(args, attr, None)) is not None:
            over[key] = val
    return over


# --------------------------------------------------------------------------- the model fields

FINETUNES = ("full", "lora")
DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Below this learning rate a full fine-tune must keep float32 master weights (compute in bf16 by
# autocast: stage 1's `mixed_precision: bf16`, stage 2's `bf16: true`). An Adam step moves a
# weight by about the learning rate; bfloat16 keeps 8 significant bits, so a weight of magnitude
# |w| rounds any change under |w| * 2^-9 back to itself: at 1e-6 every update of a weight
# of 0.001 or more is lost (tests/training/test_master_precision.py measures it on a tiny model).
HALF_MASTER_MIN_LR = 1e-5


@dataclass
class ModelConfig:
    """The model being trained, shared by stage 1, stage 2 and the warm-up (each config class
    derives from it, so its keys stay flat in the YAML and on the config: `cfg.dtype`)."""

    # A local folder, or `builtin:tiny-qwen2` / `builtin:smollm2-135m` (built locally, never a hub id).
    model: str = "builtin:tiny-qwen2"
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    finetune: str = "full"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        check_types(self)
        self.check_model()

    def check_model(self) -> None:
        for k in ("lora_r", "lora_alpha"):
            if getattr(self, k) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, k)}", key=k)
        if self.lora_dropout < 0:
            raise ConfigError(f"must be >= 0, got {self.lora_dropout}", key="lora_dropout")
        for k, choices in (("finetune", FINETUNES), ("dtype", DTYPES), ("attn_implementation", ATTN_IMPLEMENTATIONS)):
            need_choice(getattr(self, k), k, choices)
        self.check_master_precision()

    def check_master_precision(self) -> None:
        """Refuse half-precision master weights with a learning rate whose updates they cannot hold
        (a full fine-tune; LoRA adapters stay float32 in PEFT whatever the base's dtype)."""
        lr = getattr(self, "learning_rate", None)
        if self.finetune == "full" and self.dtype != "float32" and is_number(lr) and lr < HALF_MASTER_MIN_LR:
            raise ConfigError(f"{self.dtype} master weights with learning_rate {lr:g} (below {HALF_MASTER_MIN_LR:g}): "
                              f"an update of about the learning rate is under {self.dtype}'s resolution for most "
                              f"weights and is lost; use dtype: float32 and compute in bf16 by autocast "
                              f"(mixed_precision: bf16 / bf16: true)", key="dtype")

    def model_config(self) -> ModelConfig:
        """The model fields alone."""
        return ModelConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)})


__all__ = ["ATTN_IMPLEMENTATIONS", "DTYPES", "FINETUNES", "HALF_MASTER_MIN_LR", "ConfigError", "ModelConfig", "apply_overrides",
           "build", "check_types", "cli_overrides", "fits", "is_int", "is_number", "join_key", "load", "need",
           "need_choice", "need_int", "need_number", "parse_set", "read_yaml"]
