"""Auditors behind one small interface, registered by name (lm-eval's `LM` + `@register_model`).

An auditor answers, for prefix t of a trajectory (steps 0..t only), with an `AuditResult`: a
`aftraj.verdict.Verdict` or `aftraj.verdict.ParseFailure`, P(UNSAFE) when the backend gives one,
the latency and the prompt / completion / cached token counts. The walker (`eval.walker`) decides
which prefixes to ask for; auditors never look past the t they are given.

Writing one (e.g. `eval/auditors/rules.py`, found automatically, no other file to edit):

    from aftraj.verdict import Verdict
    from eval.auditors import AuditResult, Auditor, register_auditor

    @register_auditor("rules")
    class RulesAuditor(Auditor):
        '''The fold's deterministic detectors: the first finding raises ALARM.'''

        def __init__(self, arg: str | None = None, **kw):   # "rules:ARG" passes arg="ARG"
            super().__init__(arg, **kw)

        def audit(self, traj, t):                           # prefix t = traj.steps[: t + 1]
            ...
            return AuditResult(Verdict("UNSAFE", step=k, agent=a, reason="…"), t=t)

The contract:
- `audit(traj, t) -> AuditResult` (required). `audit_batch(requests)` answers a list of
  `(traj, t)` pairs in order; the default loops over `audit`; backends that can overlap calls
  (`openai`) override it, or implement `submit(traj, t) -> concurrent.futures.Future`, which
  lets the walker keep every slot busy (no wait for the slowest call of a round). `end(traj)` tells the auditor a walk is over (drop per-trajectory
  state such as a KV cache); `close()` releases resources.
- `strategy` says how the walker queries it: "online" (strict walk t = 0, 1, … until the first
  ALARM; the default), "posthoc" (one call with the whole trajectory, t = N-1, labelled
  post-hoc in every report) or "bisect" (binary search for the first alarming prefix).
- `max_in_flight` caps how many trajectories the walker interleaves (the `hf` backend sets its
  `batch_size`, default 16: one KV cache per live trajectory, each round decoded together).
- `lookahead = True` says the answer for prefix t depends on prefix t alone and `audit_batch`
  accepts several prefixes of one trajectory in a round (`hf`): when fewer walks are live than
  `max_in_flight` (the sample's tail, a small sample), the walker fills the round's spare rows
  with the live online walks' next prefixes and keeps an answer only when its walk asks for it.
- Constructor: `Cls(arg=None, *, option=…, **kw)`, passing `**kw` on to `super().__init__`;
  `get_auditor("name:arg", model=…, …)` builds one. An option no class of the chain declares is
  an error (`UnknownOptionError`, a TypeError naming the auditor, the options and those it
  takes); callers that hold options for any auditor (`aftraj eval`'s flags) pass each auditor
  only what `accepted_options` says it takes. A registered name whose `__new__` builds another
  class (`floor:NAME`, `heuristic:NAME` for a floor) says which in `resolve(arg)`.
- Modules in this package are imported on the first `get_auditor`/`available_auditors`, so keep
  heavy imports (torch, transformers) inside methods.

    python -c "from eval.auditors import available_auditors; print(available_auditors())"
    aftraj eval --auditor dummy:alarm-at-2 --data ww.jsonl --out runs/eval-dummy
"""

from __future__ import annotations

import math

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aftraj.schema import Trajectory
from aftraj.verdict import ParseFailure, Verdict

STRATEGIES = ("online", "posthoc", "bisect")


@dataclass(frozen=True)
class AuditResult:
    """One auditor answer for prefix t. An endpoint failure (no answer, a filtered or errored
    choice, an oversize reply, the deadline) is `verdict=None` with `error` set: it is counted
    as an error, never as a verdict or a parse failure."""

    verdict: Verdict | ParseFailure | None
    t: int
    confidence: float | None = None   # P(UNSAFE) in [0, 1], when the backend can tell
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0            # prompt tokens served from a prefix cache
    raw: str | None = None            # the completion text, when there is one
    error: str | None = None          # why the endpoint gave no answer (verdict is None then)
    error_kind: str | None = None     # aftraj.llm_client.ERROR_KINDS
    # log p(ALARM) - log p(SAFE) at the decision token (where the canonical SAFE and ALARM
    # completions first diverge), when the backend can tell and the completion reached it
    decision_log_odds: float | None = None

    def __post_init__(self) -> None:
        if (self.verdict is None) != (self.error is not None):
            raise ValueError("an AuditResult holds either a verdict (or parse failure) or an error")
        if self.confidence is not None and not 0.0 <= self.confidence <= 1.0:
            raise ValueError(f"confidence must be in [0, 1], got {self.confidence}")
        if self.t < 0:
            raise ValueError(f"t must be >= 0, got {self.t}")
        if self.decision_log_odds is not None and not math.isfinite(self.decision_log_odds):
            raise ValueError(f"decision_log_odds must be finite, got {self.decision_log_odds}")

    @property
    def alarm(self) -> bool:
        """ALARM iff a parsed UNSAFE verdict; a parse failure counts as CONTINUE."""
        return isinstance(self.verdict, Verdict) and self.verdict.alarm

    @property
    def parse_failed(self) -> bool:
        return isinstance(self.verdict, ParseFailure)


