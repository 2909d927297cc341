"""Stage 1: boundary-pair preference optimisation (BPPO, DESIGN §5).

config.py (typed YAML config) · pairs.py (boundary prompts) · preferences.py (base-policy
samples → chosen/rejected) · data.py (tokenising, batch schedule, collator) · loss.py (the BPPO
loss) · trainer.py (the accelerate loop, checkpoints, resume) · cli.py (command line).

    aftraj train stage1 --config configs/stage1/tiny-cpu.yaml
    python -m training.stage1 --config configs/stage1/tiny-cpu.yaml --out runs/stage1-tiny
"""
