"""Format warm-up (NOT part of the paper's recipe; DESIGN §5, issue 11): a few supervised steps on
content-independent verdicts, so a small base model learns the output format without the boundary.

    aftraj train warmup --config configs/warmup/smollm2-135m-cpu.yaml --data CORPUS --out RUN
"""
