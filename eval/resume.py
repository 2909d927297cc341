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


def ids_digest(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()[:16]


def read_predictions(path: Path) -> dict[str, dict]:
    """The records of a (possibly interrupted) predictions file, by trajectory id."""
    out: dict[str, dict] = {}
    lines = path.read_text(encoding="utf-8").split("\n")
    complete = lines[-1] == ""          # a file cut short by a kill ends without a newline
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if no == len(lines) and not complete:
                break                    # the kill's half-written last line: walked again
            raise UsageError(f"{path}:{no}: not a prediction record ({e.msg}); remove the line "
                             f"or run without --resume") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            raise UsageError(f"{path}:{no}: field 'id': a prediction record needs its trajectory id")
        out[rec["id"]] = rec
    return out


class PredictionLog:
    def __init__(self, out: Path, settings: dict, *, resume: bool = False):
        self.out = Path(out)
        self.path = self.out / PREDICTIONS_FILE
        self.done: dict[str, dict] = {}
        self.out.mkdir(parents=True, exist_ok=True)
        spath = self.out / SETTINGS_FILE
        if resume and self.path.exists():
            if not spath.exists():
                raise UsageError(f"--resume: {self.out} holds {PREDICTIONS_FILE} but no {SETTINGS_FILE} "
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
