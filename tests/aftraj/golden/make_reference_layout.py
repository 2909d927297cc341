"""Make the golden files of the reference layout with the RELEASE's own code (not ours):
github.com/ZBox1005/AgentForesight inference/prompts.py `build_messages`, imported from a
checkout of that repository, applied to turns built from the raw data files.

    python tests/aftraj/golden/make_reference_layout.py --release /path/to/AgentForesight
    # needs the release checkout at commit a3f61fbd34d6e090ed7ccc13d97cd0aa1ce2a2e1

Turns: one per Who&When history entry, {"role": the entry's agent as aftraj.readers names it
(Hand-Crafted roles without their "(thought)"/"(-> X)" suffix, Algorithm-Generated `name`),
"content": the entry's content}; for the AFTraj row, its own turns and tools.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
COMMIT = "a3f61fbd34d6e090ed7ccc13d97cd0aa1ce2a2e1"

# an AFTraj-2K-style row: user turn over 500 characters, tools, thought, action, long content
AFTRAJ_ROW = {
    "conv_id": "golden_math_1", "domain": "math", "gold_answer": "42", "num_turns": 4,
    "task": "Compute six times seven.",
    "turns": [
        {"role": "user", "thought": None, "action": None,
         "content": "Compute six times seven, then explain the steps. " * 12},
        {"role": "MathSolver", "thought": "I will run the product in Python.",
         "action": json.dumps([{"name": "python", "arguments": json.dumps({"code": "print(6*7)"})}]),
         "content": "Running the computation."},
        {"role": "environment", "thought": None, "action": None, "content": "42\n" + "log line\n" * 400},
        {"role": "Verifier", "thought": "", "action": None, "content": "The product is 42."}],
    "tools": [{"name": "python", "description": "run Python code"}, {"name": "calculator", "description": None}],
    "mistake_step": -1, "mistake_agent": None, "mistake_reason": None, "unsafe_source": None,
}
CASES = [("ww-hand-crafted-1-t4", "Hand-Crafted", "1.json", 4),
         ("ww-algorithm-generated-100-t4", "Algorithm-Generated", "100.json", 4),
         ("aftraj-row-t3", None, None, 3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", required=True, type=Path, help="checkout of ZBox1005/AgentForesight")
    args = ap.parse_args()
    head = subprocess.run(["git", "-C", str(args.release), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or f"{COMMIT} (git archive, no .git)"
    spec = importlib.util.spec_from_file_location("release_prompts", args.release / "inference" / "prompts.py")
    rel = importlib.util.module_from_spec(spec)
    sys.modules["release_prompts"] = rel   # dataclasses look their module up
    spec.loader.exec_module(rel)
    sys.path.insert(0, str(REPO))
    from aftraj.readers import normalise_agent

    for name, subset, fname, t in CASES:
        if subset is None:
            turns, tools, source = AFTRAJ_ROW["turns"], AFTRAJ_ROW["tools"], {"aftraj_row": AFTRAJ_ROW}
        else:
            raw = json.loads((REPO / "eval" / "data" / "who_and_when" / subset / fname).read_text())
            turns = [{"role": normalise_agent(h["role"]) if subset == "Hand-Crafted" else h.get("name") or h["role"],
                      "content": h["content"]} for h in raw["history"]]
            tools, source = None, {"who_and_when": f"{subset}/{fname}"}
        msgs = rel.build_messages(turns, tools=tools, current_step=t)
        out = {"made_by": f"tests/aftraj/golden/make_reference_layout.py: inference/prompts.py "
                          f"build_messages(turns, tools, current_step={t}) of github.com/ZBox1005/"
                          f"AgentForesight@{head}",
               **source, "t": t, "messages": msgs}
        (HERE / "reference_layout" / f"{name}.json").write_text(
            json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(name)


if __name__ == "__main__":
    main()
