"""Issue 45 item 8: the span readers' bounds. OpenInference and Langfuse name a parent cycle (the
OpenInference reader dropped such spans silently, the Langfuse one read them as agent-less);
every format refuses a file over the size limit and more spans than `otel.MAX_SPANS` (the
OpenInference reader had no limit: 10^6 spans took > 180 s and 2.8 GB); a deep chain is read
with one agent look-up a span (it walked every span's ancestors: 10k nested OTel spans 19.8 s).
The 30k-deep figure: benchmarks/reader_depth.py. Each event carries its span (`meta["otel"]`),
where an emitted verdict lands (issue 47.2). No framework package needed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from aftraj.adapters import langfuse, openinference, otel
from aftraj.adapters.base import AdapterError

_spec = importlib.util.spec_from_file_location("reader_depth", Path(__file__).parents[2] / "benchmarks" / "reader_depth.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

READERS = {"otel": otel.read, "openinference": openinference.read, "langfuse": langfuse.read}


def _write(tmp_path, doc, name="t.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def _cycled(fmt: str) -> dict:
    """A 5-span chain whose spans 2..4 form a cycle (2's parent is 4)."""
    doc = bench.MAKERS[fmt](5)
    if fmt == "langfuse":
        doc["observations"][2]["parentObservationId"] = doc["observations"][4]["id"]
    else:
        doc["resourceSpans"][0]["scopeSpans"][0]["spans"][2]["parentSpanId"] = bench._sid(4)
    return doc


@pytest.mark.parametrize("fmt", READERS)
def test_a_parent_cycle_is_a_named_error(tmp_path, fmt):
    with pytest.raises(AdapterError) as e:
        READERS[fmt](_write(tmp_path, _cycled(fmt)))
    msg = str(e.value)
    assert "form a cycle" in msg and "3 " in msg and bench._sid(2) in msg, msg
    assert ("parentObservationId" if fmt == "langfuse" else "parentSpanId") in e.value.field


@pytest.mark.parametrize("fmt", READERS)
def test_the_span_count_is_bounded_in_every_format(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(otel, "MAX_SPANS", 10)
    with pytest.raises(AdapterError, match="more than the 10|more than 10"):
        READERS[fmt](_write(tmp_path, bench.MAKERS[fmt](11)))
    assert len(READERS[fmt](_write(tmp_path, bench.MAKERS[fmt](10)))[0].steps) == 9


@pytest.mark.parametrize("fmt", READERS)
def test_the_file_size_is_bounded_in_every_format(tmp_path, monkeypatch, fmt):
    import aftraj.schema
    p = _write(tmp_path, bench.MAKERS[fmt](50))
    monkeypatch.setattr(aftraj.schema, "MAX_RECORD_BYTES", p.stat().st_size - 1)
    with pytest.raises(AdapterError, match="split it") as e:
        READERS[fmt](p)
    assert e.value.field == "<file>"


@pytest.mark.parametrize("fmt", READERS)
def test_a_deep_chain_keeps_its_agent_and_spans(tmp_path, fmt):
    """A 2,000-deep chain: every span's agent is the root agent's (now looked up once a span, not
    by walking its ancestors: the time is benchmarks/reader_depth.py's), and every step's event
    carries its own span."""
    n = 2000
    (t,) = READERS[fmt](_write(tmp_path, bench.MAKERS[fmt](n)))
    assert len(t.steps) == n - 1 and {s.agent for s in t.steps} == {"planner"}
    # events carry their span: where a verdict for the step lands (47.2)
    from aftraj.events import trajectory_to_events
    evs = [e for e in trajectory_to_events(t) if e.kind == "message"]
    assert sorted(e.meta["otel"]["span_id"] for e in evs) == [bench._sid(i) for i in range(1, n)]
    assert len({e.meta["otel"]["trace_id"] for e in evs}) == 1
