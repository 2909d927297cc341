"""Evaluation of online auditors (DESIGN §6): the strict online walk, auditors behind one
interface, versioned metrics with bootstrap intervals, and reports.

- `eval.auditors`: the `Auditor` interface and registry; `dummy`, `heuristic:<rule>`, `hf`,
  `openai[:method]`, `rules` (one module each, discovered automatically).
- `eval.walker`: strict / reference protocols; online, post-hoc and bisect query plans.
- `eval.metrics`: every metric (METRICS_VERSION), bootstrap CIs, stratified AUC, threshold sweep.
- `eval.confidence`: P(UNSAFE) from verdict-token log-probabilities.
- `eval.report`: metrics.json, predictions.jsonl, report.md and the PNG plots.

    aftraj eval --auditor heuristic:uniform-random --data who_and_when --out runs/ww-random
"""
