"""The stage-2 reward (DESIGN §5): a pure function scoring one completion on three axes.

`compute_score(data_source, solution_str, ground_truth, extra_info)` is verl's custom reward
function signature (`reward.custom_reward_function.path/name`), and the TRL path calls the same
function. It returns a dict: `score` and its components

- `format` (0/1): both blocks, valid JSON, the strict parser of `aftraj.verdict` accepts it, and
  it is grounded: an UNSAFE step is <= t and its agent appears in the visible prefix (steps 0..t);
- `what`   (0/1): SAFE/UNSAFE right;
- `where`  in [0, 1]: exp(-(k - k*)^2 / 2σ^2) for an UNSAFE verdict on an UNSAFE prefix;
- `who`    (0/1): the agent right (trimmed, case-folded: `aftraj.verdict.agent_match`).

score = w_format·format + w_what·what + w_where·where + w_who·who. A right SAFE verdict has
nothing to localise; DESIGN §5 leaves its where/who credit open, so it is a config value,
`safe_where_who_credit` in [0, 1] (where = who = that value). The default, 1, keeps a perfect SAFE
and a perfect UNSAFE answer worth the same; it also makes always-SAFE the better bet when the
policy is unsure of k* and a* (e.g. at P(unsafe) = 0.6, SAFE expects 0.4·3.5 + 0.6·0.5 = 1.70,
an UNSAFE off by one step with the wrong agent 0.4·0.5 + 0.6·(1.5 + e^-½) = 1.46); a lower
credit removes that pull towards SAFE. A wrong decision gets what = where = who = 0. A malformed
or ungrounded completion gets `malformed_score` (< 0, below every well-formed score) and all
components 0. Weights, σ and the credit come from the stage-2 config (`RewardConfig`); verl
passes them as `custom_reward_function.reward_kwargs`.

The overlong penalty is DAPO's soft buffer, applied outside this function, by verl's `dapo`
reward manager on verl and by `overlong_penalty()` (the same formula) in the TRL path. It costs
at most `overlong_penalty_factor`, which the config bounds below w_format - malformed_score, so a
well-formed answer at the length limit still scores above a malformed one.

`ground_truth` is the gold verdict's answer JSON (`{"answer": "SAFE" | k*, "agent": null | a*}`,
a string so parquet holds one type); `extra_info` holds `t` and `agents` (steps 0..t's agents).

>>> gt = '{"answer": 2, "agent": "Coder"}'
>>> info = {"t": 3, "agents": ["user", "Planner", "Coder"]}
>>> ok = '<think>x</think><answer>{"answer": 2, "agent": "Coder", "reason": "bug"}</answer>'
>>> compute_score("aftraj", ok, gt, info)["score"]
3.5
>>> off = ok.replace('"answer": 2', '"answer": 3')
>>> round(compute_score("aftraj", off, gt, info)["where"], 4)    # exp(-1/2) with σ = 1
0.6065
>>> compute_score("aftraj", "no blocks", gt, info)["score"]
-1.0
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from aftraj.verdict import ParseFailure, Verdict, agent_match, grounded, parse_verdict

COMPONENTS = ("format", "what", "where", "who")


@dataclass(frozen=True)
class RewardConfig:
    """Weights of the reward's components, σ of `where`, the malformed score, DAPO's buffer."""

    w_format: float = 0.5
    w_what: float = 1.0
    w_where: float = 1.0
    w_who: float = 1.0
    sigma: float = 1.0
    malformed_score: float = -1.0
    # DAPO soft overlong penalty: the last `overlong_buffer_len` tokens before `max_resp_len`
    # cost up to `overlong_penalty_factor` (linearly); 0 disables it (TRL path).
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    # where = who credit of a right SAFE verdict (DESIGN §5 leaves it open; see the module doc)
    safe_where_who_credit: float = 1.0

    def __post_init__(self) -> None:
        for k in ("w_format", "w_what", "w_where", "w_who", "overlong_penalty_factor"):
            if getattr(self, k) < 0:
                raise ValueError(f"reward: {k} must be >= 0, got {getattr(self, k)}")
        if self.sigma <= 0:
            raise ValueError(f"reward: sigma must be > 0, got {self.sigma}")
        if self.malformed_score >= 0:
            raise ValueError(f"reward: malformed_score must be < 0 (below every well-formed score), "
                             f"got {self.malformed_score}")
        if self.overlong_buffer_len < 0:
            raise ValueError(f"reward: overlong_buffer_len must be >= 0, got {self.overlong_buffer_len}")
        if not 0 <= self.safe_where_who_credit <= 1:
            raise ValueError(f"reward: safe_where_who_credit must be in [0, 1], got {self.safe_where_who_credit}")
        # the lowest well-formed score (w_format: a wrong decision) at the length limit (the full
        # penalty) must stay above a malformed completion's score
        if self.overlong_penalty_factor >= self.w_format - self.malformed_score:
            raise ValueError(f"reward: overlong_penalty_factor must be below w_format - malformed_score "
                             f"({self.w_format - self.malformed_score}) so a well-formed answer at the length "
                             f"limit scores above a malformed one, got {self.overlong_penalty_factor}")

    def score_kwargs(self) -> dict:
        """The keyword arguments of `compute_score` (verl: custom_reward_function.reward_kwargs)."""
        d = asdict(self)
        return {k: d[k] for k in ("w_format", "w_what", "w_where", "w_who", "sigma", "malformed_score",
                                  "safe_where_who_credit")}


def gold_from_ground_truth(ground_truth) -> Verdict:
    """The gold verdict from `reward_model.ground_truth` (a JSON string, or its dict)."""
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
    if gt.get("answer") == "SAFE":
        return Verdict("SAFE")
    k, a = gt.get("answer"), gt.get("agent")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0 or not isinstance(a, str) or not a:
        raise ValueError(f"reward: ground_truth must be {{'answer': 'SAFE' | k >= 0, 'agent': name}}, "
                         f"got {ground_truth!r}")
    return Verdict("UNSAFE", step=k, agent=a)


def ground_truth_of(gold: Verdict) -> str:
    """The ground_truth string written into the stage-2 data for a gold verdict."""
    return json.dumps({"answer": "SAFE" if not gold.alarm else gold.step,
                       "agent": gold.agent if gold.alarm else None}, ensure_ascii=False)


_DEFAULT = RewardConfig()   # the keyword defaults below are RewardConfig's, the one place of the numbers


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None, *,
                  w_format: float = _DEFAULT.w_format, w_what: float = _DEFAULT.w_what,
                  w_where: float = _DEFAULT.w_where, w_who: float = _DEFAULT.w_who, sigma: float = _DEFAULT.sigma,
                  malformed_score: float = _DEFAULT.malformed_score,
                  safe_where_who_credit: float = _DEFAULT.safe_where_who_credit) -> dict:
    """Score one completion for one prefix. Pure: same inputs, same dict. See the module doc.
    The keyword arguments are `RewardConfig.score_kwargs()` (verl: custom_reward_function.reward_kwargs)."""
    info = extra_info or {}
    if "t" not in info or "agents" not in info:
        raise ValueError(f"reward: extra_info needs 't' and 'agents' (the visible prefix), got "
                         f"{sorted(info)} for data_source {data_source!r}")
    t, agents = int(info["t"]), [str(a) for a in info["agents"]]
    gold = gold_from_ground_truth(ground_truth)
    out = {"score": float(malformed_score), **{c: 0.0 for c in COMPONENTS}}
    v = parse_verdict(solution_str, t)
    if isinstance(v, ParseFailure):
        return out
    if v.alarm and not grounded(v.step, v.agent, t, agents):
        return out
    out["format"] = 1.0
    if v.decision == gold.decision:
        out["what"] = 1.0
        if gold.alarm:
            out["where"] = math.exp(-((v.step - gold.step) ** 2) / (2 * sigma ** 2))
            out["who"] = 1.0 if agent_match(v.agent, gold.agent) else 0.0
        else:
            out["where"] = out["who"] = float(safe_where_who_credit)
    out["score"] = (w_format * out["format"] + w_what * out["what"] + w_where * out["where"]
                    + w_who * out["who"])
    return out


def overlong_penalty(n_tokens: int, max_resp_len: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's soft overlong penalty, as verl's `dapo` reward manager computes it:
    min(-(n - (max_resp_len - buffer_len)) / buffer_len · factor, 0); 0 when buffer_len is 0."""
    if buffer_len <= 0:
        return 0.0
    if buffer_len > max_resp_len:
        raise ValueError(f"overlong buffer ({buffer_len}) is longer than max_resp_len ({max_resp_len})")
    exceed = n_tokens - (max_resp_len - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)
