"""Request and response models of the gateway's HTTP API (the router's types; OpenAPI comes from
them). Events themselves are validated by `aftraj.events.parse_event`, the one event parser, so
the batch holds plain objects here.

    python -c "from serve.protocol import Verdict; print(Verdict.model_json_schema())"
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

AgentName = Annotated[str, Field(min_length=1, max_length=512)]


def _text(v: str | None, what: str) -> str | None:
    """Text that the ledger can store: valid Unicode (no lone surrogate), no NUL."""
    if v is None:
        return v
    if "\x00" in v:
        raise ValueError(f"{what} must not contain a NUL character")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text (a lone surrogate at character {e.start})") from None
    return v


class RunCreate(BaseModel):
    """A run is fully described by its events: these fields become its `run_started` event."""

    model_config = ConfigDict(extra="forbid")
    run_id: str | None = Field(None, max_length=200, pattern=r"^[\w.:-]+$",
                               description="your id for the run (default: a random one)")
    task: str = Field(..., max_length=200_000, description="the request the agents work on")
    agents: list[AgentName] = Field(default_factory=list, max_length=256,
                                    description="the run's agent names (each 1-512 characters)")
    category: str | None = Field(None, max_length=64,
                                 description="tool-policy category (the fold's permitted tools)")

    @field_validator("run_id")
    @classmethod
    def _not_a_path_step(cls, v):
        if v is not None and set(v) == {"."}:
            raise ValueError(f"{v!r} is not a usable run id: it is a path step (URLs normalise '.' and '..' "
                             f"away, so the run could never be read); use letters, digits, '_', '.', ':' or '-' "
                             f"with at least one character other than '.'")
        return v

    @field_validator("task", "category")
    @classmethod
    def _valid_text(cls, v, info):
        return _text(v, info.field_name)

    @field_validator("agents")
    @classmethod
    def _valid_agents(cls, v):
        for i, a in enumerate(v):
            _text(a, f"agents[{i}]")
        return v


class RunCreated(BaseModel):
    run_id: str
    event_id: str
    seq: int


class EventBatch(BaseModel):
    """Events of one run, in seq order. Rule: the batch is all or nothing: one malformed event
    (or one the ledger refuses) rejects the whole batch with a 4xx naming its index, event_id
    and field; nothing of it is stored, so resending the corrected batch loses nothing.
    Event ids already stored with the same content are skipped (idempotent resend)."""

    model_config = ConfigDict(extra="forbid")
    events: list[dict[str, Any]] = Field(..., min_length=1)


class Verdict(BaseModel):
    """The verdict for the newest prefix of the run (steps 0..t)."""

    run_id: str
    seq: int = Field(..., description="seq of the newest event the verdict covers")
    t: int = Field(..., description="index of the newest step (prefix 0..t)")
    decision: Literal["CONTINUE", "ALARM"]
    k: int | None = None
    agent: str | None = None
    reason: str | None = None
    confidence: float | None = Field(None, description="P(UNSAFE) from the verdict token's logprobs")
    action: Literal["none", "warn", "pause", "halt"]
    auditor: Literal["ok", "unavailable", "parse_failure", "off"]
    auditor_error: str | None = None
    findings: list[dict[str, Any]] = Field(default_factory=list)
    policy_revision: int | None = None
    latency_ms: float
    model_latency_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    accepted: int = 0
    duplicates: int = 0
    ts: float | None = Field(None, description="when the verdict was given (epoch seconds, the gateway's clock)")


class RunView(BaseModel):
    """A run and one page of its verdicts (`?verdicts_after=SEQ&verdicts_limit=N`, at most 1000
    a page, in seq order): pass `verdicts_next` as `verdicts_after` for the next page (null at the end)."""

    run_id: str
    owner: str
    task: str
    agents: list[str]
    category: str | None
    observer: dict[str, Any]
    verdicts: list[Verdict]
    verdicts_total: int = 0
    verdicts_next: int | None = None


class Problem(BaseModel):
    """Every 4xx/5xx body: what was wrong, and where."""

    detail: str
    event_index: int | None = None
    event_id: str | None = None
    field: str | None = None
