"""Provenance of an evaluation run, written into metrics.json: package version, git commit,
the command line that reproduces the run, the auditor settings, the date and a hash of the
prompt template in use (a change of system prompt, step layout or instruction changes it).

    python -c "from eval.provenance import prompt_template_hash; print(prompt_template_hash())"
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import platform
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_state(repo: Path = REPO) -> dict:
    """{"commit": sha or None, "dirty": bool or None}: None where this is not a git checkout."""
    def git(*a: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def command_line(args: argparse.Namespace, parser: argparse.ArgumentParser, prog: str) -> str:
    """The shortest command that reproduces `args`: every option that differs from its default."""
    parts = shlex.split(prog)
    for a in parser._actions:   # argparse keeps its actions here; public API has no accessor
        if a.dest in ("help", argparse.SUPPRESS) or a.dest.startswith("_"):
            continue
        v = getattr(args, a.dest, a.default)
        if not a.option_strings:          # positionals
            parts += [str(x) for x in (v if isinstance(v, list) else [v])] if v not in (None, []) else []
            continue
        if v == a.default:
            continue
        opt = max(a.option_strings, key=len)
        if isinstance(a, argparse._StoreTrueAction):
            parts.append(opt)
        else:
            parts += [opt, str(v)]
    return shlex.join(parts)


def _probe_trajectory():
    from aftraj.schema import Label, Step, Trajectory

    steps = [Step(0, "user", "message", "Compute 2+2."),
             Step(1, "Solver", "tool_call", "calling", tool="calc", arguments={"x": "2+2"}, thought="t"),
             Step(2, "environment", "tool_result", "4 " + "x" * 2500),
             Step(3, "Solver", "final_answer", "5")]
    return Trajectory(id="probe", family_id="probe", domain="math", source="probe",
                      task="Compute 2+2. " + "y" * 600, steps=steps,
                      label=Label("UNSAFE", "injected", decisive_step=3, decisive_agent="Solver"))


def prompt_template_hash(layout: str = "ours", **render_kw) -> str:
    """sha256 of the messages rendered for a fixed probe trajectory at t = 1 and t = 3, so any
    change of system prompt, step rendering, header, instruction or cut rule changes it."""
    from aftraj.prompt import render

    traj = _probe_trajectory()
    msgs = [render(traj, t, layout=layout, **render_kw) for t in (1, 3)]
    return hashlib.sha256(json.dumps(msgs, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def provenance(*, command: str, settings: dict, layout: str = "ours") -> dict:
    import aftraj

    return {"package_version": aftraj.__version__, "git": git_state(), "command": command,
            "date_utc": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "python": platform.python_version(), "auditor_settings": settings,
            "prompt_layout": layout, "prompt_template_sha256": prompt_template_hash(layout)}