class Auditor:
    """Base class. Subclasses implement `audit`; see the module docstring for the contract."""

    name: str = "auditor"            # set by @register_auditor
    strategy: str = "online"         # "online" | "posthoc" | "bisect"
    max_in_flight: int | None = None  # cap on trajectories walked at once (None: the walker's)
    confidence_kind: str = "probability"  # "probability": P(UNSAFE); "score": a [0, 1] score that is not one
    # True: the answer for prefix t depends on prefix t only, and one `audit_batch` round may hold
    # several prefixes of one trajectory; the walker then fills a round's spare rows with the next
    # prefixes of live online walks (`eval.walker`, lookahead) and drops those a walk never asks for
    lookahead: bool = False
    # True: the auditor renders the contract's prompt (aftraj.prompt) and parses a model's
    # completion, so `--layout` and `--parser` change its answers; False: they have no effect
    # (the evaluation warns and records them as not applied). None (undeclared): inferred by
    # `renders_prompt(cls)` from whether the auditor's module imports `aftraj.prompt`.
    renders_prompt: bool | None = None
    # The documented `NAME:ARG` forms, one (form, meaning) pair each, for `aftraj eval
    # --list-auditors`; when empty the listing quotes the forms the module docstring gives.
    arguments: tuple[tuple[str, str], ...] = ()

    def __init__(self, arg: str | None = None, *, layout: str = "ours", **kw) -> None:
        if kw:   # what no class of the chain took: a misspelt or foreign option is never dropped
            raise UnknownOptionError(self.name, sorted(kw), accepted_options(type(self)))
        self.arg = arg
        self.layout = layout   # prompt layout for auditors that render prompts (aftraj.prompt)

    @classmethod
    def resolve(cls, arg: str | None) -> type[Auditor]:
        """The class `cls(arg, …)` builds: itself, unless its `__new__` dispatches on `arg`."""
        return cls

    @property
    def posthoc(self) -> bool:
        return self.strategy == "posthoc"

    @property
    def label(self) -> str:
        """How reports name this auditor ("heuristic:last-step (post-hoc)")."""
        base = self.name if self.arg is None else f"{self.name}:{self.arg}"
        return f"{base} (post-hoc)" if self.posthoc else base

    def audit(self, traj: Trajectory, t: int) -> AuditResult:
        raise NotImplementedError

    def audit_batch(self, requests: Sequence[tuple[Trajectory, int]]) -> list[AuditResult]:
        return [self.audit(traj, t) for traj, t in requests]

    submit = None  # optional: submit(traj, t) -> Future[AuditResult] (see the module docstring)

    def end(self, traj: Trajectory) -> None:
        """The walk of `traj` is over."""

    def close(self) -> None:
        """Release resources (models, HTTP clients)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- options

class UnknownOptionError(TypeError):
    """An option the auditor does not take (a misspelt key, a flag of another backend). A
    TypeError, as Python's own for an unexpected keyword; `aftraj serve gateway` reports it as a
    ConfigError on `auditor.options.<name>`, `aftraj eval` never passes one."""

    def __init__(self, auditor: str, options: Sequence[str], accepted: Sequence[str]) -> None:
        self.auditor, self.options, self.accepted = auditor, list(options), sorted(accepted)
        names = ", ".join(repr(o) for o in self.options)
        super().__init__(f"the {auditor} auditor takes no option {names} (it takes: "
                         f"{', '.join(self.accepted) or 'none'})")


def accepted_options(spec: str | type[Auditor]) -> frozenset[str]:
    """The keyword options an auditor takes ("NAME[:ARG]" or its class): every keyword parameter of
    the `__init__`s along its class chain, up to the first that takes no `**kw` (for a spec, of
    the class it builds: `Auditor.resolve`)."""
    import inspect

    if isinstance(spec, str):
        name, arg = parse_spec(spec)
        cls = auditor_class(name).resolve(arg)
    else:
        cls = spec
    out: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]   # not self
        out |= {p.name for p in params if p.name != "arg" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params) or klass is Auditor:
            break
    return frozenset(out)


def check_options(spec: str, options) -> None:
    """Raise `UnknownOptionError` when `options` names one the auditor of `spec` does not take."""
    extra = sorted(set(options) - accepted_options(spec))
    if extra:
        name, arg = parse_spec(spec)
        raise UnknownOptionError(name, extra, accepted_options(spec))


# --------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type[Auditor]] = {}
_DISCOVERED = False


def register_auditor(*names: str) -> Callable[[type[Auditor]], type[Auditor]]:
    """Class decorator: `@register_auditor("hf")`. A name may be registered once."""
    if not names:
        raise ValueError("register_auditor needs at least one name")

    def deco(cls: type[Auditor]) -> type[Auditor]:
        if not (isinstance(cls, type) and issubclass(cls, Auditor)):
            raise TypeError(f"{cls!r} is not an Auditor subclass")
        if cls.strategy not in STRATEGIES:
            raise ValueError(f"{cls.__name__}.strategy must be one of {STRATEGIES}, got {cls.strategy!r}")
        for n in names:
            if ":" in n or not n.strip():
                raise ValueError(f"bad auditor name {n!r} (non-empty, no ':')")
            if n in _REGISTRY and _REGISTRY[n] is not cls:
                raise ValueError(f"auditor {n!r} is already registered by {_REGISTRY[n].__name__}")
            _REGISTRY[n] = cls
        cls.name = names[0]
        return cls

    return deco


def _discover() -> None:
    """Import every module of this package so that their @register_auditor lines run."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    _DISCOVERED = True


