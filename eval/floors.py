"""The floors as a report stage: fit every floor (`eval.auditors.floors.ALL_FLOORS`: the
content-blind ones and the floors that read) on a train split, their thresholds on val, walk them
on the runs of a report and put them beside it (DESIGN §4 "Validity").

- `add_floors_to_report`: each `aftraj eval`'s metrics.json `floors` and report.md, with the
  run's paired difference to the best floor on these runs (`vs_best_floor`);
- `floor_scores`: a corpus build's stats.json / stats.md (`aftraj corpus build`);
- `floors_report` / `floors_markdown`: `aftraj ablation floors --data DIR [--ww who_and_when]`
  (val, test, Who&When per subset, the probe's bag of words of step k*).

On Who&When nothing is fit: only the lexical rule runs beside an evaluation there; the fitted
floors come from a corpus (`--ww`, or `train=PATH,val=PATH`).

    aftraj ablation floors --data out/aftraj-2k
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from aftraj.schema import Trajectory
from eval.auditors.floors import ALL_FLOORS, FLOORS, parse_rule
from eval.auditors.reading import READING_FLOORS, ReadingFloor
from eval.auditors.splits import split_beside

def fit_floors(train: Sequence[Trajectory] | None, val: Sequence[Trajectory] | None) -> dict:
    """{spec: fitted floor, or the reason (a str) it could not be fit}: the content-blind floors
    and the fitted reading floors on `train` (their thresholds on `val`), the lexical rule always
    (it fits nothing). Neither set may hold Who&When runs."""
    out: dict = {}
    for rule, cls in ALL_FLOORS.items():
        spec = f"heuristic:{rule}"
        if rule in READING_FLOORS and not READING_FLOORS[rule].fitted:
            out[spec] = cls(rule)
        elif not train or not any(t.label.unsafe for t in train):
            out[spec] = "no train split with an unsafe run to fit on"
        elif rule in READING_FLOORS and (not val or not any(t.label.unsafe for t in val)):
            out[spec] = "no val split with an unsafe run to choose its threshold on"
        else:
            out[spec] = cls(rule, train=train) if rule in FLOORS else cls(rule, train=train, val=val)
    return out


def _overall(preds: list[dict], n_boot: int, seed: int) -> dict:
    from eval.metrics import grouped

    g = grouped(preds, n_boot=n_boot, seed=seed)
    out = {k: g["overall"].get(k) for k in ("n", "n_safe", "n_unsafe", "exact_f1", "exact_f1_ci", "step_acc",
                                            "step_acc_ci", "agent_acc", "far", "far_ci", "step_precision")}
    if len(g["by_subset"]) > 1:
        out["by_subset"] = {s: {k: m.get(k) for k in ("n", "n_unsafe", "exact_f1", "step_acc", "step_acc_ci",
                                                      "agent_acc", "far")} for s, m in g["by_subset"].items()}
    return out


def describe_floor(floor) -> dict:
    """The floor's kind and, for a fitted reading floor, its threshold and how it was chosen."""
    d = {"kind": "reading" if isinstance(floor, ReadingFloor) else "content-blind"}
    if isinstance(floor, ReadingFloor):
        desc = floor.describe()
        d["threshold"] = desc["threshold"]
        d["tuning"] = desc["tuning"]
    return d


def score_floors(floors: dict, trajs: Sequence[Trajectory], *, n_boot: int = 200, seed: int = 0,
                 keep_preds: bool = False) -> dict:
    """{spec: metrics (+ threshold) of the floor walked on `trajs`, or {"skipped": reason}}; with
    `keep_preds` each entry also holds its prediction records (`preds`)."""
    from eval.walker import walk

    out = {}
    for spec, floor in floors.items():
        if isinstance(floor, str):
            out[spec] = {"skipped": floor}
            continue
        preds = walk(floor, list(trajs), progress=False)
        out[spec] = {**_overall(preds, n_boot, seed), **describe_floor(floor)}
        if keep_preds:
            out[spec]["preds"] = preds
    return out


