"""`aftraj train steps`: step-scored decision training (training/steps), then the walk's threshold
chosen on the held-out rows and stored in RUN/final/ (eval/step_calibration.py). A driver because
it joins two packages (training, eval) that may not import each other.

    aftraj train steps --config configs/steps/smollm2-135m-cpu.yaml --data CORPUS --out RUN
    aftraj eval --auditor hf-steps --model RUN/final --data CORPUS/test.jsonl --out RUN/eval-test
"""

from __future__ import annotations

import json


def run(args) -> int:
    """The command's arguments are `training.steps.cli.add_arguments`'s."""
    import os

    from training.steps.cli import summary, train_from_args

    cfg, res = train_from_args(args)
    if res is None or os.environ.get("RANK", "0") != "0":      # under accelerate launch: the main process reports
        return 0
    out = summary(res)
    if res.final_dir is not None and cfg.heldout_split and (res.output_dir / "heldout_steps.jsonl").is_file():
        from eval.step_calibration import calibrate

        out["calibration"] = calibrate(res.output_dir)
    print(json.dumps(out))
    return 0
