"""Several finished evaluation runs side by side: one table (compare.md, compare.csv) and one
plot (compare.png) with each run's bootstrap 95 % interval drawn, from the runs' metrics.json.
Each row names the model (not just "hf"), its n, and the per-step AUC where the run has scores;
runs measured on different trajectories (their predictions.jsonl ids), data, samples or
protocols get a warning in compare.md and on stderr (`warnings` in the result). Runs on the same
trajectories also get each run's difference to the first in Exact-F1, Step-Acc and FAR with a
paired bootstrap interval (`eval.metrics.paired_difference`): is the first row above a floor, or
only inside its interval?

    aftraj eval compare runs/ww-random runs/ww-rules --out runs/compare
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from eval.metrics import paired_difference
from eval.report import LABEL_MAX, TITLE_MAX, auditor_name, model_name, percent_axes, run_line, save_figure, shorten

# (metric, label, percent?) in table order; the first three are plotted with their intervals.
COLUMNS = (("exact_f1", "Exact-F1", True), ("step_acc", "Step-Acc", True), ("far", "FAR", True),
           ("agent_acc", "Agent-Acc", True), ("ass", "ASS", False),
           ("parse_failure_rate", "parse failures", True), ("calls_per_traj", "calls/traj", False))
PLOTTED = ("exact_f1", "step_acc", "far")


def load_run(d: Path) -> dict:
    f = d / "metrics.json"
    if not f.is_file():
        raise FileNotFoundError(f"{d}: no metrics.json (not an `aftraj eval` output folder)")
    return json.loads(f.read_text(encoding="utf-8"))


def _names(dirs: list[Path], runs: list[dict]) -> list[str]:
    labels = [auditor_name(r) if "auditor" in r else d.name for d, r in zip(dirs, runs, strict=True)]
    return [f"{lab} [{d.name}]" if labels.count(lab) > 1 else lab for d, lab in zip(dirs, labels, strict=True)]


def _preds(d: Path) -> list[dict] | None:
    f = d / "predictions.jsonl"
    if not f.is_file():
        return None
    return [json.loads(x) for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]


def _ids(d: Path) -> list[str] | None:
    preds = _preds(d)
    return None if preds is None else sorted(p["id"] for p in preds)


def comparability_warnings(dirs: list[Path], runs: list[dict], names: list[str]) -> list[str]:
    """Why the rows may not be comparable: other trajectories, data, split, sample or protocol."""
    out = []
    ids = [_ids(d) for d in dirs]
    known = [(n, i) for n, i in zip(names, ids, strict=True) if i is not None]
    if len({tuple(i) for _, i in known}) > 1:
        out.append("the runs were measured on different trajectories: " + "; ".join(
            f"{n}: n={len(i)}" for n, i in known) + (f"; {len(set.intersection(*(set(i) for _, i in known)))} "
                                                     f"in common"))
    for key, what in (("data", "data"), ("split", "split"), ("sample", "sample (--sample N / --sample-seed)"),
                      ("protocol", "protocol"), ("layout", "prompt layout"), ("parser", "parser")):
        vals = [json.dumps(r.get(key), sort_keys=True) for r in runs]
        applied = set(vals)
        if key in ("layout", "parser"):   # null: the auditor renders no prompt, the flag never applied
            applied = {v for v, r in zip(vals, runs, strict=True) if not (key in r and r[key] is None)}
        if len(applied) > 1:
            out.append(f"the runs differ in {what}: "
                       + "; ".join(f"{n}: {v}" for n, v in zip(names, vals, strict=True)))
    return out


def _fmt(v, pct: bool) -> str:
    if v is None:
        return "–"
    return f"{100 * v:.2f} %" if pct else f"{v:.3f}"


def _auc(r: dict) -> tuple[float | None, list | None]:
    a = r.get("stratified_auc") or {}
    return a.get("auc"), a.get("ci")


PAIRED = ("exact_f1", "step_acc", "far")


def paired_lines(dirs: list[Path], runs: list[dict], names: list[str]) -> list[str]:
    """compare.md's paired section: the first run minus each other run, on the trajectories they
    share (every run's predictions.jsonl holds the same ids); [] when they do not."""
    preds = [_preds(d) for d in dirs]
    if len(dirs) < 2 or any(p is None for p in preds) or len({tuple(sorted(x["id"] for x in p)) for p in preds}) > 1:
        return []
    n_boot, seed = runs[0].get("n_boot") or 1000, runs[0].get("seed") or 0
    lines = [f"## Paired differences: {names[0]} minus each run", "",
             "On the same trajectories, a paired bootstrap over them (95 % interval; "
             "P(≤ 0): the share of resamples where the first run is not above).", "",
             "| run | " + " | ".join(f"Δ {lab}" for m, lab, _ in COLUMNS if m in PAIRED) + " |",
             "|---|" + "---|" * len(PAIRED)]
    for name, p in zip(names[1:], preds[1:], strict=True):
        cells = []
        for m in PAIRED:
            d = paired_difference(preds[0], p, m, n_boot=n_boot, seed=seed)
            if d is None:
                cells.append("–")
            else:
                ci = "" if d["ci"] is None else f" [{100 * d['ci'][0]:+.2f}, {100 * d['ci'][1]:+.2f}]"
                pv = "" if d["p_not_above"] is None else f", P(≤ 0) {d['p_not_above']:.3f}"
                cells.append(f"{100 * d['diff']:+.2f} pts{ci}{pv}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def compare_runs(dirs: list[Path], out: Path) -> dict[str, str]:
    """Write compare.md, compare.csv and (when any plotted metric has a value) compare.png.
    Returns {what: path}, plus "warnings" (a list) when the rows may not be comparable."""
    runs = [load_run(d) for d in dirs]
    names = _names(dirs, runs)
    warns = comparability_warnings(dirs, runs, names)
    out.mkdir(parents=True, exist_ok=True)
    written = {}

    with open(out / "compare.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["run", "dir", "model", "data", "split", "protocol", "n", "n_safe", "n_unsafe"]
                   + [c for m, _, _ in COLUMNS for c in (m, f"{m}_ci_low", f"{m}_ci_high")]
                   + ["stratified_auc", "stratified_auc_ci_low", "stratified_auc_ci_high"])
        for d, name, r in zip(dirs, names, runs, strict=True):
            ov = r["overall"]
            row = [name, str(d), model_name(r), r.get("data"), r.get("split"), r.get("protocol"), ov["n"],
                   ov.get("n_safe"), ov.get("n_unsafe")]
            for m, _, _ in COLUMNS:
                ci = ov.get(f"{m}_ci") or (None, None)
                row += [ov.get(m), ci[0], ci[1]]
            auc, ci = _auc(r)
            row += [auc, *(ci or (None, None))]
            w.writerow(["" if v is None else v for v in row])
    written["table (csv)"] = str(out / "compare.csv")

    lines = ["# Evaluation runs compared", "",
             "Overall figures with bootstrap 95 % intervals over trajectories; – where a metric "
             "cannot be measured (FAR without safe runs, AUC without per-prefix scores).", ""]
    for wmsg in warns:
        lines += [f"**Warning: {wmsg}**: compare with care.", ""]
    with_auc = any(_auc(r)[0] is not None for r in runs)
    lines += ["| run | data | split | protocol | n (safe / unsafe) | " + " | ".join(lab for _, lab, _ in COLUMNS)
              + (" | stratified AUC |" if with_auc else " |"),
              "|---|---|---|---|---|" + "---|" * (len(COLUMNS) + with_auc)]
    for name, r in zip(names, runs, strict=True):
        ov = r["overall"]
        cells = []
        for m, _, pct in COLUMNS:
            ci = ov.get(f"{m}_ci")
            cells.append(_fmt(ov.get(m), pct) + (f" [{_fmt(ci[0], pct)}, {_fmt(ci[1], pct)}]" if ci else ""))
        if with_auc:
            auc, ci = _auc(r)
            cells.append(_fmt(auc, False) + (f" [{_fmt(ci[0], False)}, {_fmt(ci[1], False)}]" if ci else ""))
        lines.append(f"| {name} | `{r.get('data')}` | {r.get('split') or '–'} | {r.get('protocol')} | "
                     f"{ov['n']} ({ov.get('n_safe')} / {ov.get('n_unsafe')}) | " + " | ".join(cells) + " |")
    plotted = [m for m in PLOTTED if any(r["overall"].get(m) is not None for r in runs)]
    lines.append("")
    lines += paired_lines(dirs, runs, names)
    if plotted:
        _plot(runs, names, plotted, out / "compare.png")
        lines += ["![compare](compare.png)", ""]
        written["plot"] = str(out / "compare.png")
        for m in PLOTTED:
            if m not in plotted:
                lines.append(f"- {m} is not plotted: no run could measure it.")
    else:
        (out / "compare.png").unlink(missing_ok=True)
        lines.append("- compare.png not drawn: no run has Exact-F1, Step-Acc or FAR.")
    (out / "compare.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    written["table (markdown)"] = str(out / "compare.md")
    if warns:
        written["warnings"] = warns
    return written


def _plot(runs: list[dict], names: list[str], metrics: list[str], path: Path) -> None:
    save_figure(draw_compare(runs, names, metrics), None, path)


def draw_compare(runs: list[dict], names: list[str], metrics: list[str]):
    """compare.png's figure, drawn, not saved (tests read its axes): one panel a metric, one row
    a run with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = dict((m, lab) for m, lab, _ in COLUMNS)
    pct = dict((m, is_pct) for m, _, is_pct in COLUMNS)
    height = 1.2 + 0.45 * len(runs)
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics) + 2.5, height), dpi=110,
                             sharey=True, squeeze=False)
    ys = list(range(len(runs)))[::-1]
    for ax, m in zip(axes[0], metrics, strict=True):
        for i, (y, r) in enumerate(zip(ys, runs, strict=True)):
            g = r["overall"]
            v, ci = g.get(m), g.get(f"{m}_ci")
            if v is None:
                ax.text(0.5, y, "n/a", ha="center", va="center", fontsize=8, color="gray")
                continue
            xerr = [[v - ci[0]], [ci[1] - v]] if ci else None
            ax.errorbar([v], [y], xerr=xerr, fmt="o", color=f"C{i}", capsize=4, ms=6)
        ax.set(xlim=(-0.04, 1.04), title=labels[m],
               xlabel=f"{labels[m]} (%), 95 % interval" if pct[m] else f"{labels[m]}, 95 % interval")
        if pct[m]:
            percent_axes(ax, "x")
        ax.grid(alpha=0.3, axis="x")
    # short labels (the full names are compare.md's rows), so the axes keep the width
    axes[0][0].set_yticks(ys)
    axes[0][0].set_yticklabels([f"{shorten(n, LABEL_MAX)} (n={r['overall']['n']})"
                                for n, r in zip(names, runs, strict=True)], fontsize=8)
    axes[0][0].set_ylim(-0.7, len(runs) - 0.3)
    axes[0][0].set_ylabel("run")
    # runs whose auditor renders no prompt ("layout n/a") agree with any layout and parser
    lines = {run_line(r) for r in runs if r.get("layout", "") is not None} or {run_line(r) for r in runs}
    fig.suptitle(shorten(lines.pop(), TITLE_MAX) if len(lines) == 1 else
                 "the runs differ in protocol, layout or parser (see compare.md)", fontsize=9, y=1.0 + 0.15 / height)
    return fig
