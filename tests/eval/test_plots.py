"""The plots say what they show (issue 25), asserted on their matplotlib artists
(`eval.report.draw_plot`) and on the files and tables the CLI writes: deployable.png marks the
parse-failure rate, alarm_delay.png is drawn for online auditors only, protocol / layout / parser
on every plot (the legend's title), integer ticks for counts, legend markers equal the plotted
ones, "P(UNSAFE)" only for probabilities; `eval compare` names the model, shows n and AUC, and
warns on other samples. Figures, not diagnostics (issue 47 item 7): percent axes with axis
titles, one-line titles, short labels, no two error bars overlapping."""

from __future__ import annotations

import json

import pytest

from aftraj.cli import main
from aftraj.schema import write_jsonl


@pytest.fixture
def data(tmp_path, make_traj):
    path = tmp_path / "set.jsonl"
    write_jsonl([make_traj(i, n, k) for i, (n, k) in
                 enumerate([(6, 2), (5, None), (7, 4), (4, None), (6, 1), (5, None)])], path)
    return path


def _eval(data, out, *extra):
    assert main(["eval", "--data", str(data), "--out", str(out), "--no-progress", "--n-boot", "50", *extra]) == 0
    m = json.loads((out / "metrics.json").read_text())
    preds = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    return m, preds


def _markers_match_legend(ax):
    """Every legend entry that names a plotted group has the marker, fill and colour drawn for it."""
    import matplotlib.colors as mc

    drawn = {(ln.get_marker(), mc.to_hex(ln.get_color()), ln.get_markerfacecolor() == "none")
             for ln in ax.get_lines() if ln.get_marker() not in (None, "None", "")}
    handles = [h for h in ax.get_legend().legend_handles if hasattr(h, "get_marker")]
    assert handles
    for h in handles:
        key = (h.get_marker(), mc.to_hex(h.get_color()), h.get_markerfacecolor() == "none")
        assert key in drawn or h.get_markeredgecolor() == "red", (h.get_label(), key, drawn)


def test_deployable_marks_the_parse_failure_rate(data, tmp_path):
    from eval.report import draw_plot

    m, preds = _eval(data, tmp_path / "fail", "--auditor", "dummy:fail")
    clean, cpreds = _eval(data, tmp_path / "safe", "--auditor", "dummy:safe")
    # both sit at (0, 0); only the one that never parsed carries the mark
    assert (m["overall"]["far"], m["overall"]["step_acc"]) == (clean["overall"]["far"], clean["overall"]["step_acc"]) == (0.0, 0.0)
    fig, ax = draw_plot("deployable.png", m, preds)
    texts = [t.get_text() for t in ax.texts]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "100% parse failures" in texts
    assert any("parse failures 100.0%" in x for x in labels)
    rings = [ln for ln in ax.get_lines() if ln.get_markeredgecolor() == "red" and ln.get_markerfacecolor() == "none"]
    assert len(rings) == 1 and list(rings[0].get_xdata()) == [0.0] and list(rings[0].get_ydata()) == [0.0]
    _markers_match_legend(ax)
    # dummy renders no prompt: its layout and parser never applied (issue 47 item 5)
    assert ax.get_legend().get_title().get_text() == "protocol strict, layout n/a, parser n/a"
    fig, ax = draw_plot("deployable.png", clean, cpreds)
    assert not ax.texts and not any(ln.get_markeredgecolor() == "red" for ln in ax.get_lines())
    assert any("parse failures 0.0%" in t.get_text() for t in ax.get_legend().get_texts())


def test_alarm_delay_only_for_online_auditors_with_integer_ticks(data, tmp_path):
    from eval.report import draw_plot

    m, preds = _eval(data, tmp_path / "last", "--auditor", "heuristic:last-step")
    assert m["posthoc"] and "alarm_delay.png" not in m["plots"]["written"]
    assert not (tmp_path / "last" / "alarm_delay.png").exists()
    assert "alarm delays are drawn for online auditors only" in m["plots"]["not_drawn"]["alarm_delay.png"]
    assert "alarm_delay.png not drawn: a post-hoc auditor" in (tmp_path / "last" / "report.md").read_text()
    m, preds = _eval(data, tmp_path / "at2", "--auditor", "dummy:alarm-at-2", "--protocol", "reference",
                     "--parser", "reference")
    assert "alarm_delay.png" in m["plots"]["written"]
    fig, ax = draw_plot("alarm_delay.png", m, preds)
    fig.canvas.draw()
    for axis in (ax.xaxis, ax.yaxis):
        ticks = [t for t in axis.get_majorticklocs()]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert ax.get_legend().get_title().get_text() == "protocol reference, layout n/a, parser n/a"
    delays = sorted(p["d"] - p["k_star"] for p in preds if p["gold"] == "UNSAFE" and p["alarmed"])
    heights = [int(r.get_height()) for r in ax.patches if r.get_height() > 0]
    assert sum(heights) == len(delays)


