"""Evaluation of online auditors (DESIGN §6): the strict online walk, auditors behind one
interface, versioned metrics with bootstrap intervals, and reports.

- `eval.auditors`: the `Auditor` interface and registry; `dummy`, `heuristic:<rule>`, `hf`,
  `openai[:method]`, `rules` (one module each, discovered automatically).
- `eval.walker`: strict / reference protocols; online, post-hoc and bisect query plans.
- `eval.metrics`: every metric (METRICS_VERSION), bootstrap CIs, stratified AUC, threshold sweep.
- `eval.report`: metrics.json, predictions.jsonl, report.md and the PNG plots.
- `eval.run`: `evaluate(EvalConfig) -> EvalResult`, the one evaluation (the command, the ablation
  and the paper sequence call it).

P(UNSAFE) from verdict-token log-probabilities is `aftraj.confidence` (with the verdict, in the core:
the gateway uses it too). This package builds on the core only, never on `training` or `serve`.

    aftraj eval --auditor heuristic:uniform-random --data who_and_when --out runs/ww-random
"""
