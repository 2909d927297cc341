"""Predictions written as trajectories finish, and `aftraj eval --resume` from them (lm-eval's
request cache is the model: a killed run keeps every finished walk).

`PredictionLog(out, settings, resume=...)` checks (before the auditor loads); `with log:` writes.
`OUT/eval_settings.json` holds what decides a
walk's answers (auditor, model, endpoint, protocol, parser, layout, generation budget, data and
the selected trajectory ids); `OUT/predictions.jsonl` gets one line per finished trajectory,
flushed at once, in the order walks end. With `resume=True` the records already there are kept
(`done`, by trajectory id) and only the other trajectories are walked; the settings must be the
same, or the resume is refused (a `UsageError` naming the first setting that differs). A last
line cut short by the kill is dropped; a bad line elsewhere is an error naming file and line.
When the run ends, `eval.report.write_report` rewrites predictions.jsonl whole, in input order.

The call cache (`CallCache`, OUT/calls.jsonl): every auditor answer (not an endpoint failure: a
resume asks again) is appended and flushed as it comes, keyed by the auditor's settings and the hash of what its prompt is rendered from (the
trajectory's fields and steps 0..t, and t), so a kill in the middle of a walk keeps the calls
already made: `--resume` replays them (`CachedAuditor`) and asks the auditor only for the rest.
A walk a resume finishes therefore gets the answers the killed run had, not new ones.

    aftraj eval --auditor hf --model M --data D --out runs/e          # killed after 40 of 100
    aftraj eval --auditor hf --model M --data D --out runs/e --resume  # walks the other 60
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from aftraj.errors import UsageError

SETTINGS_FILE = "eval_settings.json"
PREDICTIONS_FILE = "predictions.jsonl"
CALLS_FILE = "calls.jsonl"


def ids_digest(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()[:16]


def read_log(path: Path, what: str, fix: str):
    """(line number, record) of each line of a JSON-lines log written as a run goes; a last line
    cut short by a kill (no newline) is dropped, a bad line elsewhere is a UsageError naming file
    and line (`what` the record, `fix` what to do)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    complete = lines[-1] == ""          # a file cut short by a kill ends without a newline
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield no, json.loads(line)
        except json.JSONDecodeError as e:
            if no == len(lines) and not complete:
                return                   # the kill's half-written last line: asked again
            raise UsageError(f"{path}:{no}: not {what} ({e.msg}); remove the line or {fix}") from None


def read_predictions(path: Path) -> dict[str, dict]:
    """The records of a (possibly interrupted) predictions file, by trajectory id."""
    out: dict[str, dict] = {}
    for no, rec in read_log(path, "a prediction record", "run without --resume"):
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            raise UsageError(f"{path}:{no}: field 'id': a prediction record needs its trajectory id")
        out[rec["id"]] = rec
    return out


class PredictionLog:
    """`filename`: predictions.jsonl for an evaluation, verdicts.jsonl for `aftraj audit`."""

    def __init__(self, out: Path, settings: dict, *, resume: bool = False, filename: str = PREDICTIONS_FILE):
        self.out = Path(out)
        self.path = self.out / filename
        self.done: dict[str, dict] = {}
        self.out.mkdir(parents=True, exist_ok=True)
        spath = self.out / SETTINGS_FILE
        if resume and self.path.exists():
            if not spath.exists():
                raise UsageError(f"--resume: {self.out} holds {filename} but no {SETTINGS_FILE} "
                                 f"(written by an older aftraj?): its settings are unknown; run without --resume")
            old = json.loads(spath.read_text(encoding="utf-8"))
            for k in sorted(set(old) | set(settings)):
                if old.get(k) != settings.get(k):
                    raise UsageError(f"--resume: {self.out} was evaluated with {k}={old.get(k)!r}, this "
                                     f"command has {k}={settings.get(k)!r}; use the same settings or "
                                     f"another --out")
            self.done = read_predictions(self.path)
        self.settings, self._f = settings, None

    def open(self) -> PredictionLog:
        """Start writing: the kept records (a half-written last line dropped), then one line per walk."""
        self.path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.done.values()),
                             encoding="utf-8")
        (self.out / SETTINGS_FILE).write_text(json.dumps(self.settings, indent=1, ensure_ascii=False) + "\n",
                                              encoding="utf-8")
        self._f = open(self.path, "a", encoding="utf-8")
        return self

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- the call cache

def _verdict_dict(v) -> dict | None:
    from dataclasses import asdict

    from aftraj.verdict import ParseFailure

    if v is None:
        return None
    return {"type": "parse_failure" if isinstance(v, ParseFailure) else "verdict", **asdict(v)}


def result_to_dict(r) -> dict:
    """An `AuditResult` as JSON (the verdict or parse failure tagged with its type)."""
    from dataclasses import asdict

    d = asdict(r)
    d["verdict"] = _verdict_dict(r.verdict)
    return d


def result_from_dict(d: dict):
    from aftraj.verdict import ParseFailure, Verdict
    from eval.auditors import AuditResult

    d = dict(d)
    v = d.pop("verdict")
    if v is not None:
        kind = v.pop("type")
        v = ParseFailure(**v) if kind == "parse_failure" else Verdict(**v)
    return AuditResult(verdict=v, **d)


