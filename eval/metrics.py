"""The one metrics module (DESIGN §6), versioned: every figure the reports show is computed here.

Input: prediction records, one per walked trajectory (the lines of `predictions.jsonl`, written
by `eval.walker`): `gold` ("SAFE" | "UNSAFE"), `k_star`, `a_star`, `n_steps`, `alarmed`, `d`
(the prefix that raised the first ALARM, None = never), `k_hat`, `a_hat`, `calls`, token counts,
`parse_failures`, `latencies_s`, `trace` (one entry per call), `subset`, `domain`.

Definitions (A = alarmed trajectories, U = unsafe ones with gold k*, a*, S = safe ones):
  Step Recall = |{U∩A : k̂ = k*}| / |U|     Step Precision = |{U∩A : k̂ = k*}| / |A|
  Exact-F1 = 2PR/(P+R) = 2·hits / (|A| + |U|)   Step-Acc = Step Recall
  Agent-Acc = |{U∩A : â = a*}| / |U|      ASS = mean |k̂ - k*| over U∩A (None when empty)
  FAR = |S∩A| / |S| (None without safe trajectories)   detection rate = |U∩A| / |U|
  alarm delay = mean d - k* over U∩A (negative = premature); steps saved = mean N-1-d over U∩A
  parse-failure rate = parse failures / calls
Agent match: exact after trimming and case-folding. Step match: integer equality, never substring.
Beside them, clearly labelled `ww_substring_*`, the rule of Who&When's evaluate.py (the gold
step as a substring of the predicted one, so gold 1 matches 12; the gold agent as a substring
of the predicted agent) for comparison with published numbers only.

Every ratio metric is a ratio of per-trajectory sums, so its bootstrap 95 % interval is computed
exactly by resampling trajectories (multinomial weights). A metric with an empty denominator is
None, and so is its interval.

    python -m eval.metrics runs/eval/predictions.jsonl        # recompute metrics.json's figures
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from aftraj.ranking import auc
from aftraj.verdict import agent_match, step_match

METRICS_VERSION = "1.0"

# Deployable region (DESIGN §6).
DEPLOYABLE_MAX_FAR = 0.20
DEPLOYABLE_MIN_STEP_ACC = 0.50

# The keys every group of metrics.json holds (plus `<metric>_ci` for each ratio metric).
CORE_KEYS = ("n", "n_safe", "n_unsafe", "exact_f1", "step_precision", "step_recall", "step_acc",
             "agent_acc", "ass", "far", "parse_failure_rate")


def ww_substring_step_match(pred, gold) -> bool:
    """Who&When evaluate.py's rule, for comparison only: str(gold) in str(pred) (gold 1 ~ 12)."""
    return pred is not None and gold is not None and str(gold) in str(pred)


def ww_substring_agent_match(pred, gold) -> bool:
    return pred is not None and gold is not None and str(gold) in str(pred)


# --------------------------------------------------------------------------- per-trajectory columns

@dataclass
class Columns:
    """Per-trajectory numeric columns; each ratio metric is sum(num) / sum(den)."""

    n: int
    cols: dict[str, np.ndarray]


def _columns(preds: Sequence[dict], prices: dict | None = None) -> Columns:
    def arr(f: Callable[[dict], float]) -> np.ndarray:
        return np.array([float(f(p)) for p in preds], dtype=float)

    U = arr(lambda p: p["gold"] == "UNSAFE")
    S = arr(lambda p: p["gold"] == "SAFE")
    A = arr(lambda p: bool(p["alarmed"]))
    UA = U * A
    hit = UA * arr(lambda p: step_match(p.get("k_hat"), p.get("k_star")))
    ahit = UA * arr(lambda p: agent_match(p.get("a_hat"), p.get("a_star")))
    absd = UA * arr(lambda p: abs(p["k_hat"] - p["k_star"]) if p["gold"] == "UNSAFE" and p["alarmed"]
                    and p.get("k_hat") is not None else 0.0)
    delay = UA * arr(lambda p: p["d"] - p["k_star"] if p["gold"] == "UNSAFE" and p["alarmed"] else 0.0)
    saved = UA * arr(lambda p: p["n_steps"] - 1 - p["d"] if p["alarmed"] else 0.0)
    premature = UA * arr(lambda p: p["gold"] == "UNSAFE" and p["alarmed"] and p["d"] < p["k_star"])
    ww_step = UA * arr(lambda p: ww_substring_step_match(p.get("k_hat"), p.get("k_star")))
    ww_agent = UA * arr(lambda p: ww_substring_agent_match(p.get("a_hat"), p.get("a_star")))
    cols = dict(U=U, S=S, A=A, UA=UA, SA=S * A, hit=hit, ahit=ahit, absd=absd, delay=delay,
                saved=saved, premature=premature, ww_step=ww_step, ww_agent=ww_agent,
                one=np.ones(len(preds)), A_plus_U=A + U, two_hit=2 * hit,
                calls=arr(lambda p: p.get("calls", 0)),
                pf=arr(lambda p: p.get("parse_failures", 0)),
                ptok=arr(lambda p: p.get("prompt_tokens", 0)),
                ctok=arr(lambda p: p.get("completion_tokens", 0)),
                cached=arr(lambda p: p.get("cached_tokens", 0)))
    if prices:
        cols["cost"] = (cols["ptok"] - cols["cached"]) * prices.get("prompt", 0.0) / 1e6 \
            + cols["cached"] * prices.get("cached", prices.get("prompt", 0.0)) / 1e6 \
            + cols["ctok"] * prices.get("completion", 0.0) / 1e6
    return Columns(len(preds), cols)