def test_p_unsafe_only_for_probabilities(data, tmp_path):
    from eval.report import draw_plot

    m, preds = _eval(data, tmp_path / "p", "--auditor", "dummy:gold,confidence=0.7", "--all-prefixes")
    fig, ax = draw_plot("far_step_acc.png", m, preds)
    assert [t.get_text() for t in ax.get_legend().get_texts()][0] == "threshold sweep on P(UNSAFE)"
    _markers_match_legend(ax)
    m["confidence_kind"] = "score"     # the structural monitor's
    fig, ax = draw_plot("far_step_acc.png", m, preds)
    assert [t.get_text() for t in ax.get_legend().get_texts()][0] == "threshold sweep on score"
    from eval.report import write_markdown

    write_markdown(m, tmp_path / "r.md")
    md = (tmp_path / "r.md").read_text()
    assert "P(UNSAFE)" not in md and "ALARM when score ≥ θ" in md and "not a probability" in md
    from eval.auditors.structural import StructuralAuditor

    assert StructuralAuditor.confidence_kind == "score"


def test_compare_names_the_model_shows_n_and_auc_and_warns(data, tmp_path, tiny_model_dir, capsys, torch_one_thread):
    a, _ = _eval(data, tmp_path / "a", "--auditor", "dummy:gold,confidence=0.7", "--all-prefixes")
    _eval(data, tmp_path / "b", "--auditor", "hf", "--model", str(tiny_model_dir), "--max-new-tokens", "2")
    _eval(data, tmp_path / "c", "--auditor", "dummy:safe", "--limit", "4")
    capsys.readouterr()
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "ab")]) == 0
    assert "warning" not in capsys.readouterr().err           # same trajectories, same settings
    md = (tmp_path / "ab" / "compare.md").read_text()
    model = "/".join(tiny_model_dir.parts[-2:])
    assert f"| hf ({model}) |" in md and "| 6 (3 / 3) |" in md and "stratified AUC" in md
    assert f"{a['stratified_auc']['auc']:.3f} [" in md
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "ac")]) == 0
    err = capsys.readouterr().err
    assert "warning: the runs were measured on different trajectories" in err and "n=6" in err and "n=4" in err
    assert "**Warning: the runs were measured on different trajectories" in (tmp_path / "ac" / "compare.md").read_text()


def test_far_step_acc_draws_the_decision_token_sweep(data, tmp_path):
    """A `--decision-threshold` run moves along the decision token's sweep: far_step_acc.png draws
    it (beside the score's sweep when both are measured, alone when only it is)."""
    from eval.report import _why_not_curve, draw_plot

    m, preds = _eval(data, tmp_path / "p", "--auditor", "dummy:gold,confidence=0.7", "--all-prefixes")
    dec = [{"threshold": 2.5, "far": 0.0, "step_acc": 0.25}, {"threshold": 1.0, "far": 0.5, "step_acc": 0.75}]
    m["decision_threshold_sweep"] = dec
    fig, ax = draw_plot("far_step_acc.png", m, preds)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:2] == ["threshold sweep on P(UNSAFE)", "threshold sweep on the decision token's log-odds"]
    curve = [ln for ln in ax.get_lines() if ln.get_label() == labels[1]]
    assert len(curve) == 1 and list(curve[0].get_xdata()) == [0.0, 0.5] and list(curve[0].get_ydata()) == [0.25, 0.75]
    _markers_match_legend(ax)
    m["threshold_sweep"] = None           # the greedy hf walk's P(UNSAFE) is missing on some prefix
    assert _why_not_curve(m, preds) is None
    fig, ax = draw_plot("far_step_acc.png", m, preds)
    assert [t.get_text() for t in ax.get_legend().get_texts()][0] == labels[1]
    m["decision_threshold_sweep"] = None
    assert "no per-prefix confidence" in _why_not_curve(m, preds)