class PrefixDigests:
    """The hash of what prefix t's prompt is rendered from: the trajectory's own fields and its
    steps 0..t, chained step by step (h_t = sha256(h_{t-1}, step t)), so each call hashes one
    step, not the whole prefix; a later step does not change it."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple[object, list[str], list[dict]]] = {}

    def __call__(self, traj, t: int) -> str:
        m = self._memo.get(traj.id)
        if m is None or m[0] is not traj:
            d = traj.to_dict()
            steps = d.pop("steps")
            m = self._memo[traj.id] = (traj, [_sha(json.dumps(d, sort_keys=True, ensure_ascii=False,
                                                              default=str))], steps)
        _, chain, steps = m
        while len(chain) <= t + 1:
            step = json.dumps(steps[len(chain) - 1], sort_keys=True, ensure_ascii=False, default=str)
            chain.append(_sha(chain[-1] + step))
        return _sha(f"{chain[t + 1]}:{t}")

    def drop(self, traj) -> None:
        self._memo.pop(traj.id, None)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def settings_digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


class CallCache:
    """OUT/calls.jsonl: one line per auditor answer, `{"key", "id", "t", "result"}`, appended and
    flushed as each answer comes (thread-safe: the openai auditor answers from worker threads).
    `key` = sha256(settings digest, prefix digest). Reading tolerates a last line cut by a kill."""

    def __init__(self, out: Path, settings: dict, *, keep: bool):
        import threading

        self.path = Path(out) / CALLS_FILE
        self.settings = settings_digest(settings)
        self.answers: dict[str, dict] = {}
        if keep and self.path.exists():
            for no, rec in read_log(self.path, "a cached call", "run with --overwrite"):
                if not isinstance(rec, dict) or not isinstance(rec.get("key"), str) or "result" not in rec:
                    raise UsageError(f"{self.path}:{no}: field 'key'/'result': not a cached call")
                self.answers[rec["key"]] = rec["result"]
        self._lock = threading.Lock()
        self._f = None
        self.hits = self.misses = 0
        self.prefix = PrefixDigests()

    def key(self, traj, t: int) -> str:
        with self._lock:
            digest = self.prefix(traj, t)
        return _sha(f"{self.settings}:{digest}")

    def get(self, traj, t: int):
        d = self.answers.get(self.key(traj, t))
        return None if d is None else result_from_dict(d)

    def put(self, traj, t: int, result) -> None:
        """Keep `result`, unless it is an endpoint failure (no verdict): a resume asks again."""
        if result.error is not None:
            return
        key, rec = self.key(traj, t), result_to_dict(result)
        with self._lock:
            self.answers[key] = rec
            if self._f is None:   # rewritten whole at open: only the kept answers, no cut line
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._f = open(self.path, "a", encoding="utf-8")
            self._f.write(json.dumps({"key": key, "id": traj.id, "t": t, "result": rec},
                                     ensure_ascii=False) + "\n")
            self._f.flush()

    def open(self) -> CallCache:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps({"key": k, "result": r}, ensure_ascii=False) + "\n"
                                     for k, r in self.answers.items()), encoding="utf-8")
        self._f = open(self.path, "a", encoding="utf-8")
        return self

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


class CachedAuditor:
    """An auditor behind the call cache: a cached (trajectory prefix, settings) answer is replayed,
    any other is asked of the auditor and written at once. Everything else (label, strategy,
    max_in_flight, lookahead, end, report notes, …) is the auditor's own, so the walker
    (`eval.walker.walk`) walks it like the auditor itself."""

    def __init__(self, auditor, cache: CallCache):
        self._auditor, self._cache = auditor, cache
        self.submit = None if auditor.submit is None else self._submit

    def __getattr__(self, name):
        return getattr(self._auditor, name)

    def end(self, traj) -> None:
        self._cache.prefix.drop(traj)
        self._auditor.end(traj)

    def audit(self, traj, t: int):
        return self.audit_batch([(traj, t)])[0]

    def audit_batch(self, requests):
        from eval.auditors import Auditor

        got = [self._cache.get(traj, t) for traj, t in requests]
        todo = [i for i, r in enumerate(got) if r is None]
        self._cache.hits += len(requests) - len(todo)
        self._cache.misses += len(todo)
        if todo and type(self._auditor).audit_batch is Auditor.audit_batch:
            for i in todo:     # the default batch is one call a request: each answer kept as it comes
                got[i] = self._auditor.audit(*requests[i])
                self._cache.put(*requests[i], got[i])
        elif todo:
            fresh = self._auditor.audit_batch([requests[i] for i in todo])
            if len(fresh) != len(todo):
                raise RuntimeError(f"{self._auditor.label}: audit_batch returned {len(fresh)} results "
                                   f"for {len(todo)} requests")
            for i, r in zip(todo, fresh, strict=True):
                got[i] = r
                self._cache.put(*requests[i], r)
        return got

    def _submit(self, traj, t: int):
        from concurrent.futures import Future

        r = self._cache.get(traj, t)
        if r is not None:
            self._cache.hits += 1
            fut: Future = Future()
            fut.set_result(r)
            return fut
        self._cache.misses += 1
        fut = self._auditor.submit(traj, t)

        def store(f) -> None:
            if not f.cancelled() and f.exception() is None:
                self._cache.put(traj, t, f.result())

        fut.add_done_callback(store)
        return fut
