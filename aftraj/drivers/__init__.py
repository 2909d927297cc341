"""Drivers: programs that run the project's layers end to end, so they sit at the top beside
`aftraj.commands` (tests/test_layering.py): the ablation (`aftraj ablation`, `ablation.py`) and
the checks behind the paper sequence (`reproduce.py`, scripts/reproduce_paper.sh). They may
import every package (aftraj, training, eval, serve); nothing below imports them.
"""
