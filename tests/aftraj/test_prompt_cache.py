"""PrefixCache: the prompts of a run's successive prefixes rendered with the cache a run keeps
(the gateway's) are the prompts rendered without it, byte for byte, whatever the counter, the
budget or the order of the prefixes; and with it, a prefix over budget does not render or count
the whole body (the work the cache exists to save)."""

from __future__ import annotations

import random

import pytest

from aftraj import prompt as prompt_mod
from aftraj.prompt import SYSTEM_PROMPT, PrefixCache, render_prompt
from aftraj.schema import Label, Step, Trajectory
from aftraj.tokens import PromptBudgetError, approx_tokens


def _traj(steps, tid="r", task="the task"):
    return Trajectory(id=tid, family_id=tid, domain="external", source="gateway", task=task, steps=tuple(steps),
                      label=Label("SAFE", "external"))


def _steps(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = ("message", "tool_call", "tool_result")[i % 3]
        out.append(Step(index=i, agent="abc"[i % 3], kind=kind,
                        content=f"step {i} " + "word " * rng.randint(0, 120) + ("<step x>" if i % 17 == 0 else ""),
                        tool="search" if kind != "message" else None,
                        arguments={"q": f"x{i}"} if kind == "tool_call" else None,
                        result_ids=(f"d{i}",) if kind == "tool_result" else None))
    return out


def _render(traj, t, budget, **kw):
    try:
        return render_prompt(traj, t, budget, **kw)
    except PromptBudgetError as e:       # too small a budget: the same refusal either way
        return str(e)


def _same(traj, t, budget, cache, **kw):
    """The prompt with the cache is the prompt without it; returns it."""
    a, b = _render(traj, t, budget, cache=cache, **kw), _render(traj, t, budget, **kw)
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return None
    assert a.messages == b.messages and a.stable == b.stable
    assert a.suffix == b.suffix and a.coverage == b.coverage
    return a


SYS = approx_tokens(SYSTEM_PROMPT)


@pytest.mark.parametrize("room", [None, 300, 800, 4000])
def test_growing_run_same_prompts_as_without_cache_approx(room):
    """The gateway's pattern: a new Trajectory each request over the same Step objects, t the
    newest step; t crosses 10 and 100 (the suffix's length changes the view's room)."""
    budget = None if room is None else SYS + room
    steps = _steps(130)
    cache, n_bounded = PrefixCache(), 0
    for t in range(len(steps)):
        traj = _traj(steps[: t + 1])
        got = _same(traj, t, budget, cache)
        n_bounded += got is not None and got.coverage is not None
    if room in (800, 4000):
        assert n_bounded > 50        # the bounded view is what this checks


def test_growing_run_same_prompts_with_a_tokenizer(tiny_tokenizer):
    def count(s: str) -> int:
        return len(tiny_tokenizer(s, add_special_tokens=False)["input_ids"])

    budget = count(SYSTEM_PROMPT) + 1500
    steps = _steps(80, seed=3)
    cache, n_bounded = PrefixCache(), 0
    for t in range(len(steps)):
        traj = _traj(steps[: t + 1])
        got = _same(traj, t, budget, cache, count_tokens=count)
        n_bounded += got is not None and got.coverage is not None
    assert n_bounded > 30


def test_out_of_order_prefixes_and_other_trajectories_reset_nothing_wrong():
    """Prefixes back and forth, a different trajectory, a step replaced, another counter: each
    prompt is still the uncached one."""
    a, b = _steps(90, seed=1), _steps(90, seed=2)
    b_changed = list(a)
    b_changed[40] = Step(index=40, agent="z", kind="message", content="replaced " * 50)

    def count2(s):
        return len(s) // 4 + 1

    cache = PrefixCache()
    rng = random.Random(7)
    plan = [(a, t, approx_tokens) for t in range(90)] + [(a, t, approx_tokens) for t in (5, 89, 30, 31, 88)]
    plan += [(b, t, approx_tokens) for t in range(0, 90, 7)] + [(b_changed, t, approx_tokens) for t in range(35, 90)]
    plan += [(a, rng.randrange(90), count2) for _ in range(30)]
    for steps, t, ct in plan:
        traj = _traj(steps)
        assert _same(traj, t, 2 * SYS + 800, cache, count_tokens=ct) is not None


def test_over_budget_prefix_does_not_render_the_whole_run(monkeypatch):
    """With the cache, prefix t of a long run renders only the steps it has not seen and the
    view's verbatim tail: not the whole run again (the per-request cost the gateway pays)."""
    steps = _steps(400, seed=5)
    index = {s.content: s.index for s in steps}
    cache = PrefixCache()
    for t in range(300):
        render_prompt(_traj(steps[: t + 1]), t, SYS + 1500, cache=cache)
    rendered = []                     # step contents escaped by render_step: the steps rendered
    real = prompt_mod.escape
    monkeypatch.setattr(prompt_mod, "escape", lambda text: (rendered.append(index[text]) if text in index
                                                            else None) or real(text))
    r = render_prompt(_traj(steps[:301]), 300, SYS + 1500, cache=cache)
    assert r.coverage is not None
    verbatim = int(r.coverage.split(", ")[1].split("-")[0])
    assert verbatim > 250
    # step 300 once for its length, once for its count in the plan, then the verbatim tail
    assert rendered and all(i >= verbatim for i in rendered), rendered
    assert len(rendered) <= 2 * (301 - verbatim) + 2, rendered
    rendered.clear()
    render_prompt(_traj(steps[:301]), 300, SYS + 1500)      # without a cache: the whole run
    assert set(range(301)) <= set(rendered)


@pytest.mark.slow
def test_with_a_tokenizer_an_over_budget_prefix_counts_its_parts_not_the_whole(tiny_tokenizer):
    """With a tokenizer (the served model's, in the gateway) the count of the whole prompt comes
    from the blocks' counts where each boundary adds up (checked once a boundary): prefix 300 of
    a long run counts no text longer than a few blocks and its bounded view, and the prompts
    are the uncached ones. A counter whose parts never add up is counted whole, as before."""
    seen = []

    def count(s: str) -> int:
        seen.append(len(s))
        return len(tiny_tokenizer(s, add_special_tokens=False)["input_ids"])

    steps = _steps(320, seed=4)
    budget = count(SYSTEM_PROMPT) + 1500
    cache = PrefixCache()
    for t in range(300):
        _same(_traj(steps[: t + 1]), t, budget, cache, count_tokens=count)
    assert cache.dirty is None                      # this tokenizer's blocks split apart
    whole = len("".join(prompt_mod.render_step(s) for s in steps[:301]))
    seen.clear()
    r = render_prompt(_traj(steps[:301]), 300, budget, cache=cache, count_tokens=count)
    assert r.coverage is not None and max(seen) < whole / 5, (max(seen), whole)
    assert r.messages == render_prompt(_traj(steps[:301]), 300, budget, count_tokens=count).messages

    def lumpy(s: str) -> int:                      # the parts' counts never add up to the whole's
        return len(s) // 7 + 1

    cache = PrefixCache()
    for t in range(0, 120, 3):
        _same(_traj(steps[: t + 1]), t, 2 * SYS + 600, cache, count_tokens=lumpy)
    assert cache.dirty == 1
