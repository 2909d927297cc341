"""Combine the ladder's probe.json files (a row may be probed on the test and val splits in two
runs) into one table rendered by aftraj.drivers.ablation.probe_lines; the content-blind rules are
recomputed on exactly the probed runs. Writes OUT_DIR/ladder.md and OUT_DIR/ladder.json.

    python -m aftraj.drivers.ladder_report '{"ROW": ["probe.json", ...]}' '{"ROW": "linear_probe.json"}' \\
        OUT_DIR "test split" [HELDOUT.jsonl]

How `reports/ablation-cpu/ladder.md` was made (2026-12-01): the warmed base's probe.json (test
split) and stage 1's probe.json restricted to the same 30 runs, then stage 1's on all 59 held-out
runs. It lives in the top layer because it renders with the ablation driver's table code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from aftraj.drivers.ablation import probe_lines
from aftraj.errors import UsageError
from aftraj.guard import run_guarded
from aftraj.readers import load_trajectories
from eval.probe import CONTENT_BLIND_RULES, breakdown, probe_prompts, summarize

USAGE = ("usage: python -m aftraj.drivers.ladder_report ROWS_JSON [LINEAR_JSON] [OUT_DIR] [HELDOUT_NAME] "
         "[HELDOUT.jsonl]")
DEFAULT_HELDOUT = "runs/ablation-cpu/probe-data/heldout.jsonl"


def _json_arg(text: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{what}: not JSON ({e.msg}); {USAGE}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{what}: a JSON object {{row: ...}} expected; {USAGE}")
    return value


def ladder(rows: dict[str, list[str]], linear: dict[str, str], heldout: str | Path, *,
           n_boot: int = 1000, seed: int = 0) -> tuple[dict, dict, dict]:
    """(table, linear probes, sources): per row the probe summary over its probe.json files (by
    domain and error type too), then each content-blind rule on the same runs."""
    table, sources, ids = {}, {}, None
    for row, files in rows.items():
        for f in files:
            if not Path(f).is_file():
                raise UsageError(f"row {row!r}: {f}: no such file")
        runs = [r for f in files for r in json.loads(Path(f).read_text())["runs"]]
        s = summarize(runs, n_boot=n_boot, seed=seed)
        if all("full" in r.get("post", {}) for r in runs):
            s["full_sequence"] = summarize(runs, n_boot=n_boot, seed=seed, key="full")
        s["by_domain"] = breakdown(runs, "domain", n_boot, seed)
        s["by_error_type"] = breakdown(runs, "error_type", n_boot, seed)
        table[row] = s
        sources[row] = {"files": files, "n_runs": len(runs)}
        got = {r["id"] for r in runs}
        if ids is not None and got != ids:
            raise UsageError(f"row {row!r} was probed on other runs than the rows before it")
        ids = got
    if not Path(heldout).is_file():
        raise UsageError(f"HELDOUT {heldout}: no such file")
    trajs = load_trajectories(heldout)
    items = [i for i in probe_prompts(trajs, budget=None, count_tokens=lambda s: 0) if i["traj"].id in (ids or set())]
    for name, rule in CONTENT_BLIND_RULES.items():
        recs = [{sub: {"decision": rule(i["runs"][sub], p.t)} for sub, p in i["prompts"].items()} for i in items]
        table[name] = summarize(recs, n_boot=n_boot, seed=seed)
    for row, f in linear.items():
        if not Path(f).is_file():
            raise UsageError(f"linear probe {row!r}: {f}: no such file")
    lin = {row: json.loads(Path(f).read_text()) for row, f in linear.items()}
    return table, lin, sources


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    rows = _json_arg(argv[0], "ROWS_JSON")
    linear = _json_arg(argv[1], "LINEAR_JSON") if len(argv) > 1 and argv[1] else {}
    out_dir = Path(argv[2]) if len(argv) > 2 else Path("runs/ladder")
    heldout_name = argv[3] if len(argv) > 3 else "val + test"
    data = argv[4] if len(argv) > 4 else DEFAULT_HELDOUT
    if not out_dir.is_dir():
        raise UsageError(f"OUT_DIR {out_dir}: no such folder")
    table, lin, sources = ladder(rows, linear, data)
    md = "\n".join(probe_lines(table, lin, heldout_name))
    (out_dir / "ladder.md").write_text(md + "\n")
    (out_dir / "ladder.json").write_text(json.dumps({"rows": table, "linear_probe": lin, "sources": sources},
                                                    indent=1) + "\n")
    print(md)
    return 0


if __name__ == "__main__":   # a missing or bad input: one line naming it, exit 2 (aftraj.guard)
    sys.exit(run_guarded(main, sys.argv[1:], "ladder_report"))