# metric name -> (numerator column, denominator column); all are bootstrapped.
RATIO_METRICS: dict[str, tuple[str, str]] = {
    "exact_f1": ("two_hit", "A_plus_U"),
    "step_precision": ("hit", "A"),
    "step_recall": ("hit", "U"),
    "step_acc": ("hit", "U"),
    "agent_acc": ("ahit", "U"),
    "ass": ("absd", "UA"),
    "far": ("SA", "S"),
    "detection_rate": ("UA", "U"),
    "alarm_delay": ("delay", "UA"),
    "premature_alarm_rate": ("premature", "UA"),
    "steps_saved": ("saved", "UA"),
    "parse_failure_rate": ("pf", "calls"),
    "calls_per_traj": ("calls", "one"),
    "prompt_tokens_per_traj": ("ptok", "one"),
    "completion_tokens_per_traj": ("ctok", "one"),
    "cached_prompt_fraction": ("cached", "ptok"),
    "ww_substring_step_acc": ("ww_step", "U"),
    "ww_substring_agent_acc": ("ww_agent", "U"),
}
COST_METRIC = ("cost_per_traj", ("cost", "one"))


def _ratio(num: np.ndarray, den: np.ndarray) -> float | None:
    d = float(den.sum())
    return None if d == 0 else float(num.sum()) / d


def summarize(preds: Sequence[dict], *, n_boot: int = 1000, seed: int = 0,
              prices: dict | None = None) -> dict:
    """All metrics for one group of prediction records, with bootstrap 95 % intervals."""
    c = _columns(preds, prices)
    metrics = dict(RATIO_METRICS)
    if prices:
        metrics[COST_METRIC[0]] = COST_METRIC[1]
    out: dict = {"n": c.n, "n_safe": int(c.cols["S"].sum()) if c.n else 0,
                 "n_unsafe": int(c.cols["U"].sum()) if c.n else 0}
    W = _boot_weights(c.n, n_boot, seed) if c.n and n_boot > 0 else None
    for name, (num, den) in metrics.items():
        point = _ratio(c.cols[num], c.cols[den]) if c.n else None
        out[name] = point
        out[f"{name}_ci"] = None if point is None or W is None else _ci(W, c.cols[num], c.cols[den])
    lat = [x for p in preds for x in p.get("latencies_s", [])]
    out["latency_p50_s"] = float(np.percentile(lat, 50)) if lat else None
    out["latency_p95_s"] = float(np.percentile(lat, 95)) if lat else None
    out["deployable"] = deployable(out.get("far"), out.get("step_acc"))
    return out


def ratio_with_ci(num: Sequence[float], den: Sequence[float], *, n_boot: int = 1000,
                  seed: int = 0) -> tuple[float | None, list[float] | None]:
    """sum(num) / sum(den) over units (e.g. trajectories) and its bootstrap 95 % interval over
    the units, by the same resampling as `summarize`."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    point = _ratio(num, den) if len(num) else None
    if point is None or n_boot <= 0:
        return point, None
    return point, _ci(_boot_weights(len(num), n_boot, seed), num, den)


def paired_difference(a: Sequence[dict], b: Sequence[dict], metric: str, *, n_boot: int = 1000,
                      seed: int = 0) -> dict | None:
    """metric(a) - metric(b) for two runs on the same trajectories, with a paired bootstrap 95 %
    interval: each resample draws trajectories once and scores both runs on them (the same
    resampling as `summarize`), so what the runs share (hard trajectories, few unsafe runs) cancels.
    `p_not_above` is the share of resamples where a does not beat b. None when either side cannot
    be measured. Raises ValueError when the runs' trajectory ids differ."""
    if metric not in RATIO_METRICS:
        raise ValueError(f"paired_difference: unknown metric {metric!r} (one of {sorted(RATIO_METRICS)})")
    ia, ib = sorted(p["id"] for p in a), sorted(p["id"] for p in b)
    if ia != ib or len(set(ia)) != len(ia):
        raise ValueError("paired_difference: the runs were not measured on the same trajectories")
    bid = {p["id"]: p for p in b}
    a = sorted(a, key=lambda p: p["id"])
    ca, cb = _columns(a), _columns([bid[p["id"]] for p in a])
    num, den = RATIO_METRICS[metric]
    pa, pb = _ratio(ca.cols[num], ca.cols[den]), _ratio(cb.cols[num], cb.cols[den])
    if pa is None or pb is None:
        return None
    out = {"metric": metric, "a": pa, "b": pb, "diff": pa - pb, "ci": None, "p_not_above": None, "n": ca.n}
    if n_boot > 0:
        W = _boot_weights(ca.n, n_boot, seed)
        da, db = W @ ca.cols[den], W @ cb.cols[den]
        ok = (da > 0) & (db > 0)
        if ok.any():
            d = (W @ ca.cols[num])[ok] / da[ok] - (W @ cb.cols[num])[ok] / db[ok]
            out["ci"] = [float(x) for x in np.percentile(d, [2.5, 97.5])]
            out["p_not_above"] = float(np.mean(d <= 0))
    return out


