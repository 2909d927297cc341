"""Step-scored decision training (NOT in the paper; issue 44): the step-tagged reading of a run
(`aftraj.prompt.StepReading`: the normal prompt's blocks with a tag after every step) trained by
cross-entropy on the decision token at every step's tag, one forward a run, on every train run.
The `hf-steps` auditor (eval/auditors/hf_steps.py) reads the same tags one step at a time.

    aftraj train steps --config configs/steps/smollm2-135m-cpu.yaml --data CORPUS --out RUN
"""
