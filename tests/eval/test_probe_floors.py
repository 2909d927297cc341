"""The probe's floors (eval/probe.py, issue 43 item 4): the headline post > twin on kind-matched
pairs only (the pairs left out are counted), the step-kind rule and the bag of words of step k*
(fit on train twin pairs) as rows. No model: the scorer is a function."""

from __future__ import annotations

import dataclasses

from eval.probe import BOW_RULE, KIND_RULE, bow_k_star, kind_unmatched_runs, probe


def _pair(make_traj, i: int, n: int, k: int, *, twin_kind: str = "message", planted: str = "[[ERROR]]"):
    """An unsafe run (step k says `planted`) and its safe twin, whose step k may change kind."""
    unsafe = make_traj(i, n, k)
    unsafe = dataclasses.replace(unsafe, steps=tuple(dataclasses.replace(s, content=s.content.replace("[[ERROR]]", planted))
                                                     for s in unsafe.steps))
    twin = dataclasses.replace(make_traj(i, n, None), id=f"twin{i}")
    if twin_kind != "message":
        twin = dataclasses.replace(twin, steps=tuple(dataclasses.replace(s, kind=twin_kind, tool="run") if s.index == k else s
                                                     for s in twin.steps))
    return [unsafe, twin]


def _reads_content(messages, t, alarm):
    return {"decision": 1.0 if "[[ERROR]]" in messages[1]["content"] else -1.0}


def test_the_headline_is_on_kind_matched_pairs_and_the_others_are_counted(make_traj):
    trajs = [*_pair(make_traj, 0, 6, 3), *_pair(make_traj, 1, 5, 2),
             *_pair(make_traj, 2, 6, 4, twin_kind="tool_call")]          # a twin that calls a tool at k*
    assert kind_unmatched_runs(trajs) == {"t2"}
    res = probe(trajs, _reads_content, budget=None, count_tokens=len, n_boot=100)
    s = res["summary"]
    assert s["post_beats_twin"]["n"] == 2 and s["post_beats_twin"]["share"] == 1.0
    assert s["kind_unmatched_pairs"] == 1
    # the step-kind rule is a row; on kind-matched pairs it cannot tell post from twin (one half),
    # and where a pair of another kind is found (a twin rule that ignores kinds) it would
    kind = res["rules"][KIND_RULE]
    assert kind["post_beats_twin"]["share"] == 0.5 and kind["kind_unmatched_pairs"] == 1
    assert BOW_RULE not in res["rules"]                 # no train runs, no bag-of-words row


def test_a_twin_rule_that_ignores_kinds_is_scored_on_matched_pairs_only(make_traj, monkeypatch):
    # under a twin rule that pairs a message with a tool call, the kind rule passes that pair:
    # the headline leaves it out, the every-pair figure keeps it
    import aftraj.boundary as boundary

    def loose(unsafe, safe):
        k = unsafe.label.decisive_step
        return (unsafe.label.unsafe and not safe.label.unsafe and safe.family_id == unsafe.family_id
                and len(safe.steps) > k and safe.steps[k].agent == unsafe.steps[k].agent
                and safe.steps[:k] == unsafe.steps[:k] and safe.steps[k] != unsafe.steps[k])

    monkeypatch.setattr(boundary, "is_twin", loose)
    trajs = [*_pair(make_traj, 0, 6, 3), *_pair(make_traj, 2, 6, 4, twin_kind="tool_call")]
    res = probe(trajs, _reads_content, budget=None, count_tokens=len, n_boot=0)
    kind = res["rules"][KIND_RULE]
    assert kind["post_beats_twin"] == {"n": 1, "share": 0.5, "ci": None}
    assert kind["post_beats_twin_all_pairs"]["n"] == 2 and kind["post_beats_twin_all_pairs"]["share"] == 0.75
    assert kind["kind_unmatched_pairs"] == 1


def test_bag_of_words_of_step_k_star_is_fit_on_train_pairs(make_traj):
    train = [t for i in range(12) for t in _pair(make_traj, 100 + i, 6, 2 + i % 3, planted="bogus claim")]
    held = [t for i in range(4) for t in _pair(make_traj, i, 6, 2 + i % 3, planted="bogus claim")]
    got = bow_k_star(train, held, n_boot=100)
    assert got["n_train_pairs"] == 12 and got["n_heldout_pairs"] == 4
    assert got["summary"]["post_beats_twin"]["share"] == 1.0      # it reads the planted words
    res = probe(held, lambda m, t, a: {"decision": 0.0}, budget=None, count_tokens=len, n_boot=0, train=train)
    assert res["rules"][BOW_RULE]["post_beats_twin"]["share"] == 1.0 and res["bow_k_star"]["n_train_pairs"] == 12
    # words the train pairs never tie to a label tell nothing: one half
    plain = [t for i in range(4) for t in _pair(make_traj, 50 + i, 6, 3, planted="other text")]
    assert bow_k_star(train, plain, n_boot=0)["summary"]["post_beats_twin"]["share"] == 0.5
    assert bow_k_star(train, [make_traj(9, 5, 2)], n_boot=0) is None          # no held-out twin pair
