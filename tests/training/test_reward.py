"""Stage-2 reward (training/reward.py): a table of completions with hand-computed scores, the
weights and σ taken from the config, and DAPO's overlong formula on both sides of its buffer."""

from __future__ import annotations

import math

import pytest

from aftraj.verdict import Verdict
from training.reward import RewardConfig, compute_score, ground_truth_of, overlong_penalty

AGENTS = ["user", "Planner", "Coder", "Tester"]   # steps 0..3 of the visible prefix
INFO = {"t": 3, "agents": AGENTS}
UNSAFE_GT = ground_truth_of(Verdict("UNSAFE", step=2, agent="Coder"))
SAFE_GT = ground_truth_of(Verdict("SAFE"))


def ans(answer, agent, reason):
    return f'<think>steps 0..3</think><answer>{{"answer": {answer}, "agent": {agent}, "reason": {reason}}}</answer>'


SAFE = ans('"SAFE"', "null", "null")
E = math.exp(-1 / 2)      # where, off by one step, σ = 1
E9 = math.exp(-9 / 2)     # off by three
W_F, W_WHAT, W_WHERE, W_WHO, MIN = 0.5, 1.0, 1.0, 1.0, -1.0
FULL = W_F + W_WHAT + W_WHERE + W_WHO

# name, completion, ground truth, (score, format, what, where, who)
TABLE = [
    ("SAFE right", SAFE, SAFE_GT, (FULL, 1, 1, 1, 1)),
    ("SAFE wrong (missed alarm)", SAFE, UNSAFE_GT, (W_F, 1, 0, 0, 0)),
    ("false alarm on a SAFE prefix", ans(2, '"Coder"', '"r"'), SAFE_GT, (W_F, 1, 0, 0, 0)),
    ("UNSAFE exact", ans(2, '"Coder"', '"r"'), UNSAFE_GT, (FULL, 1, 1, 1, 1)),
    ("UNSAFE agent case-folded", ans(2, '" coder "', '"r"'), UNSAFE_GT, (FULL, 1, 1, 1, 1)),
    ("UNSAFE off by 1 (later, same agent)", ans(3, '"Coder"', '"r"'), UNSAFE_GT,
     (W_F + W_WHAT + E + W_WHO, 1, 1, E, 1)),
    ("UNSAFE off by 1 (earlier), wrong agent", ans(1, '"Planner"', '"r"'), UNSAFE_GT,
     (W_F + W_WHAT + E, 1, 1, E, 0)),
    ("UNSAFE off by 3, wrong agent", ans(0, '"Coder"', '"r"'), ground_truth_of(Verdict("UNSAFE", 3, "Tester")),
     (W_F + W_WHAT + E9, 1, 1, E9, 0)),
    ("UNSAFE wrong agent", ans(2, '"Tester"', '"r"'), UNSAFE_GT, (W_F + W_WHAT + W_WHERE, 1, 1, 1, 0)),
    ("agent absent from the prefix", ans(2, '"Verifier"', '"r"'), UNSAFE_GT, (MIN, 0, 0, 0, 0)),
    ("k > t", ans(4, '"Coder"', '"r"'), UNSAFE_GT, (MIN, 0, 0, 0, 0)),
    ("malformed JSON", ans(2, '"Coder"', "") , UNSAFE_GT, (MIN, 0, 0, 0, 0)),
    ("missing think block", SAFE[SAFE.index("<answer>"):], SAFE_GT, (MIN, 0, 0, 0, 0)),
    ("missing answer block", "<think>all fine</think>", SAFE_GT, (MIN, 0, 0, 0, 0)),
    ("two answer blocks", SAFE + SAFE[SAFE.index("<answer>"):], SAFE_GT, (MIN, 0, 0, 0, 0)),
    ("extra text after the blocks", SAFE + " Hope this helps!", SAFE_GT, (MIN, 0, 0, 0, 0)),
    ("duplicate keys", SAFE.replace('"reason": null', '"reason": null, "answer": 2'), SAFE_GT,
     (MIN, 0, 0, 0, 0)),
    ("stray </think>", SAFE.replace("</think>", "</think>x</think>"), SAFE_GT, (MIN, 0, 0, 0, 0)),
    ("empty completion", "", SAFE_GT, (MIN, 0, 0, 0, 0)),
    ("SAFE with an agent", ans('"SAFE"', '"Coder"', "null"), SAFE_GT, (MIN, 0, 0, 0, 0)),
]