def test_compare_gives_paired_differences_on_the_same_trajectories(data, tmp_path):
    _eval(data, tmp_path / "gold", "--auditor", "dummy:gold")
    _eval(data, tmp_path / "safe", "--auditor", "dummy:safe")
    _eval(data, tmp_path / "few", "--auditor", "dummy:safe", "--limit", "4")
    assert main(["eval", "compare", str(tmp_path / "gold"), str(tmp_path / "safe"), "--out", str(tmp_path / "gs")]) == 0
    md = (tmp_path / "gs" / "compare.md").read_text()
    assert "## Paired differences: dummy:gold minus each run" in md
    # the oracle finds every k* (Exact-F1 100 %) and never false-alarms; the quiet run finds none
    assert "| dummy:safe | +100.00 pts [+100.00, +100.00], P(≤ 0) 0.000 |" in md
    assert main(["eval", "compare", str(tmp_path / "gold"), str(tmp_path / "few"), "--out", str(tmp_path / "gf")]) == 0
    assert "Paired differences" not in (tmp_path / "gf" / "compare.md").read_text()   # other trajectories


def _tick_texts(axis) -> list[str]:
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text()]


def _errorbar_boxes(ax) -> list:
    """The bounding box (data coordinates) of each error bar container's bars."""
    from matplotlib.container import ErrorbarContainer
    from matplotlib.transforms import Bbox

    boxes = []
    for c in ax.containers:
        if isinstance(c, ErrorbarContainer) and c.lines[2]:
            segs = [s for coll in c.lines[2] for s in coll.get_segments()]
            pts = [p for s in segs for p in s]
            boxes.append(Bbox.from_extents(min(p[0] for p in pts), min(p[1] for p in pts),
                                           max(p[0] for p in pts), max(p[1] for p in pts)))
    return boxes


def test_figures_in_percent_with_axis_titles_one_line_titles_no_overlapping_bars(tmp_path, make_traj):
    """Issue 47 item 7: read off the figures' axes: axis titles set, rate ticks in %, a one-line
    title within TITLE_MAX, short labels, and no two error bars overlapping (several groups on
    one point, as subsets of a corpus sit)."""
    from eval.compare import draw_compare
    from eval.report import LABEL_MAX, TITLE_MAX, draw_plot

    runs = []
    for i, (n, k) in enumerate([(6, 2), (5, None), (7, 4), (4, None), (6, 1), (5, None), (5, 3), (4, None)]):
        t = make_traj(i, n, k)
        t.meta["subset"] = "a-very-long-subset-name-that-would-eat-the-plot" if i % 4 >= 2 else "short"
        runs.append(t)
    data = tmp_path / "d.jsonl"
    write_jsonl(runs, data)
    m, preds = _eval(data, tmp_path / "g", "--auditor", "dummy:gold,confidence=0.7", "--all-prefixes")
    m["auditor"] = "hf:" + "x" * 120          # a long name must not wrap the title
    assert len(m["by_subset"]) == 2
    for name in ("deployable.png", "far_step_acc.png", "alarm_delay.png"):
        fig, ax = draw_plot(name, m, preds)
        fig.canvas.draw()
        title = ax.get_title()
        assert "\n" not in title and len(title) <= TITLE_MAX and "…" in title, (name, title)
        assert ax.get_xlabel() and ax.get_ylabel(), name
        assert ax.get_legend().get_title().get_text() == "protocol strict, layout n/a, parser n/a"
        if name != "alarm_delay.png":       # rates: percent ticks on both axes
            for axis in (ax.xaxis, ax.yaxis):
                ticks = _tick_texts(axis)
                assert ticks and all(t.endswith("%") for t in ticks), (name, ticks)
            assert "%" in ax.get_xlabel() and "%" in ax.get_ylabel()
        boxes = _errorbar_boxes(ax)
        assert all(not a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), name
        for t in ax.get_legend().get_texts():
            assert "a-very-long-subset-name-that-would-eat-the-plot" not in t.get_text()
    fig, ax = draw_plot("deployable.png", m, preds)
    assert len(_errorbar_boxes(ax)) == 1 and len([c for c in ax.containers]) == 3   # 3 groups, bars on one

    other = dict(m, auditor="rules-with-a-very-long-name-indeed-and-more-words")
    fig = draw_compare([m, other], ["hf:" + "x" * 120, other["auditor"]], ["exact_f1", "step_acc", "far"])
    fig.canvas.draw()
    for ax in fig.axes:
        assert ax.get_xlabel() and "%" in ax.get_xlabel() and "\n" not in ax.get_title()
        ticks = _tick_texts(ax.xaxis)
        assert ticks and all(t.endswith("%") for t in ticks), ticks
        boxes = _errorbar_boxes(ax)
        assert all(not a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    labels = _tick_texts(fig.axes[0].yaxis)
    assert len(labels) == 2 and all(len(x.split(" (n=")[0]) <= LABEL_MAX for x in labels), labels
    assert fig.axes[0].get_ylabel() == "run" and "\n" not in fig._suptitle.get_text()
