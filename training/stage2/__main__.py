"""`python -m training.stage2 --engine trl --config configs/stage2/tiny-cpu.yaml` (= aftraj train stage2)."""

from training.stage2.cli import main

raise SystemExit(main())
