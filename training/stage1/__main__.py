"""`python -m training.stage1 --config configs/stage1/tiny-cpu.yaml` (see training.stage1.cli)."""

import sys

from training.stage1.cli import main

sys.exit(main())
