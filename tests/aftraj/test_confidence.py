"""P(UNSAFE) from verdict-token log-probabilities (aftraj/confidence.py)."""

from __future__ import annotations

import math

import pytest

from aftraj.confidence import p_unsafe, p_unsafe_at, verdict_position


def test_verdict_position_and_mass():
    pieces = ["<think>", "ok", "</think>", "<answer>", "{", '"answer"', ":", " ", '"SAFE', '"}']
    assert verdict_position(pieces) == 8           # the whitespace-only token is skipped
    tops = [{}] * 8 + [{'"SAFE': math.log(0.6), "3": math.log(0.2), '"': math.log(0.1), "x": 0.0}, {}]
    assert p_unsafe(pieces, tops) == pytest.approx(0.2 / 0.9)


def test_no_verdict_or_no_alternatives():
    assert p_unsafe(["hello", "world"], [{}, {}]) is None
    assert p_unsafe_at({"foo": -0.1}) is None
    assert p_unsafe_at([(" 12", -0.1)]) == 1.0
    assert p_unsafe_at({'"': float("-inf"), "4": -1.0}) == 1.0
