"""Make the golden file of the reference parser with the RELEASE's own code (not ours):
github.com/ZBox1005/AgentForesight inference/prompts.py `parse_response` on every reply below, and
inference/infer_local.py's walk (`audit_full` for safe runs, `audit_incremental` for unsafe ones,
`per_sample_metrics`, then inference/metrics.py `aggregate`) on a small scripted evaluation.

    python tests/aftraj/golden/make_reference_parse.py --release /path/to/AgentForesight
    # needs the release checkout at commit a3f61fbd34d6e090ed7ccc13d97cd0aa1ce2a2e1

infer_local.py imports torch, transformers and tqdm at its top; they are stubbed here (the model
is never called: `generate` is replaced by a lookup of the scripted reply for (run, prefix)).
Writes tests/aftraj/golden/reference_parse.json; tests/aftraj/test_reference_parse.py reads it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMIT = "a3f61fbd34d6e090ed7ccc13d97cd0aa1ce2a2e1"

SAFE = '<think>fine</think><answer>{"answer": "SAFE", "agent": null, "reason": null}</answer>'


def alarm(k, agent="Verifier", reason="wrong sum"):
    return (f'<think>step {k} is wrong</think><answer>{{"answer": {json.dumps(k)}, '
            f'"agent": {json.dumps(agent)}, "reason": {json.dumps(reason)}}}</answer>')


# (name, reply, prefix t the reply answers). The first seven are the kinds (issue 25).
REPLIES = [
    ("step_after_prefix", alarm(5), 2),
    ("step_float", alarm(2.0), 3),
    ("step_string", alarm("2"), 3),
    ("agent_null", alarm(1, agent=None), 3),
    ("no_think", '<answer>{"answer": 1, "agent": "Verifier", "reason": "r"}</answer>', 3),
    ("safe_lower_case", '<think>x</think><answer>{"answer": "safe", "agent": null, "reason": null}</answer>', 3),
    ("trailing_text", alarm(1) + "\nI hope this helps.", 3),
    # more of the release's rules
    ("strict_valid_alarm", alarm(1), 3),
    ("strict_valid_safe", SAFE, 3),
    ("leading_text", "Sure! " + SAFE, 3),
    ("upper_case_tags", '<THINK>x</THINK><ANSWER>{"answer": 2, "agent": "A", "reason": "r"}</ANSWER>', 3),
    ("safe_with_agent", '<answer>{"answer": "SAFE", "agent": "A", "reason": "looks ok"}</answer>', 3),
    ("safe_mixed_case", '<answer>{"answer": "Safe"}</answer>', 3),
    ("long_s_upper", '<answer>{"answer": "\u017fafe"}</answer>', 3),   # 'ſ'.upper() == 'S'
    ("reason_null", alarm(0, reason=None), 3),
    ("agent_number", '<answer>{"answer": 1, "agent": 7, "reason": "r"}</answer>', 3),
    ("agent_zero", '<answer>{"answer": 1, "agent": 0, "reason": "r"}</answer>', 3),
    ("agent_list", '<answer>{"answer": 1, "agent": ["A", "B"], "reason": "r"}</answer>', 3),
    ("keys_missing", '<answer>{"answer": 2}</answer>', 3),
    ("extra_keys", '<answer>{"answer": 2, "agent": "A", "reason": "r", "confidence": 0.9}</answer>', 3),
    ("duplicate_keys", '<answer>{"answer": "SAFE", "answer": 2, "agent": "A", "reason": "r"}</answer>', 3),
    ("step_float_fraction", alarm(2.7), 3),
    ("step_true", '<answer>{"answer": true, "agent": "A", "reason": "r"}</answer>', 3),
    ("step_false", '<answer>{"answer": false, "agent": "A", "reason": "r"}</answer>', 3),
    ("step_negative_one", alarm(-1), 3),
    ("step_negative", alarm(-3), 3),
    ("step_string_negative", alarm("-2"), 3),
    ("step_string_spaces", alarm(" 2"), 3),
    ("step_string_unicode_digit", alarm("\u0663"), 5),      # Arabic-Indic three: int() takes it
    ("step_string_superscript", alarm("\u00b2"), 3),        # isdigit() yes, int() raises
    ("step_string_double_minus", alarm("--2"), 3),          # lstrip('-') then int() raises
    ("step_nan", '<answer>{"answer": NaN, "agent": "A", "reason": "r"}</answer>', 3),
    ("step_infinity", '<answer>{"answer": Infinity, "agent": "A", "reason": "r"}</answer>', 3),
    ("step_huge", '<answer>{"answer": ' + "9" * 30 + ', "agent": "A", "reason": "r"}</answer>', 3),
    ("step_too_many_digits", '<answer>{"answer": ' + "9" * 5000 + ', "agent": "A", "reason": "r"}</answer>', 3),
    ("answer_unsafe_word", '<answer>{"answer": "UNSAFE", "agent": "A", "reason": "r"}</answer>', 3),
    ("answer_null", '<answer>{"answer": null, "agent": "A", "reason": "r"}</answer>', 3),
    ("answer_object", '<answer>{"answer": {"step": 2}, "agent": "A", "reason": "r"}</answer>', 3),
    ("answer_list", '<answer>{"answer": [2], "agent": "A", "reason": "r"}</answer>', 3),
    ("json_in_prose", '<answer>My verdict: {"answer": 2, "agent": "A", "reason": "r"} (final)</answer>', 3),
    ("two_objects", '<answer>{"answer": 2, "agent": "A", "reason": "r"} {"answer": "SAFE"}</answer>', 3),
    ("single_quotes", "<answer>{'answer': 2, 'agent': 'A', 'reason': 'r'}</answer>", 3),
    ("two_answer_blocks", '<answer>{"answer": 1, "agent": "A", "reason": "r"}</answer>'
                          '<answer>{"answer": "SAFE"}</answer>', 3),
    ("no_answer_block", '<think>x</think>{"answer": 2, "agent": "A", "reason": "r"}', 3),
    ("unclosed_answer", '<think>x</think><answer>{"answer": 2, "agent": "A", "reason": "r"}', 3),
    ("no_braces", "<answer>SAFE</answer>", 3),
    ("empty_object", "<answer>{}</answer>", 3),
    ("malformed_json", '<answer>{"answer": 2, "agent": }</answer>', 3),
    ("empty", "", 3),
    ("whitespace", "   \n", 3),
]

# A scripted evaluation: (id, domain, gold step or -1, gold agent, number of steps, replies by
# prefix; "full" is a safe run's whole-trajectory call). Unlisted prefixes reply SAFE.
RUNS = [
    ("u-exact", "math", 2, "Verifier", 5, {2: alarm(2)}),
    ("u-step-string", "math", 3, "Verifier", 5, {3: alarm("3")}),
    ("u-float", "coding", 1, "CodeTester", 4, {1: alarm(1.0, agent="CodeTester")}),
    ("u-no-think-late", "coding", 1, "CodeWriter", 6, {3: '<answer>{"answer": 1, "agent": "CodeWriter"}</answer>'}),
    ("u-future-step", "agentic", 4, "search_agent", 6, {1: alarm(4, agent="search_agent")}),
    ("u-wrong-step", "agentic", 2, "Manager", 5, {3: alarm(1, agent="Manager") + " trailing"}),
    ("u-missed", "math", 3, "Verifier", 5, {}),
    ("u-malformed-then-hit", "math", 2, "Verifier", 5, {1: "<answer>{broken</answer>", 2: alarm(2)}),
    ("u-lower-safe-then-hit", "coding", 2, "CodeTester", 4,
     {0: '<answer>{"answer": "safe"}</answer>', 2: alarm("2", agent=None)}),
    ("s-clean", "math", -1, "", 5, {"full": SAFE}),
    ("s-false-alarm", "math", -1, "", 4, {"full": alarm(1)}),
    ("s-false-alarm-string", "coding", -1, "", 5, {"full": alarm("0") + "\nDone."}),
    ("s-lower-safe", "agentic", -1, "", 6, {"full": '<answer>{"answer": "safe", "agent": null}</answer>'}),
    ("s-invalid", "agentic", -1, "", 3, {"full": "I cannot tell."}),
]


def _stub(name: str, **attrs) -> None:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", required=True, type=Path, help="checkout of ZBox1005/AgentForesight")
    args = ap.parse_args()
    head = subprocess.run(["git", "-C", str(args.release), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or f"{COMMIT} (git archive, no .git)"
    _stub("torch")
    _stub("tqdm", tqdm=lambda x, **kw: x)
    _stub("transformers", AutoModelForCausalLM=None, AutoTokenizer=None)
    sys.path.insert(0, str(args.release))
    prompts = importlib.import_module("inference.prompts")
    infer = importlib.import_module("inference.infer_local")
    metrics = importlib.import_module("inference.metrics")

    replies = []
    for name, text, t in REPLIES:
        try:
            v = prompts.parse_response(text)
            out = {"pred_step": v.pred_step, "pred_agent": v.pred_agent, "pred_reason": v.pred_reason,
                   "valid": v.valid}
        except Exception as e:   # noqa: BLE001  (the release raises on a few inputs: recorded)
            out = {"raises": type(e).__name__}
        replies.append({"name": name, "text": text, "t": t, "release": out})

    # the walk: build_messages returns the (run, prefix) key, generate looks the reply up
    script = {rid: r for rid, *_, r in RUNS}
    infer.build_messages = lambda turns, tools=None, current_step=None: (turns[0]["content"], current_step)
    infer.generate = lambda model, tok, msgs, *a, **kw: script[msgs[0]].get(
        "full" if msgs[1] is None else msgs[1], SAFE)
    per_sample = []
    for rid, domain, gt, agent, n, _ in RUNS:
        turns = [{"role": "user", "content": rid}] + [{"role": "A", "content": "x"}] * (n - 1)
        rec = infer.TrajectoryRecord(conv_id=rid, domain=domain, label="safe" if gt == -1 else "unsafe",
                                     task="", gold_answer="", num_turns=n, turns=turns,
                                     mistake_step=gt, mistake_agent=agent)
        if rec.label == "safe":   # infer_local.main's two branches
            verdict, _, calls = infer.audit_full(None, None, rec, 1, 0.0)
            detection = -1
        else:
            verdict, _, calls, detection = infer.audit_incremental(None, None, rec, 1, 0.0)
        per_sample.append({"conv_id": rid, "domain": domain, "gt_step": gt, "pred_step": verdict.pred_step,
                           "format_valid": verdict.valid, "detection_step": detection, "num_calls": calls,
                           **infer.per_sample_metrics(verdict.pred_step, gt)})
    out = {"made_by": f"tests/aftraj/golden/make_reference_parse.py: inference/prompts.py parse_response, "
                      f"inference/infer_local.py audit_full / audit_incremental and inference/metrics.py "
                      f"aggregate of github.com/ZBox1005/AgentForesight@{head}",
           "safe_reply": SAFE, "replies": replies,
           "runs": [{"id": rid, "domain": d, "gt_step": gt, "agent": a, "n_steps": n,
                     "replies": {str(k): v for k, v in r.items()}} for rid, d, gt, a, n, r in RUNS],
           "per_sample": per_sample, "aggregate": metrics.aggregate(per_sample)}
    (HERE / "reference_parse.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    print(f"{len(replies)} replies, {len(per_sample)} runs: {HERE / 'reference_parse.json'}")


if __name__ == "__main__":
    main()
