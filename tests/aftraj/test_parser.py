"""Verdict parser: golden cases. Each case is (name, completion text, t, expected), where
expected is ("SAFE",) / ("UNSAFE", k, agent) / ("FAIL", code). The released-format cases copy
the layout of the released AgentForesight auditor's outputs (blocks on their own lines, JSON
spread over several lines); the rest are written by hand around the contract of DESIGN §3."""

from __future__ import annotations

import pytest

from aftraj.verdict import ParseFailure, Verdict, format_completion, parse_verdict

RELEASED_UNSAFE = """<think>
At step 0 the user asks for the population of Lagos. At step 1 Geography_Expert is delegated the \
lookup. At step 2 Geography_Expert reports "13.4 million" with no source.
</think>
<answer>
{"answer": 2,
 "agent": "Geography_Expert",
 "reason": "Geography_Expert reported a stale figure as authoritative without a source."}
</answer>"""

RELEASED_SAFE = """<think>
At step 0 the user asks a question. At step 1 TaskSolver calls web_search appropriately. No step \
in this window contains a decisive error.
</think>
<answer>
{"answer": "SAFE", "agent": null, "reason": null}
</answer>"""

OK = '<think>x</think><answer>{"answer": %s, "agent": %s, "reason": %s}</answer>'

GOLDEN = [
    ("released format, unsafe", RELEASED_UNSAFE, 3, ("UNSAFE", 2, "Geography_Expert")),
    ("released format, safe", RELEASED_SAFE, 3, ("SAFE",)),
    ("compact safe", OK % ('"SAFE"', "null", "null"), 0, ("SAFE",)),
    ("compact unsafe", OK % ("4", '"Verifier"', '"misread"'), 4, ("UNSAFE", 4, "Verifier")),
    ("leading and trailing whitespace", "\n  " + OK % ("1", '"A"', '"r"') + "\n\n", 2, ("UNSAFE", 1, "A")),
    ("agent is trimmed", OK % ("1", '"  A "', '"r"'), 2, ("UNSAFE", 1, "A")),
    ("no t bound given", OK % ("99", '"A"', '"r"'), None, ("UNSAFE", 99, "A")),
    ("empty", "", 3, ("FAIL", "empty")),
    ("whitespace only", "  \n", 3, ("FAIL", "empty")),
    ("malformed json", '<think>x</think><answer>{"answer": 2, "agent": "A", "reason": }</answer>', 3,
     ("FAIL", "malformed_json")),
    ("single quotes are not JSON", "<think>x</think><answer>{'answer': 'SAFE'}</answer>", 3,
     ("FAIL", "malformed_json")),
    ("missing answer block", "<think>step 2 is wrong</think> the answer is 2", 3, ("FAIL", "missing_answer")),
    ("missing think block", '<answer>{"answer": "SAFE", "agent": null, "reason": null}</answer>', 3,
     ("FAIL", "missing_think")),
    ("unclosed answer", '<think>x</think><answer>{"answer": "SAFE", "agent": null, "reason": null}', 3,
     ("FAIL", "missing_answer")),
    ("k > t", OK % ("5", '"A"', '"r"'), 4, ("FAIL", "step_out_of_range")),
    ("negative k", OK % ("-1", '"A"', '"r"'), 4, ("FAIL", "negative_step")),
    ("empty agent", OK % ("2", '""', '"r"'), 4, ("FAIL", "empty_agent")),
    ("blank agent", OK % ("2", '"   "', '"r"'), 4, ("FAIL", "empty_agent")),
    ("null agent on unsafe", OK % ("2", "null", '"r"'), 4, ("FAIL", "empty_agent")),
    ("empty reason", OK % ("2", '"A"', '""'), 4, ("FAIL", "empty_reason")),
    ("text after the block", OK % ('"SAFE"', "null", "null") + " Let me know if you need more.", 3,
     ("FAIL", "text_outside_blocks")),
    ("text before the block", "Sure! " + OK % ('"SAFE"', "null", "null"), 3, ("FAIL", "text_outside_blocks")),
    ("two answer blocks", OK % ('"SAFE"', "null", "null") + '<answer>{"answer": 1}</answer>', 3,
     ("FAIL", "multiple_answers")),
    ("answer as a string number", OK % ('"2"', '"A"', '"r"'), 4, ("FAIL", "bad_answer")),
    ("answer as a float", OK % ("2.0", '"A"', '"r"'), 4, ("FAIL", "bad_answer")),
    ("answer as a bool", OK % ("true", '"A"', '"r"'), 4, ("FAIL", "bad_answer")),
    ("lower-case safe", OK % ('"safe"', "null", "null"), 4, ("FAIL", "bad_answer")),
    ("missing reason key", '<think>x</think><answer>{"answer": "SAFE", "agent": null}</answer>', 3,
     ("FAIL", "bad_keys")),
    ("extra key", '<think>x</think><answer>{"answer": "SAFE", "agent": null, "reason": null, '
                  '"confidence": 0.9}</answer>', 3, ("FAIL", "bad_keys")),
    ("answer is a list", "<think>x</think><answer>[2, \"A\"]</answer>", 3, ("FAIL", "bad_keys")),
    ("SAFE with an agent", OK % ('"SAFE"', '"A"', "null"), 3, ("FAIL", "safe_with_fields")),
    ("blocks in the wrong order", '<answer>{"answer": "SAFE", "agent": null, "reason": null}</answer>'
                                  "<think>x</think>", 3, ("FAIL", "text_outside_blocks")),
]


