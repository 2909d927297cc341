"""Issue 23 (9, 10): the OTel reader's malformed records are errors naming the record and field,
never tracebacks; parent cycles are reported; a 3,000-deep chain is read (iteratively); 10^6
spans are refused with a message before they are parsed; content of the wrong type is an error,
not stringified. Through the CLI: one line, exit 2."""

from __future__ import annotations

import json

import pytest

from aftraj.adapters.base import AdapterError
from aftraj.adapters.otel import read


def _attr(k, v):
    if isinstance(v, str):
        return {"key": k, "value": {"stringValue": v}}
    return {"key": k, "value": v}


def span(sid, parent=None, op="chat", start=1, attrs=None):
    a = [_attr("gen_ai.operation.name", op)] + [_attr(k, v) for k, v in (attrs or {}).items()]
    s = {"traceId": "ab" * 16, "spanId": sid, "name": op, "startTimeUnixNano": str(start), "attributes": a}
    if parent:
        s["parentSpanId"] = parent
    return s


def doc(spans, **rs):
    return {"resourceSpans": [{"scopeSpans": [{"spans": spans}], **rs}]}


def out_msgs(*parts):
    return json.dumps([{"role": "assistant", "parts": list(parts)}])


def write(tmp_path, d):
    p = tmp_path / "spans.json"
    p.write_text(json.dumps(d))
    return p


GOOD = span("01" * 8, op="chat", attrs={"gen_ai.output.messages": out_msgs({"type": "text", "content": "hi"})})

MALFORMED = {
    "int-not-a-number": (doc([{**GOOD, "attributes": GOOD["attributes"] + [{"key": "n", "value": {"intValue": "x1"}}]}]),
                         "intValue"),
    "start-not-a-number": (doc([{**GOOD, "startTimeUnixNano": "soon"}]), "startTimeUnixNano"),
    "status-a-string": (doc([{**GOOD, "status": "ERROR"}]), "status"),
    "scopeSpans-a-string": ({"resourceSpans": [{"scopeSpans": "spans"}]}, "scopeSpans"),
    "resource-a-string": ({"resourceSpans": ["resource"]}, "resourceSpans[0]"),
    "kvlist-without-key": (doc([{**GOOD, "attributes": GOOD["attributes"] + [
        {"key": "m", "value": {"kvlistValue": {"values": [{"value": {"stringValue": "v"}}]}}}]}]), "kvlistValue"),
    "task-part-not-a-string": (doc([span("01" * 8, attrs={"gen_ai.input.messages": json.dumps(
        [{"role": "user", "parts": [{"type": "text", "content": 7}]}])})]), "content"),
    "message-a-string": (doc([span("01" * 8, attrs={"gen_ai.output.messages": json.dumps(["hello"])})]),
                         "gen_ai.output.messages[0]"),
    "content-int": (doc([span("01" * 8, attrs={"gen_ai.output.messages": out_msgs({"type": "text", "content": 5})})]),
                    "content"),
    "content-list": (doc([span("01" * 8, attrs={"gen_ai.output.messages": out_msgs({"type": "text", "content": [1]})})]),
                     "content"),
    "content-object": (doc([span("01" * 8, attrs={"gen_ai.output.messages": out_msgs(
        {"type": "text", "content": {"a": 1}})})]), "content"),
    "content-nan": (doc([span("01" * 8, attrs={"gen_ai.output.messages": '[{"role": "assistant", "parts": '
                                                                       '[{"type": "text", "content": NaN}]}]'})]),
                    "content"),
    "tool-result-object": (doc([span("01" * 8, op="execute_tool", attrs={
        "gen_ai.tool.name": "t", "gen_ai.tool.call.result": {"kvlistValue": {"values": [
            {"key": "a", "value": {"intValue": "1"}}]}}})]), "result"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_record_is_an_error_naming_the_field(tmp_path, name):
    d, field = MALFORMED[name]
    with pytest.raises(AdapterError) as e:
        read(write(tmp_path, d))
    assert field in str(e.value) and "spans.json" in str(e.value), str(e.value)


def test_the_good_span_reads(tmp_path):
    (t,) = read(write(tmp_path, doc([GOOD])))
    assert [s.content for s in t.steps] == ["hi"]


def test_a_parent_cycle_is_reported_not_dropped(tmp_path):
    spans = [span("0a" * 8, start=1),
             span("01" * 8, parent="03" * 8, start=2), span("02" * 8, parent="01" * 8, start=3),
             span("03" * 8, parent="02" * 8, start=4)]
    with pytest.raises(AdapterError, match="cycle") as e:
        read(write(tmp_path, doc(spans)))
    assert "3 spans" in str(e.value)


def test_a_3000_deep_chain_is_read(tmp_path):
    spans = [span(f"{i + 1:016x}", parent=f"{i:016x}" if i else None, op="invoke_agent", start=i + 1,
                  attrs={"gen_ai.agent.name": f"agent{i % 2}"}) for i in range(3000)]
    (t,) = read(write(tmp_path, doc(spans)))
    assert len(t.steps) >= 2999          # a handoff at every level, then the termination


def test_a_million_spans_are_refused_before_parsing(tmp_path):
    one = json.dumps(span("0123456789abcdef", op="x"))
    p = tmp_path / "big.json"
    with open(p, "w") as f:
        f.write('{"resourceSpans": [{"scopeSpans": [{"spans": [')
        f.write(",".join([one] * 1_000_000))
        f.write("]}]}]}")
    with pytest.raises(AdapterError, match="split it"):
        read(p)


def test_the_span_count_is_bounded(tmp_path, monkeypatch):
    import aftraj.adapters.otel as otel
    monkeypatch.setattr(otel, "MAX_SPANS", 10)
    with pytest.raises(AdapterError, match="more than 10 spans"):
        read(write(tmp_path, doc([span(f"{i + 1:016x}") for i in range(11)])))


@pytest.mark.parametrize("name", ["status-a-string", "content-int", "scopeSpans-a-string"])
def test_convert_gives_one_line_and_exit_2(tmp_path, capsys, name):
    from aftraj.cli import main
    rc = main(["convert", "--from", "otel", str(write(tmp_path, MALFORMED[name][0])), "--out", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