def best_floor(scored: dict) -> str | None:
    """The floor with the highest Exact-F1 on these runs (ties: the first in `ALL_FLOORS`)."""
    ok = [(spec, g["exact_f1"]) for spec, g in scored.items() if "skipped" not in g and g.get("exact_f1") is not None]
    return max(ok, key=lambda x: x[1])[0] if ok else None


PAIRED = ("exact_f1", "step_acc", "far")


def paired_vs_floor(preds: list[dict], floor_preds: list[dict], *, n_boot: int = 1000, seed: int = 0) -> dict:
    """{metric: `eval.metrics.paired_difference`(run, floor)} for Exact-F1, Step-Acc and FAR."""
    from eval.metrics import paired_difference

    return {m: paired_difference(preds, floor_preds, m, n_boot=n_boot, seed=seed) for m in PAIRED}


def _split_or_none(data, split: str) -> list[Trajectory] | None:
    try:
        return split_beside(data, split)
    except ValueError:
        return None


# --------------------------------------------------------------------------- the report hook

def floor_metrics(data: str | Path, trajs: Sequence[Trajectory], *, n_boot: int = 200, seed: int = 0,
                  keep_preds: bool = False) -> dict:
    """{floor spec: overall metrics} of every floor on `trajs`, fit on the train split beside
    `data` (thresholds on the val split beside it); without a train split (Who&When) the floors
    that fit are {"skipped": why} and the lexical rule alone is scored."""
    train = _split_or_none(data, "train")
    floors = fit_floors(train, _split_or_none(data, "val"))
    if train is None:   # Who&When, or a file alone: say where the fitted floors can be had
        floors = {spec: (f"no train split beside the data (fit them on a corpus: `aftraj ablation floors "
                         f"--data DIR --ww {data}`)" if isinstance(f, str) else f) for spec, f in floors.items()}
    return score_floors(floors, trajs, n_boot=n_boot, seed=seed, keep_preds=keep_preds)


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.2f} %"


def _ci_pct(g: dict, key: str) -> str:
    v, ci = g.get(key), g.get(f"{key}_ci")
    return _pct(v) + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if v is not None and ci else "")


def _diff(d: dict | None) -> str:
    if d is None:
        return "–"
    ci = "" if d["ci"] is None else f" [{100 * d['ci'][0]:+.1f}, {100 * d['ci'][1]:+.1f}]"
    return f"{100 * d['diff']:+.1f} pts{ci}"


def floor_table(floors: dict, under_test: tuple[str, dict] | None = None) -> list[str]:
    """Markdown rows: the auditor under test (when given), then each floor with its threshold."""
    lines = ["| auditor | n | Exact-F1 [95 %] | Step-Acc | Agent-Acc | FAR | threshold (val) |",
             "|---|---|---|---|---|---|---|"]
    if under_test is not None:
        name, ov = under_test
        lines.append(f"| {name} (under test) | {ov['n']} | {_ci_pct(ov, 'exact_f1')} | {_pct(ov.get('step_acc'))} | "
                     f"{_pct(ov.get('agent_acc'))} | {_pct(ov.get('far'))} | |")
    for spec, g in floors.items():
        if "skipped" in g:
            lines.append(f"| {spec} | – | – | – | – | – | not scored: {g['skipped']} |")
            continue
        th = g.get("threshold")
        tu = g.get("tuning") or {}
        th_s = ("–" if g.get("kind") != "reading" else "none (fixed rule)" if th is None
                else f"{th:.4g}" + (f" (val F1 {_pct(tu['val']['exact_f1'])}, FAR {_pct(tu['val']['far'])})"
                                    if tu.get("val") else ""))
        lines.append(f"| {spec} | {g['n']} | {_ci_pct(g, 'exact_f1')} | {_pct(g['step_acc'])} | "
                     f"{_pct(g['agent_acc'])} | {_pct(g['far'])} | {th_s} |")
    return lines