def available_auditors() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """"heuristic:uniform-random" -> ("heuristic", "uniform-random"); "hf" -> ("hf", None)."""
    name, sep, arg = spec.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"empty auditor name in {spec!r}")
    return name, (arg if sep else None)


def auditor_class(name: str) -> type[Auditor]:
    """The class registered as `name` (KeyError naming the available ones)."""
    _discover()
    if name not in _REGISTRY:
        raise KeyError(f"unknown auditor {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def renders_prompt(cls: type[Auditor]) -> bool:
    """Whether `--layout` / `--parser` reach this auditor: its `renders_prompt` when declared,
    else whether its module imports the prompt builder (`aftraj.prompt`): `hf` and `openai` do,
    the model-free auditors (`rules`, `dummy`, the heuristics and floors, `structural`) do not."""
    if cls.renders_prompt is not None:
        return bool(cls.renders_prompt)
    import sys

    mod = sys.modules.get(cls.__module__)
    return any(getattr(v, "__module__", None) == "aftraj.prompt" or getattr(v, "__name__", None) == "aftraj.prompt"
               for v in vars(mod).values()) if mod is not None else False


def _doc_forms(name: str, doc: str) -> list[str]:
    """The `NAME[:ARG]` forms a docstring quotes in backticks (of any registered auditor name: a
    floor's doc gives `heuristic:length,train=PATH`), then its bulleted ARG values as
    `name:ARG`, in order, once each."""
    import re

    names = "|".join(re.escape(n) for n in sorted(_REGISTRY, key=len, reverse=True))
    forms = re.findall(r"`((?:" + names + r")(?::[^`\s]+)?)`", doc)
    forms = [f for f in forms if f == name or ":" in f]
    bullets = re.findall(r"^\s*- `([^`:]+)`", doc, flags=re.M)   # "- `gold`: ..." lists ARG values
    return list(dict.fromkeys(forms + [f"{name}:{b}" for b in bullets
                                       if b not in _REGISTRY and "=" not in b.split(",")[0]]))


def describe_auditor(name: str) -> dict:
    """What `aftraj eval --list-auditors` prints of one registered auditor: its name, the other
    names of its class, strategy, one-line summary, documented arguments (the class's `arguments`,
    else the forms its docs quote) and whole documentation (class docstring, then its module's)."""
    import inspect
    import sys

    cls = auditor_class(name)
    mod_doc = inspect.cleandoc(getattr(sys.modules.get(cls.__module__), "__doc__", None) or "")
    cls_doc = inspect.cleandoc(cls.__doc__) if "__doc__" in vars(cls) and cls.__doc__ else ""
    doc = "\n\n".join(d for d in (cls_doc, mod_doc) if d)
    # a class docstring that only gives the arguments ("ARG: …") does not summarise the auditor
    lead = mod_doc if not cls_doc or cls_doc.startswith(("ARG", "Arguments")) else cls_doc
    summary = " ".join(lead.split("\n\n")[0].split())
    if cls.arguments:
        args = [f"{form}: {meaning}" for form, meaning in cls.arguments]
    else:
        args = _doc_forms(name, doc)
        if cls_doc.startswith(("ARG", "Arguments")):
            args.insert(0, " ".join(cls_doc.split("\n\n")[0].split()))
    return {"name": name, "aliases": sorted(n for n, c in _REGISTRY.items() if c is cls and n != name),
            "strategy": cls.strategy, "renders_prompt": renders_prompt(cls), "summary": summary,
            "arguments": args, "doc": doc, "module": cls.__module__}


def get_auditor(spec: str, **kw) -> Auditor:
    """Build an auditor from "NAME[:ARG]"; keyword arguments go to its constructor, and one it
    does not take is an `UnknownOptionError` before anything is built or loaded."""
    name, arg = parse_spec(spec)
    cls = auditor_class(name)
    check_options(spec, kw)
    return cls(arg, **kw)


__all__ = ["AuditResult", "Auditor", "STRATEGIES", "UnknownOptionError", "accepted_options", "auditor_class",
           "available_auditors", "check_options", "describe_auditor", "get_auditor", "parse_spec",
           "register_auditor", "renders_prompt"]
