"""Combine the ladder's probe.json files (a row may be probed on the test and val splits in two
runs) into one table rendered by aftraj.drivers.ablation.probe_lines; rules recomputed on the same runs.

    python reports/ablation-cpu/ladder_report.py '{"ROW": ["probe.json", ...]}' '{"ROW": "linear_probe.json"}' \
        OUT_DIR "test split" [HELDOUT.jsonl]

How ladder.md was made (2026-12-01): the warmed base's probe.json (test split) and stage 1's
probe.json restricted to the same 30 runs, then stage 1's on all 59 held-out runs."""
import json, sys
from pathlib import Path
from aftraj.readers import load_trajectories
from eval.probe import _breakdown, probe, summarize
from aftraj.drivers.ablation import probe_lines

rows = json.loads(sys.argv[1])          # {row: [probe.json, ...]}
linear = json.loads(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else {}
data = Path(sys.argv[5] if len(sys.argv) > 5 else "runs/ablation-cpu/probe-data/heldout.jsonl")
out_dir = Path(sys.argv[3]) if len(sys.argv) > 3 else Path("/work/runs/ladder")
table, raw = {}, {}
ids = None
for row, files in rows.items():
    runs = [r for f in files for r in json.loads(Path(f).read_text())["runs"]]
    s = summarize(runs, n_boot=1000, seed=0)
    if all("full" in r.get("post", {}) for r in runs):
        s["full_sequence"] = summarize(runs, n_boot=1000, seed=0, key="full")
    s["by_domain"] = _breakdown(runs, "domain", 1000, 0)
    s["by_error_type"] = _breakdown(runs, "error_type", 1000, 0)
    table[row] = s
    raw[row] = {"files": files, "n_runs": len(runs)}
    ids = {r["id"] for r in runs} if ids is None else ids
    assert ids == {r["id"] for r in runs}, f"{row} was probed on other runs"
trajs = load_trajectories(data)
res = probe(trajs, lambda m, t, a: {"decision": 0.0}, budget=None, count_tokens=lambda s: 0, n_boot=1000, seed=0)
# the rules on exactly the probed runs (same filter): rerun the rules over those ids
from eval.probe import CONTENT_BLIND_RULES, probe_prompts
items = [i for i in probe_prompts(trajs, budget=None, count_tokens=lambda s: 0) if i["traj"].id in ids]
for name, rule in CONTENT_BLIND_RULES.items():
    recs = [{sub: {"decision": rule(i["runs"][sub], p.t)} for sub, p in i["prompts"].items()} for i in items]
    table[name] = summarize(recs, n_boot=1000, seed=0)
lin = {row: json.loads(Path(f).read_text()) for row, f in linear.items()}
md = "\n".join(probe_lines(table, lin, sys.argv[4] if len(sys.argv) > 4 else "val + test"))
(out_dir / "ladder.md").write_text(md + "\n")
(out_dir / "ladder.json").write_text(json.dumps({"rows": table, "linear_probe": lin, "sources": raw}, indent=1) + "\n")
print(md)