def add_floors_to_report(out: str | Path, data: str | Path, trajs: Sequence[Trajectory], *,
                         auditor_spec: str = "", seed: int = 0) -> dict:
    """Append every floor to metrics.json (`floors`) and report.md (a table), with the run's paired
    differences against the best floor on these runs (`vs_best_floor`)."""
    out = Path(out)
    if parse_rule(auditor_spec) in ALL_FLOORS:
        return {}
    mpath = out / "metrics.json"
    metrics = json.loads(mpath.read_text(encoding="utf-8"))
    n_boot = metrics.get("n_boot") or 1000
    floors = floor_metrics(data, trajs, seed=seed, n_boot=min(n_boot, 1000), keep_preds=True)
    if not floors:
        return {}
    preds = {spec: g.pop("preds") for spec, g in floors.items() if "preds" in g}
    best = best_floor(floors)
    vs = None
    run_preds_file = out / "predictions.jsonl"
    if best is not None and run_preds_file.is_file():
        run_preds = [json.loads(x) for x in run_preds_file.read_text(encoding="utf-8").splitlines() if x.strip()]
        if sorted(p["id"] for p in run_preds) == sorted(p["id"] for p in preds[best]):
            vs = {"floor": best, **paired_vs_floor(run_preds, preds[best], n_boot=n_boot, seed=seed)}
    metrics["floors"] = floors
    metrics["vs_best_floor"] = vs
    mpath.write_text(json.dumps(metrics, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    lines = ["", "## Floors (fit on the train split, thresholds on val; DESIGN §4)", "",
             "Content-blind floors (position prior, length) and floors that read (the error-word rule, a "
             "bag of words over single steps, an agent/step-kind n-gram rule): a corpus that needs reading "
             "keeps each at or below 10 % Exact-F1.", ""]
    lines += floor_table(floors, (metrics["auditor"], metrics["overall"]))
    if vs is not None:
        lines += ["", f"Paired difference, {metrics['auditor']} minus the best floor here ({best}), paired "
                      f"bootstrap over these runs (95 %): Exact-F1 {_diff(vs['exact_f1'])}, Step-Acc "
                      f"{_diff(vs['step_acc'])}, FAR {_diff(vs['far'])}."]
    with open(out / "report.md", "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return floors



def floor_scores(trajs: list[Trajectory], split_of: dict[str, str]) -> dict:
    """Every floor fit on a built corpus's train split (thresholds on its val split), scored on
    its test split, with the val figures beside (stats.json's `floors_on_test`:
    `build_corpus(..., floors=floor_scores)`, `aftraj corpus build`)."""
    by = {s: [t for t in trajs if split_of[t.family_id] == s] for s in ("train", "val", "test")}
    if not by["test"] or not any(t.label.unsafe for t in by["train"]):
        return {}
    floors = fit_floors(by["train"], by["val"])
    test = score_floors(floors, by["test"], n_boot=0)
    val = score_floors(floors, by["val"], n_boot=0) if by["val"] else {}
    keys = ("n", "exact_f1", "step_acc", "agent_acc", "far")
    out = {}
    for spec, g in test.items():
        if "skipped" in g:   # stats.md's table needs figures: a floor that could not be fit is left out
            continue
        out[spec] = {k: g.get(k) for k in keys}
        out[spec]["threshold"] = g.get("threshold")
        if spec in val and "skipped" not in val[spec]:
            out[spec]["val"] = {k: val[spec].get(k) for k in keys}
    return out


# --------------------------------------------------------------------------- the floors' table of a corpus

def floors_report(data: str | Path, *, ww: str | Path | None = None, n_boot: int = 1000, seed: int = 0,
                  probe: bool = True) -> dict:
    """Every floor fit on the train split of the corpus folder `data` (thresholds on its val
    split), scored on val and test with bootstrap intervals, on Who&When `ww` (evaluation only:
    per subset) when given, and the probe's bag of words of step k* (`eval.probe.bow_k_star`, fit on
    train twin pairs) on the val + test pairs, kind-matched headline (`aftraj ablation floors`)."""
    import time

    from aftraj.readers import load_trajectories

    t0 = time.perf_counter()
    splits = {s: split_beside(data, s) for s in ("train", "val", "test")}
    floors = fit_floors(splits["train"], splits["val"])
    out: dict = {"data": str(data), "n": {s: len(v) for s, v in splits.items()},
                 "floors": {spec: ({"skipped": f} if isinstance(f, str) else describe_floor(f))
                            for spec, f in floors.items()}}
    for s in ("val", "test"):
        out[s] = score_floors(floors, splits[s], n_boot=n_boot, seed=seed)
    if ww is not None:
        out["ww"] = score_floors(floors, load_trajectories(ww), n_boot=n_boot, seed=seed)
        out["ww_data"] = str(ww)
    if probe:
        from eval.probe import bow_k_star

        res = bow_k_star(splits["train"], splits["val"] + splits["test"], n_boot=n_boot, seed=seed)
        out["probe_bow_k_star"] = res
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def floors_markdown(r: dict) -> str:
    """`floors_report`'s tables."""
    lines = [f"# Floors of {r['data']}", "",
             f"Fit on train ({r['n']['train']} runs); the bag of words' and the structure rule's thresholds "
             f"chosen on val ({r['n']['val']} runs) at FAR ≤ 20 % (the best val Exact-F1), never on test "
             f"({r['n']['test']} runs). 95 % bootstrap intervals over runs.", ""]
    for s in ("val", "test"):
        lines += [f"## {s}", "", *floor_table(r[s]), ""]
    if "ww" in r:
        subsets = sorted({x for g in r["ww"].values() for x in (g.get("by_subset") or {})})
        lines += [f"## Who&When ({r['ww_data']}; evaluation only, the floors fit on the corpus)", "",
                  "| floor | n | Step-Acc | " + " | ".join(f"Step-Acc {x}" for x in subsets) + " |",
                  "|---|---|---|" + "---|" * len(subsets)]
        for spec, g in r["ww"].items():
            if "skipped" in g:
                lines.append(f"| {spec} | – | not scored: {g['skipped']} |" + " |" * len(subsets))
                continue
            sub = g.get("by_subset") or {}
            lines.append(f"| {spec} | {g['n']} | {_ci_pct(g, 'step_acc')} | " + " | ".join(
                f"{_pct(sub[x]['step_acc'])} (n={sub[x]['n']})" if x in sub else "–" for x in subsets) + " |")
        lines.append("")
    b = r.get("probe_bow_k_star")
    if b is not None:
        s = b["summary"]
        pt, pa = s["post_beats_twin"], s["post_beats_twin_all_pairs"]

        def share(g):
            return "–" if g["share"] is None else f"{100 * g['share']:.1f} %" + (
                f" [{100 * g['ci'][0]:.1f}, {100 * g['ci'][1]:.1f}]" if g.get("ci") else "")

        lines += ["## Probe: a bag of words of step k* (fit on train twin pairs)", "",
                  f"post > twin on {pt['n']} kind-matched val + test pairs: {share(pt)}; every pair found "
                  f"({pa['n']}): {share(pa)}; pairs left out for their kind at k*: {s['kind_unmatched_pairs']}. "
                  f"Fit on {b['n_train_pairs']} train pairs (train accuracy {100 * b['train_accuracy']:.1f} %; "
                  f"top words {', '.join(f for f, _ in b['top_features'][:6])}).", ""]
    lines.append(f"Measured in {r['wall_s']} s.")
    return "\n".join(lines) + "\n"
