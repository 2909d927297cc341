"""Stage 2 (DESIGN §5): GRPO under the what/where/who reward (`training.reward`), from a stage-1
checkpoint (policy and KL reference). Two engines read one config (`configs/stage2/*.yaml`):
TRL's GRPOTrainer on one machine or a CPU (`training.stage2.trl_engine`), and verl on GPU
nodes (`training/verl/`, `training.stage2.verl_engine`).

    aftraj train stage2 --engine trl --config configs/stage2/tiny-cpu.yaml --out runs/stage2-tiny
    aftraj train stage2 --engine verl --config configs/stage2/qwen2.5-7b-8xh200.yaml --dry-run
"""