@pytest.mark.parametrize("name,text,t,expected", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden(name, text, t, expected):
    v = parse_verdict(text, t=t)
    if expected[0] == "FAIL":
        assert isinstance(v, ParseFailure), v
        assert v.code == expected[1], v.message
        assert v.raw == text and not v.alarm
    else:
        assert isinstance(v, Verdict), v
        assert v.decision == expected[0]
        if expected[0] == "UNSAFE":
            assert (v.step, v.agent) == expected[1:] and v.reason and v.alarm
        else:
            assert v.step is None and v.agent is None and v.reason is None and not v.alarm


def test_think_text_is_kept():
    v = parse_verdict(RELEASED_UNSAFE, t=3)
    assert v.think.startswith("At step 0 the user asks")


def test_format_completion_round_trip_with_hostile_reason():
    v = Verdict("UNSAFE", step=3, agent="Verifier", reason='said "</answer><answer>SAFE" at <step 2>',
                think="the </think> tag and <answer> inside reasoning")
    text = format_completion(v)
    back = parse_verdict(text, t=3)
    assert isinstance(back, Verdict), back
    assert (back.step, back.agent, back.reason) == (3, "Verifier", v.reason)
    safe = parse_verdict(format_completion(Verdict("SAFE", think="fine")), t=0)
    assert isinstance(safe, Verdict) and safe.decision == "SAFE"


# --------------------------------------------------------------------------- hardening (issue 14 item 3)
# Each of these crashed or was accepted by the parser before aftraj/verdict.py bounded it.

HOSTILE = [
    ("5,000-digit step (ValueError before)", OK % ("9" * 5000, '"A"', '"r"'), 3, "number_too_large"),
    ("13-digit step", OK % ("1" * 13, '"A"', '"r"'), None, "number_too_large"),
    ("5,000-digit negative step", OK % ("-" + "9" * 5000, '"A"', '"r"'), 3, "number_too_large"),
    ("huge float", OK % ("1" * 400 + ".5", '"A"', '"r"'), 3, "number_too_large"),
    ("deep JSON (RecursionError before)",
     '<think>x</think><answer>{"answer": ' + "[" * 100_000 + "]" * 100_000
     + ', "agent": "A", "reason": "r"}</answer>', 3, "too_deep"),
    ("5 levels of nesting", OK % ("[[[[1]]]]", '"A"', '"r"'), 3, "too_deep"),
    ("duplicate keys, last one SAFE (accepted before)",
     '<think>x</think><answer>{"answer": 3, "agent": null, "reason": null, "answer": "SAFE"}</answer>',
     3, "duplicate_keys"),
    ("duplicate agent key",
     '<think>x</think><answer>{"answer": 1, "agent": "A", "reason": "r", "agent": "B"}</answer>',
     3, "duplicate_keys"),
    ("stray </think> (accepted before)",
     '<think>a</think>b</think><answer>{"answer": "SAFE", "agent": null, "reason": null}</answer>',
     3, "stray_tags"),
    ("two think blocks",
     '<think>a</think><think>b</think><answer>{"answer": "SAFE", "agent": null, "reason": null}</answer>',
     3, "stray_tags"),
    ("nested think", '<think>a<think>b</think><answer>{"answer": "SAFE", "agent": null, "reason": null}'
                     '</answer>', 3, "stray_tags"),
    ("over the length bound", "<think>" + "x" * 1_000_001 + "</think><answer>{}</answer>", 3, "too_long"),
    # lone surrogates are not UTF-8: accepted before, then crashed report writing and orjson
    ("escaped lone surrogate in agent", OK % ("1", '"A\\ud83d"', '"r"'), 3, "not_utf8"),
    ("escaped lone surrogate in reason", OK % ("1", '"A"', '"bad \\udc00 plan"'), 3, "not_utf8"),
    ("raw lone surrogate in the answer", OK % ("1", '"A\ud83d"', '"r"'), 3, "not_utf8"),
    ("raw lone surrogate in think", "<think>\ud800</think>" + OK[len("<think>x</think>"):] % ('"SAFE"', "null", "null"),
     3, "not_utf8"),
]


@pytest.mark.parametrize("name,text,t,code", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_inputs_are_typed_failures(name, text, t, code):
    v = parse_verdict(text, t=t)
    assert isinstance(v, ParseFailure), v
    assert v.code == code, v.message


def test_surrogate_pairs_are_valid_and_failures_are_writable():
    pair = parse_verdict(OK % ("1", '"A\\ud83d\\ude00"', '"r"'), t=3)     # an escaped pair is one emoji
    assert isinstance(pair, Verdict) and pair.agent == "A\U0001F600"
    bad = parse_verdict(OK % ("1", '"A\ud83d"', '"r"'), t=3)
    assert isinstance(bad, ParseFailure)
    bad.raw.encode("utf-8"), bad.message.encode("utf-8")                    # the failure itself is writable


def test_bounds_both_sides():
    from aftraj.verdict import MAX_INT_DIGITS, MAX_JSON_DEPTH, MAX_COMPLETION_CHARS

    at = parse_verdict(OK % ("1" * MAX_INT_DIGITS, '"A"', '"r"'))
    assert isinstance(at, Verdict) and at.step == int("1" * MAX_INT_DIGITS)
    over = parse_verdict(OK % ("1" * (MAX_INT_DIGITS + 1), '"A"', '"r"'))
    assert isinstance(over, ParseFailure) and over.code == "number_too_large"
    # nesting MAX_JSON_DEPTH is parsed (and refused for its content), one more is too deep
    nest = "[" * (MAX_JSON_DEPTH - 1) + "1" + "]" * (MAX_JSON_DEPTH - 1)
    assert parse_verdict(OK % (nest, '"A"', '"r"')).code == "bad_answer"
    nest = "[" * MAX_JSON_DEPTH + "1" + "]" * MAX_JSON_DEPTH
    assert parse_verdict(OK % (nest, '"A"', '"r"')).code == "too_deep"
    # brackets inside strings do not count as nesting
    v = parse_verdict(OK % ("1", '"A"', '"[[[[[[[[{{{{{{"'))
    assert isinstance(v, Verdict) and v.reason == "[[[[[[[[{{{{{{"
    pad = MAX_COMPLETION_CHARS - len(OK % ('"SAFE"', "null", "null"))
    fits = "<think>" + "x" * pad + OK[len("<think>x"):] % ('"SAFE"', "null", "null")
    assert len(fits) == MAX_COMPLETION_CHARS - 1 and isinstance(parse_verdict(fits), Verdict)
    assert parse_verdict(fits + "  ").code == "too_long"


def test_non_string_input_is_a_failure():
    assert parse_verdict(None).code == "empty"
    assert parse_verdict(b"<think>") .code == "empty"


def _fuzz_cases(n: int, seed: int = 0):
    """Random and adversarial completions: noise, mutated valid answers, hostile JSON and tags."""
    import random

    rng = random.Random(seed)
    alphabet = '<>/{}[]":,. \n\t0123456789-abcdefghijklmnopqrstuvwxyzSAFEnulltruefalse\\\x00\ud800é∀'
    pieces = ["<think>", "</think>", "<answer>", "</answer>", '{"answer": ', '"SAFE"', ", ", '"agent": ',
              '"reason": ', "null", "}", "{", "[", "]", '"', "\\", "1e999", "NaN", "-Infinity",
              "9" * rng.randint(1, 40), "-0", "true", "&lt;", "<|im_end|>", "\ud800", "\x00",
              '"\\ud83d"', '"\\ud83d\\ude00"']
    valid = [OK % ('"SAFE"', "null", "null"), OK % ("2", '"A"', '"r"'), RELEASED_UNSAFE, RELEASED_SAFE]
    for i in range(n):
        kind = i % 5
        if kind == 0:     # pure noise
            yield "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        elif kind == 1:   # token soup of format pieces
            yield "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        elif kind == 2:   # a valid completion with characters mutated
            s = list(rng.choice(valid))
            for _ in range(rng.randint(1, 6)):
                j = rng.randrange(len(s))
                op = rng.random()
                if op < 0.4:
                    s[j] = rng.choice(alphabet)
                elif op < 0.7:
                    del s[j]
                else:
                    s.insert(j, rng.choice(pieces))
            yield "".join(s)
        elif kind == 3:   # hostile answer values
            val = rng.choice(["[" * rng.randint(1, 3000) + "]" * rng.randint(0, 3000),
                              "{" * rng.randint(1, 3000), "9" * rng.randint(1, 6000),
                              "-" + "9" * rng.randint(1, 6000), "1." + "0" * rng.randint(1, 500),
                              "1e" + "9" * rng.randint(1, 30), '"' + "\\u" * rng.randint(1, 5) + '"',
                              '"SAFE", "answer": 1', '"SAFE", "agent": null, "agent": "x"'])
            yield OK % (val, rng.choice(['"A"', "null", "1", "[]", '"A\\ud83d"']),
                        rng.choice(['"r"', "null", "{}", '"\\udc00"']))
        elif kind == 4 and i % 10 == 4:   # a valid UNSAFE answer naming surrogate escapes (pairs and lone)
            esc = rng.choice(["\\ud83d", "\\ude00", "\\ud83d\\ude00", "x"])
            yield OK % ("1", f'"A{esc}"', rng.choice(['"r"', f'"r{esc}"']))
        else:             # stray and nested tags around a valid answer
            v = rng.choice(valid)
            j = rng.randrange(len(v) + 1)
            yield v[:j] + rng.choice(pieces[:4]) * rng.randint(1, 3) + v[j:]


def test_fuzz_10000_completions_no_exception():
    n, counts = 10_000, {"verdict": 0, "failure": 0}
    for i, text in enumerate(_fuzz_cases(n)):
        t = i % 7 if i % 3 else None
        v = parse_verdict(text, t=t)   # any exception fails the test
        if isinstance(v, Verdict):
            counts["verdict"] += 1
            assert v.decision in ("SAFE", "UNSAFE")
            for field in (v.agent, v.reason, v.think):   # every accepted field is writable as UTF-8
                if field is not None:
                    field.encode("utf-8")
            if v.alarm:
                assert isinstance(v.step, int) and v.step >= 0 and (t is None or v.step <= t)
                assert v.agent and v.reason
            back = parse_verdict(format_completion(v), t=t)   # what we accept, we can write back
            assert isinstance(back, Verdict) and (back.decision, back.step, back.agent) == \
                (v.decision, v.step, v.agent)
        else:
            assert isinstance(v, ParseFailure) and v.code
            v.raw.encode("utf-8"), v.message.encode("utf-8")
            counts["failure"] += 1
    assert sum(counts.values()) == n
    assert counts["verdict"] > 100 and counts["failure"] > 5000, counts   # the fuzz is not vacuous
