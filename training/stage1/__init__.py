"""Stage 1: boundary-pair preference optimisation (BPPO, DESIGN §5).

config.py (typed YAML config) · preferences.py (phase 1: the boundary prompts of
`aftraj.boundary`, base-policy samples → chosen/rejected, the cache) · run_folder.py (what the
run folder holds) · data.py (tokenising, batch schedule, collator) · loss.py (the BPPO loss) ·
trainer.py (phase 2: the accelerate loop, checkpoints, resume) · cli.py (command line). What
every stage shares (trajectories, model loading, LoRA, accelerate, export) is training/common.py.

    aftraj train stage1 --config configs/stage1/tiny-cpu.yaml
    python -m training.stage1 --config configs/stage1/tiny-cpu.yaml --out runs/stage1-tiny
"""
