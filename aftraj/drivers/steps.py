"""`aftraj train steps`: step-scored decision training (training/steps), then the walk's threshold
chosen on the held-out rows and stored in RUN/final/ (eval/step_calibration.py). A driver because
it joins two packages (training, eval) that may not import each other.

    aftraj train steps --config configs/steps/smollm2-135m-cpu.yaml --data CORPUS --out RUN
    aftraj eval --auditor hf-steps --model RUN/final --data CORPUS/test.jsonl --out RUN/eval-test
"""

from __future__ import annotations

import json

from training.steps.cli import add_arguments  # noqa: F401  (the train command reads it from here)


def run(args) -> int:
    from training.steps.cli import summary, train_from_args

    import os

    cfg, res = train_from_args(args)
    if res is None or os.environ.get("RANK", "0") != "0":      # under accelerate launch: the main process reports
        return 0
    out = summary(res)
    if res.final_dir is not None and cfg.heldout_split and (res.output_dir / "heldout_steps.jsonl").is_file():
        from eval.step_calibration import calibrate

        out["calibration"] = calibrate(res.output_dir)
    print(json.dumps(out))
    return 0