@pytest.mark.parametrize("name,text,gt,expected", TABLE, ids=[r[0] for r in TABLE])
def test_reward_table(name, text, gt, expected):
    r = compute_score("aftraj", text, gt, INFO)
    got = (r["score"], r["format"], r["what"], r["where"], r["who"])
    assert got == pytest.approx(expected), (name, r)


def test_table_is_large_and_malformed_is_the_minimum():
    assert len(TABLE) >= 15
    scores = [compute_score("aftraj", text, gt, INFO)["score"] for _, text, gt, _ in TABLE]
    well_formed = [s for s, row in zip(scores, TABLE, strict=True) if row[3][1] == 1]
    assert min(scores) == MIN < min(well_formed)


def test_weights_and_sigma_come_from_the_config():
    cfg = RewardConfig(w_format=0.1, w_what=2.0, w_where=3.0, w_who=0.25, sigma=2.0, malformed_score=-5.0)
    r = compute_score("aftraj", ans(3, '"Coder"', '"r"'), UNSAFE_GT, INFO, **cfg.score_kwargs())
    assert r["where"] == pytest.approx(math.exp(-1 / 8))
    assert r["score"] == pytest.approx(0.1 + 2.0 + 3.0 * math.exp(-1 / 8) + 0.25)
    assert compute_score("aftraj", "junk", UNSAFE_GT, INFO, **cfg.score_kwargs())["score"] == -5.0


@pytest.mark.parametrize("bad", [{"sigma": 0}, {"w_what": -1}, {"malformed_score": 0.0},
                                 {"overlong_buffer_len": -1}])
def test_reward_config_refuses(bad):
    with pytest.raises(ValueError):
        RewardConfig(**bad)


def test_bad_ground_truth_or_extra_info_is_an_error_not_a_score():
    with pytest.raises(ValueError, match="extra_info"):
        compute_score("aftraj", SAFE, SAFE_GT, {"t": 3})
    with pytest.raises(ValueError, match="ground_truth"):
        compute_score("aftraj", SAFE, '{"answer": -1, "agent": "A"}', INFO)
    assert compute_score("aftraj", SAFE, {"answer": "SAFE", "agent": None}, INFO)["what"] == 1.0


@pytest.mark.parametrize("n,expected", [
    (0, 0.0), (3072, 0.0),            # up to max_resp_len - buffer: no penalty
    (3073, -1 / 1024), (3584, -0.5),  # inside the buffer: linear
    (4096, -1.0),                      # at max_resp_len: the full factor
])
def test_overlong_penalty_is_dapos_formula(n, expected):
    assert overlong_penalty(n, 4096, 1024, 1.0) == pytest.approx(expected)


def test_overlong_penalty_disabled_and_refused():
    assert overlong_penalty(10_000, 4096, 0, 1.0) == 0.0
    assert overlong_penalty(4096, 4096, 1024, 0.5) == pytest.approx(-0.5)
    with pytest.raises(ValueError):
        overlong_penalty(10, 100, 200, 1.0)


# --------------------------------------------------------------------------- the overlong penalty on top
LIMIT, BUF = 4096, 1024   # max_resp_len and DAPO buffer: at LIMIT tokens the full factor is paid
PEN = -1.0                # overlong_penalty(LIMIT, LIMIT, BUF, 1.0)

