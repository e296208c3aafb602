"""Memory bars: plain breakdowns -> text and SVG (pure)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from r1sup.core import memchart as M
from r1sup.core.figures import Figures

PRED = M.Breakdown(
    total_gib=24.0, weights_gib=12.0, non_torch_gib=0.5, activation_gib=1.5, graphs_gib=1.0, kv_gib=6.0,
    other_gib=0.0,
)  # fmt: skip


def test_each_character_is_a_share_of_the_device() -> None:
    bar = M.bar_text(PRED, width=48)
    assert len(bar) == 48
    assert bar.count("W") == 24 and bar.count("K") == 12 and bar.count("A") == 3
    assert bar.count("G") == 2 and bar.count("N") == 1 and bar.count(".") == 6
    assert bar == "".join(sorted(bar, key="WNAGKO.".index))  # parts in a fixed order


def test_a_small_part_still_shows() -> None:
    b = M.Breakdown(total_gib=80.0, weights_gib=70.0, non_torch_gib=0.1, kv_gib=9.0, activation_gib=0.0,
                    graphs_gib=0.0, other_gib=0.0)  # fmt: skip
    assert M.bar_text(b, 40).count("N") == 1


def test_parts_not_reported_are_not_guessed() -> None:
    b = M.from_figures(Figures(node_total_gib=8.59, kv_cache_gib=0.5))  # the CPU build's two figures
    assert b is not None and b.weights_gib is None
    assert dict(b.segments()) == {"kv": 0.5, "unknown": pytest.approx(8.09)}
    assert "?" in M.bar_text(b) and "." not in M.bar_text(b)
    assert M.from_figures(Figures(max_model_len=4096), total_gib=24.0) is None  # nothing about memory


def test_measured_from_vllms_breakdown_line() -> None:
    obs = {
        "weights_gib": 27.54, "consumed_gib": 28.13, "peak_activation_gib": 1.68, "cudagraph_gib": 0.87,
        "kv_cache_gib": 42.17, "free_gib": 78.68, "total_gib": 79.19,
    }  # fmt: skip
    b = M.from_figures(Figures(**obs), total_gib=80.0)
    assert b is not None
    assert (b.total_gib, b.non_torch_gib, b.other_gib) == (79.19, pytest.approx(0.59), pytest.approx(0.51))
    assert dict(b.segments())["free"] == pytest.approx(79.19 - 27.54 - 0.59 - 1.68 - 0.87 - 42.17 - 0.51)


def test_the_graph_estimate_inside_vllms_peak_activation_is_not_counted_twice() -> None:
    # vLLM >= 0.27 prints "peak activation" in its breakdown line as the transient peak plus its
    # CUDA-graph estimate (the log reader's breakdown_activation_gib)
    obs = {
        "weights_gib": 14.19, "consumed_gib": 14.64, "breakdown_activation_gib": 1.10, "cudagraph_gib": 0.45,
        "profiled_gpu_memory_utilization": 0.72, "equivalent_gpu_memory_utilization": 0.70,
        "cudagraph_estimated_gib": 0.48, "kv_cache_gib": 1.53, "free_gib": 17.54, "total_gib": 23.99,
    }  # fmt: skip
    b = M.from_figures(Figures(**obs))
    assert b is not None and b.activation_gib == pytest.approx(0.62) and b.over_gib == 0
    del obs["equivalent_gpu_memory_utilization"]  # profiling disabled: the estimate was not charged
    assert M.from_figures(Figures(**obs)).activation_gib == 1.10  # type: ignore[union-attr]
    # the profile's own figure (0.20-0.26's breakdown, the profiling line) never holds the estimate
    obs.update(peak_activation_gib=0.61, equivalent_gpu_memory_utilization=0.70)
    assert M.from_figures(Figures(**obs)).activation_gib == 0.61  # type: ignore[union-attr]


def test_from_a_planner_breakdown_that_does_not_fit() -> None:
    class PlannerBreakdown:  # the fields of r1sup.core.planner.Breakdown
        weights_gib, non_torch_gib, activation_gib, cudagraph_gib = 27.5, 0.3, 1.4, 0.9
        kv_gib, budget_gib, total_gib, context_gib, free_gib = -6.1, 21.6, 24.0, 0.5, 23.0

    b = M.from_planner(PlannerBreakdown())
    assert (b.kv_gib, b.kv_short_gib, b.non_torch_gib, b.other_gib) == (0.0, 6.1, 0.8, 1.0)
    assert b.over_gib == pytest.approx(27.5 + 0.8 + 1.4 + 0.9 + 1.0 - 24.0)
    text = M.render_text([M.GpuChart("GPU 0", b, None)])
    row = next(line for line in text.splitlines() if line.strip().startswith("predicted |"))
    assert row.count("|") == 2 and not row.endswith("|")  # the parts run past the device's edge
    assert "more than the device has" in text and "KV short by 6.10" in text


def test_text_puts_predicted_beside_measured_with_the_figures() -> None:
    meas = M.Breakdown(
        total_gib=24.0, weights_gib=12.4, non_torch_gib=0.6, activation_gib=1.2, graphs_gib=0.8, kv_gib=6.4,
        other_gib=0.5,
    )  # fmt: skip
    text = M.render_text([M.GpuChart("GPU 0 (RTX 4090, 24.00 GiB)", PRED, meas)])
    lines = text.splitlines()
    assert lines[0] == "GPU 0 (RTX 4090, 24.00 GiB)"
    assert lines[1].startswith("  predicted |") and lines[2].startswith("  measured  |")
    assert "12.40" in text and "0.50" in text and "key: W weights" in text


def test_svg_is_self_contained_and_labelled() -> None:
    meas = M.Breakdown(total_gib=24.0, weights_gib=12.4, kv_gib=6.4)
    svg = M.render_svg(M.GpuChart("GPU 0 <RTX & co>", PRED, meas))
    root = ET.fromstring(svg)  # well-formed XML, title escaped
    ns = "{http://www.w3.org/2000/svg}"
    segs = [r for r in root.iter(f"{ns}rect") if r.get("data-part")]
    parts = [r.get("data-part") for r in segs]
    assert parts.count("weights") == 2 and "unknown" in parts and "free" in parts
    widths = {(r.get("data-part"), r.get("data-gib")): float(r.get("width", 0)) for r in segs}
    assert widths[("weights", "12.000")] == pytest.approx(640 * 12 / 24, abs=0.01)
    assert all(r.find(f"{ns}title") is not None for r in segs)
    assert "http" not in svg.replace("http://www.w3.org/2000/svg", "")  # nothing fetched from elsewhere


def test_round_trip_through_a_record() -> None:
    again = M.Breakdown.from_dict(PRED.to_dict())
    assert again == PRED
    assert M.Breakdown.from_dict({"total_gib": "x"}) is None


def test_a_part_too_thin_to_see_on_the_bar_is_printed_in_the_legend() -> None:
    """Issue 36: a 1.1 GiB KV cache on a 141 GiB H200 is a sliver of the bar, its figure was only in a
    tooltip; the legend prints every part's GiB, predicted and measured, as text on the page."""
    pred = M.Breakdown(total_gib=141.0, weights_gib=131.4, non_torch_gib=0.6, activation_gib=4.2,
                       graphs_gib=0.9, kv_gib=1.2, other_gib=0.6)  # fmt: skip
    meas = M.Breakdown(total_gib=141.0, weights_gib=131.4, non_torch_gib=0.5, activation_gib=4.1,
                       graphs_gib=0.8, kv_gib=1.1, other_gib=0.6)  # fmt: skip
    root = ET.fromstring(M.render_svg(M.GpuChart("GPU 0 (NVIDIA H200, 141.00 GiB)", pred, meas)))
    ns = "{http://www.w3.org/2000/svg}"
    kv_bar = [r for r in root.iter(f"{ns}rect") if r.get("data-part") == "kv"]
    assert all(float(r.get("width", 0)) < 7 for r in kv_bar)  # too thin for a label on the bar
    printed = {
        (t.get("data-part"), t.get("data-row")): t.text for t in root.iter(f"{ns}text") if t.get("data-part")
    }
    assert printed[("kv", "predicted")] == "1.20" and printed[("kv", "measured")] == "1.10"
    assert printed[("graphs", "measured")] == "0.80" and printed[("weights", "predicted")] == "131.40"