def _boot_weights(n: int, n_boot: int, seed: int) -> np.ndarray:
    """n_boot x n multiplicities of a bootstrap over n units (the resampling of every interval)."""
    return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(float)


def _ci(W: np.ndarray, num: np.ndarray, den: np.ndarray) -> list[float] | None:
    dn = W @ den
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(dn > 0, (W @ num) / np.where(dn > 0, dn, 1), np.nan)
    if np.all(np.isnan(r)):
        return None
    lo, hi = np.nanpercentile(r, [2.5, 97.5])
    return [float(lo), float(hi)]


def deployable(far: float | None, step_acc: float | None) -> bool | None:
    """FAR <= 20 % and Step-Acc >= 50 %; None when FAR cannot be measured (no safe trajectories)."""
    if far is None or step_acc is None:
        return None
    return far <= DEPLOYABLE_MAX_FAR and step_acc >= DEPLOYABLE_MIN_STEP_ACC


# --------------------------------------------------------------------------- score auditors

def _weighted_auc_num(pos: np.ndarray, wp: np.ndarray, neg: np.ndarray, wn: np.ndarray) -> np.ndarray:
    """Mann-Whitney numerator for R weightings at once (wp: R x P, wn: R x N): sum over pairs of
    wp * wn * (1 if pos > neg, 1/2 if tied), in O(R (P + N)) through the sorted distinct scores."""
    vals, inv = np.unique(np.concatenate([pos, neg]), return_inverse=True)
    m = len(vals)
    P = np.zeros((wp.shape[0], m))
    N = np.zeros((wn.shape[0], m))
    np.add.at(P.T, inv[: len(pos)], wp.T)
    np.add.at(N.T, inv[len(pos):], wn.T)
    below = np.cumsum(N, axis=1) - N
    return (P * (below + 0.5 * N)).sum(1)


STRATIFIED_POSITIVES = ("verdict", "outcome")


def stratified_auc(preds: Sequence[dict], start_step: int = 0, *, n_boot: int = 1000, seed: int = 0,
                   positive: str = "verdict") -> dict:
    """Per-step stratified ROC AUC of P(UNSAFE): at each step t >= start_step, the prefixes t of
    trajectories still being walked at t (with a score) are positives when their gold verdict at
    t is UNSAFE (t >= k*) and negatives otherwise (`positive="outcome"`: positives are all
    prefixes of unsafe trajectories, the run's eventual failure); the result is the mean of the
    per-step AUCs over steps where both classes occur. A score that only tracks t (prefix
    length) gets ties at every step, so 0.5. `ci`: bootstrap 95 % interval over trajectories
    (the same multinomial resamples as `summarize`; each resample averages its per-step AUCs
    over the steps where both classes are drawn)."""
    if positive not in STRATIFIED_POSITIVES:
        raise ValueError(f"positive must be one of {STRATIFIED_POSITIVES}, got {positive!r}")
    by_t: dict[int, tuple[list, list, list, list]] = {}
    for i, p in enumerate(preds):
        for e in p.get("trace", []):
            if e.get("confidence") is None or e["t"] < start_step:
                continue
            pos = p["gold"] == "UNSAFE" and (positive == "outcome" or e["t"] >= p["k_star"])
            cell = by_t.setdefault(e["t"], ([], [], [], []))
            cell[0 if pos else 2].append(e["confidence"])
            cell[1 if pos else 3].append(i)
    aucs = {t: auc(c[0], c[2]) for t, c in sorted(by_t.items()) if c[0] and c[2]}
    ci = None
    if aucs and n_boot > 0:
        n = len(preds)
        W = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(float)
        total, count = np.zeros(n_boot), np.zeros(n_boot)
        for t in aucs:
            ps, pi, ns, ni = (np.asarray(x) for x in by_t[t])
            wp, wn = W[:, pi], W[:, ni]
            den = wp.sum(1) * wn.sum(1)
            ok = den > 0
            total[ok] += _weighted_auc_num(ps, wp, ns, wn)[ok] / den[ok]
            count[ok] += 1
        r = total[count > 0] / count[count > 0]
        if len(r):
            ci = [float(x) for x in np.percentile(r, [2.5, 97.5])]
    return {"start_step": start_step, "positive": positive,
            "auc": float(np.mean(list(aucs.values()))) if aucs else None, "ci": ci,
            "n_steps": len(aucs), "per_step": {str(t): a for t, a in aucs.items()}}