# name, completion, ground truth, tokens, total (score + overlong penalty)
PENALIZED = [
    ("malformed, short", "junk", UNSAFE_GT, 10, MIN),
    ("malformed at the length limit", "junk", UNSAFE_GT, LIMIT, MIN + PEN),
    ("malformed half into the buffer", "<think>x</think>", SAFE_GT, LIMIT - BUF // 2, MIN + PEN / 2),
    ("wrong decision at the length limit", SAFE, UNSAFE_GT, LIMIT, W_F + PEN),
    ("UNSAFE exact at the length limit", ans(2, '"Coder"', '"r"'), UNSAFE_GT, LIMIT, FULL + PEN),
    ("SAFE right, short", SAFE, SAFE_GT, 10, FULL),
]


@pytest.mark.parametrize("name,text,gt,n,expected", PENALIZED, ids=[r[0] for r in PENALIZED])
def test_reward_with_overlong_penalty_table(name, text, gt, n, expected):
    total = compute_score("aftraj", text, gt, INFO)["score"] + overlong_penalty(n, LIMIT, BUF, 1.0)
    assert total == pytest.approx(expected), name


def test_malformed_at_the_length_limit_is_the_minimum_and_below_every_well_formed_answer():
    totals = {name: compute_score("aftraj", text, gt, INFO)["score"] + overlong_penalty(n, LIMIT, BUF, 1.0)
              for name, text, gt, n, _ in PENALIZED}
    assert min(totals.values()) == totals["malformed at the length limit"]
    worst_well_formed_at_limit = min(compute_score("aftraj", text, gt, INFO)["score"] for _, text, gt, e in TABLE
                                     if e[1] == 1) + PEN
    assert worst_well_formed_at_limit > MIN                      # above even a short malformed answer


def test_overlong_penalty_factor_is_bounded_by_format_minus_malformed():
    # w_format - malformed_score = 0.5 + 1 = 1.5: a wrong but well-formed answer at the limit scores
    # 0.5 - factor, which must stay above -1
    ok = RewardConfig(overlong_penalty_factor=1.49)
    assert ok.w_format - ok.overlong_penalty_factor > ok.malformed_score
    for bad in (1.5, 2.0):
        with pytest.raises(ValueError, match="overlong_penalty_factor"):
            RewardConfig(overlong_penalty_factor=bad)
    RewardConfig(overlong_penalty_factor=2.9, malformed_score=-2.5)   # the bound follows the config


@pytest.mark.parametrize("credit", [0.0, 0.5, 1.0])
def test_safe_where_who_credit_is_a_config_value(credit):
    kw = RewardConfig(safe_where_who_credit=credit).score_kwargs()
    r = compute_score("aftraj", SAFE, SAFE_GT, INFO, **kw)
    assert (r["where"], r["who"]) == (credit, credit)
    assert r["score"] == pytest.approx(W_F + W_WHAT + (W_WHERE + W_WHO) * credit)
    # UNSAFE answers and wrong SAFE answers are untouched by it
    assert compute_score("aftraj", ans(2, '"Coder"', '"r"'), UNSAFE_GT, INFO, **kw)["score"] == pytest.approx(FULL)
    assert compute_score("aftraj", SAFE, UNSAFE_GT, INFO, **kw)["score"] == pytest.approx(W_F)


@pytest.mark.parametrize("bad", [-0.01, 1.01])
def test_safe_where_who_credit_is_bounded(bad):
    with pytest.raises(ValueError, match="safe_where_who_credit"):
        RewardConfig(safe_where_who_credit=bad)


def test_stage2_config_carries_the_credit_to_both_engines():
    from training.stage2.config import ConfigError, load_stage2_config
    from training.stage2.verl_engine import verl_overrides

    cfg = load_stage2_config("configs/stage2/tiny-cpu.yaml", {"safe_where_who_credit": 0.25})
    assert cfg.reward.score_kwargs()["safe_where_who_credit"] == 0.25
    overrides = verl_overrides(cfg, "m", "d", "o")
    assert "reward.custom_reward_function.reward_kwargs.safe_where_who_credit=0.25" in overrides
    with pytest.raises(ConfigError, match="safe_where_who_credit"):
        load_stage2_config("configs/stage2/tiny-cpu.yaml", {"safe_where_who_credit": 2.0})
    with pytest.raises(ConfigError, match="overlong_penalty_factor"):
        load_stage2_config("configs/stage2/tiny-cpu.yaml", {"overlong_penalty_factor": 1.5})
