"""Stage 1's run folder: what it holds and when a run may use it (both phases read it).

- the preference cache (`preferences.jsonl` + `preference_stats.json`, written by the preferences
  phase, only read by the training phase);
- `config.yaml`: a run folder belongs to one config; `--resume` may change only the settings in
  `RESUMABLE` (they touch neither the data, the model nor the optimisation);
- `checkpoint-NNNNNN/` (complete once `trainer_state.json` is written) and `run.json` (seeds,
  versions, schedule, one entry per invocation).

    from training.stage1.run_folder import latest_checkpoint
    latest_checkpoint(Path("runs/stage1-tiny"))     # (step, folder) or None
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from aftraj.errors import UsageError

CKPT = re.compile(r"^checkpoint-(\d+)$")
# settings a resumed run may change: they do not touch the data, the model or the optimisation
RESUMABLE = frozenset({"output_dir", "logging_steps", "save_steps", "save_total_limit", "report_to",
                       "wandb_project", "process_group_timeout_minutes", "sdpa_math_kernel", "export_dtype"})


def cache_paths(out: Path) -> tuple[Path, Path]:
    """(preferences.jsonl, preference_stats.json) of the run folder."""
    return out / "preferences.jsonl", out / "preference_stats.json"


def write_preferences(out: Path, records: list[dict], stats: dict) -> None:
    """The preference cache: records first under a temporary name, then the stats."""
    rec_path, stats_path = cache_paths(out)
    tmp = rec_path.with_suffix(".partial")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tmp.rename(rec_path)
    stats_path.write_text(json.dumps(stats, indent=2) + "\n")


def read_preferences(out: Path) -> tuple[list[dict], dict]:
    rec_path, stats_path = cache_paths(out)
    records = [json.loads(line) for line in rec_path.read_text(encoding="utf-8").splitlines()]
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    return records, stats


def latest_checkpoint(out: Path) -> tuple[int, Path] | None:
    """(step, folder) of the latest complete checkpoint (one with trainer_state.json), or None."""
    found = [(int(m.group(1)), p) for p in out.glob("checkpoint-*") if (m := CKPT.match(p.name))
             and (p / "trainer_state.json").exists()]
    return max(found) if found else None


def check_run_folder(cfg, out: Path, *, resume: bool, latest) -> None:
    """The run folder holds this config's run (or nothing); --resume needs a checkpoint."""
    if resume and latest is None:
        raise FileNotFoundError(f"--resume: {out} holds no complete checkpoint-*; a resume that restores "
                                f"nothing would silently restart the run")
    if out.exists() and any(out.glob("checkpoint-*")) and not resume:
        raise FileExistsError(f"{out} already holds checkpoints; pass --resume to continue the run, "
                              f"or choose another --out")
    if not (out / "config.yaml").exists():
        return
    was, now = yaml.safe_load((out / "config.yaml").read_text()), cfg.to_dict()
    if not resume and was != now and not (latest is None and same_but_resumable(was, now)):
        raise FileExistsError(f"{out} holds a run with another config (see {out / 'config.yaml'}); "
                              f"choose another --out, or delete it")
    if resume:
        changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k) and k not in RESUMABLE)
        if changed:   # the cached preferences, reference log-probs and schedule belong to the old config
            raise UsageError(f"{out}: --resume with settings that differ from the run's "
                             f"{out / 'config.yaml'}: {', '.join(changed)}; resume with the same config")


def same_but_resumable(was: dict, now: dict) -> bool:
    return all(was.get(k) == now.get(k) or k in RESUMABLE for k in set(was) | set(now))


def record(acc, out: Path, **fields) -> None:
    """Add fields to this invocation's entry in run.json (main process)."""
    if acc.is_main_process:
        info = json.loads((out / "run.json").read_text())
        info["invocations"][-1].update(fields)
        (out / "run.json").write_text(json.dumps(info, indent=2) + "\n")