def threshold_sweep(preds: Sequence[dict], thresholds: Sequence[float] | None = None, *,
                    key: str = "confidence") -> list[dict] | None:
    """FAR and Step-Acc when ALARM means P(UNSAFE) >= θ. Needs every prefix scored (a walk with
    `all_prefixes`), else None. An alarm on a prefix whose verdict named no step blames step t.

    `key="decision_log_odds"`: ALARM means the decision-token log-odds >= θ (the `hf` auditor's
    `decision_threshold`); a prefix whose completion never reached the decision token keeps its
    own verdict at every θ (the threshold cannot act there)."""
    if not preds or any(p.get("trace_complete") is not True for p in preds):
        return None
    logodds = key == "decision_log_odds"
    if key not in ("confidence", "decision_log_odds"):
        raise ValueError(f"threshold_sweep: key must be confidence or decision_log_odds, got {key!r}")
    if logodds:
        if not any(e.get(key) is not None for p in preds for e in p["trace"]):
            return None
    elif any(e.get("confidence") is None for p in preds for e in p["trace"]):
        return None
    if thresholds is None:
        values = {round(e[key], 4) for p in preds for e in p["trace"] if e.get(key) is not None}
        thresholds = sorted(values | ({0.0} if logodds else {0.0, 1.0}))
        if logodds:   # and one above every value: no alarm the threshold can stop
            thresholds.append(round(max(values) + 1.0, 4))

    def alarms(e: dict, th: float) -> bool:
        if logodds and e.get(key) is None:
            return bool(e.get("alarm"))
        return e[key] >= th

    out = []
    for th in thresholds:
        swept = []
        for p in preds:
            q = dict(p, alarmed=False, d=None, k_hat=None, a_hat=None)
            for e in p["trace"]:
                if alarms(e, th):
                    k = e["k"] if e.get("k") is not None else e["t"]
                    a = e["agent"] if e.get("agent") is not None else e.get("step_agent")
                    q.update(alarmed=True, d=e["t"], k_hat=k, a_hat=a)
                    break
            swept.append(q)
        m = summarize(swept, n_boot=0)
        out.append({"threshold": th, "far": m["far"], "step_acc": m["step_acc"],
                    "exact_f1": m["exact_f1"], "agent_acc": m["agent_acc"]})
    return out


def pick_threshold(sweep: Sequence[dict] | None, max_far: float = DEPLOYABLE_MAX_FAR) -> dict | None:
    """The one rule for choosing an ALARM threshold on a tune split's sweep: the highest Exact-F1
    among the thresholds whose FAR is within `max_far` (all thresholds when none is); ties: lower
    FAR, then the higher threshold. None without a sweep row that has an Exact-F1."""
    rows = [r for r in (sweep or []) if r["exact_f1"] is not None]
    bounded = [r for r in rows if r["far"] is None or r["far"] <= max_far]
    rows = bounded or rows
    return max(rows, key=lambda r: (r["exact_f1"], -(r["far"] or 0.0), r["threshold"])) if rows else None


# --------------------------------------------------------------------------- grouped report

def grouped(preds: Sequence[dict], *, n_boot: int = 1000, seed: int = 0,
            prices: dict | None = None) -> dict:
    """`overall`, `by_subset`, `by_domain` (the layout of metrics.json)."""
    def groups(key: str) -> dict:
        keys = sorted({str(p.get(key)) for p in preds})
        return {k: summarize([p for p in preds if str(p.get(key)) == k], n_boot=n_boot,
                             seed=seed, prices=prices) for k in keys}

    return {"overall": summarize(preds, n_boot=n_boot, seed=seed, prices=prices),
            "by_subset": groups("subset"), "by_domain": groups("domain")}


def _main(argv: list[str]) -> int:
    import json

    if len(argv) != 1:
        print("usage: python -m eval.metrics predictions.jsonl", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        preds = [json.loads(line) for line in f if line.strip()]
    g = grouped(preds)
    print(json.dumps({"metrics_version": METRICS_VERSION, **g}, indent=2,
                     default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
