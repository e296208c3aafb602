"""Where a GPU's memory goes, drawn: a bar per GPU, predicted beside measured.

Pure: plain breakdowns in, text (for the console) or SVG (for the HTML report) out. A breakdown is
weights, non-torch memory, activation peak, CUDA graphs, KV cache and the memory not free at start
(other processes), in GiB of one device; what is left is free. A part vLLM did not report is None:
the bar then shows the unexplained rest as "not reported" instead of guessing.

``tune``'s report, ``r1sup report`` and ``r1sup plan`` draw with it: a planner breakdown becomes a
:class:`Breakdown` with :func:`from_planner`, vLLM's printed figures with :func:`from_figures`;
then :func:`render_text` or :func:`render_svg`.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from r1sup.core.figures import Figures

PARTS = ("weights", "non_torch", "activation", "graphs", "kv", "other")
LABELS = {
    "weights": "weights",
    "non_torch": "non-torch",
    "activation": "activation",
    "graphs": "CUDA graphs",
    "kv": "KV cache",
    "other": "not free at start",
    "free": "free",
    "unknown": "not reported",
}
CHARS = {
    "weights": "W",
    "non_torch": "N",
    "activation": "A",
    "graphs": "G",
    "kv": "K",
    "other": "O",
    "free": ".",
    "unknown": "?",
}
# colour-blind-safe palette (Tableau 10), one per part; free is light grey, unknown hatched grey
COLORS = {
    "weights": "#4e79a7",
    "non_torch": "#9c755f",
    "activation": "#f28e2b",
    "graphs": "#b07aa1",
    "kv": "#59a14f",
    "other": "#e15759",
    "free": "#e6e6e6",
    "unknown": "#bababa",
}
TEXT_WIDTH = 60  # characters of a text bar


@dataclass(frozen=True)
class Breakdown:
    """Memory of one device in GiB. None: not known (not printed by vLLM, not predicted)."""

    total_gib: float
    weights_gib: float | None = None
    non_torch_gib: float | None = None
    activation_gib: float | None = None
    graphs_gib: float | None = None
    kv_gib: float | None = None
    other_gib: float | None = None  # not free when vLLM started: other processes (and its CUDA context)
    kv_short_gib: float = 0.0  # the KV cache is this much short (a prediction that does not fit)

    def value(self, part: str) -> float | None:
        v = getattr(self, f"{part}_gib")
        return None if v is None else float(v)

    @property
    def known(self) -> bool:
        """At least one part besides other processes is known."""
        return any(self.value(p) is not None for p in PARTS if p != "other")

    @property
    def over_gib(self) -> float:
        """How much the parts exceed the device (a prediction that does not fit)."""
        used = sum(max(0.0, v) for p in PARTS if (v := self.value(p)) is not None)
        return max(0.0, used - self.total_gib)

    @property
    def span_gib(self) -> float:
        """What a bar is drawn over: the device, or the parts when they exceed it."""
        return self.total_gib + self.over_gib

    def segments(self) -> list[tuple[str, float]]:
        """(part, GiB) in drawing order, then ``free`` (everything known) or ``unknown`` (the rest)."""
        out = [(p, max(0.0, v)) for p in PARTS if (v := self.value(p)) is not None and v > 0]
        rest = max(0.0, self.total_gib - sum(v for _, v in out))
        complete = all(self.value(p) is not None for p in PARTS if p != "other")
        if rest > 0:
            out.append(("free" if complete else "unknown", rest))
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"total_gib": round(self.total_gib, 3)}
        for part in PARTS:
            v = self.value(part)
            out[f"{part}_gib"] = None if v is None else round(v, 3)
        if self.kv_short_gib:
            out["kv_short_gib"] = round(self.kv_short_gib, 3)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Breakdown | None:
        """From :meth:`to_dict` (a saved record); None when unusable."""
        total = _opt(data.get("total_gib"))
        if total is None or total <= 0:
            return None
        kwargs: dict[str, Any] = {"total_gib": total}
        for part in PARTS:
            kwargs[f"{part}_gib"] = _opt(data.get(f"{part}_gib"))
        kwargs["kv_short_gib"] = _opt(data.get("kv_short_gib")) or 0.0
        return cls(**kwargs)


@dataclass(frozen=True)
class GpuChart:
    """The bars of one device: what was predicted and, once vLLM printed its figures, what it measured."""

    title: str  # "GPU 0 (RTX 4090, 23.55 GiB)"
    predicted: Breakdown | None = None
    measured: Breakdown | None = None


# --- building breakdowns -----------------------------------------------------------------------


def from_planner(b: Any, total_gib: float | None = None) -> Breakdown:
    """A planner breakdown (``r1sup.core.planner.Breakdown`` or anything with its field names) as a bar.

    Other processes: what the device lacked at start (total - free) when the planner knew its free
    memory. A negative KV budget is drawn as no KV and kept as ``kv_short_gib``.
    """
    total = float(total_gib if total_gib is not None else b.total_gib)
    free = getattr(b, "free_gib", None)
    kv = float(b.kv_gib)
    return Breakdown(
        total_gib=total,
        weights_gib=float(b.weights_gib),
        non_torch_gib=float(b.non_torch_gib) + float(getattr(b, "context_gib", 0.0) or 0.0),
        activation_gib=float(b.activation_gib),
        graphs_gib=float(b.cudagraph_gib),
        kv_gib=max(0.0, kv),
        other_gib=max(0.0, total - float(free)) if free is not None else None,
        kv_short_gib=max(0.0, -kv),
    )


def from_figures(
    figures: Figures, total_gib: float | None = None, free_gib: float | None = None
) -> Breakdown | None:
    """What vLLM printed about one device (the log reader's figures) as a bar; None before it
    printed anything about the memory. ``total_gib``/``free_gib``: the device as probed before the
    launch, used where vLLM did not print them."""
    total = figures.device_total_gib or total_gib
    if not total:
        return None
    weights = figures.weights_gib
    non_torch = figures.non_torch_or_rest_gib
    free_at_start = figures.free_gib if figures.free_gib is not None else free_gib
    activation = figures.peak_activation_gib
    if activation is None and figures.breakdown_activation_gib is not None:
        # vLLM >= 0.27 prints "peak activation" in its breakdown line as the transient peak plus the
        # CUDA-graph estimate charged to the KV budget (gpu_worker.py; the log reader keeps that figure
        # apart): charged when vLLM said "CUDA graph memory profiling is enabled"; graphs are drawn apart
        charged = figures.equivalent_gpu_memory_utilization is not None
        estimate = float(figures.cudagraph_estimated_gib or 0.0) if charged else 0.0
        activation = max(0.0, float(figures.breakdown_activation_gib) - estimate)
    b = Breakdown(
        total_gib=float(total),
        weights_gib=_opt(weights),
        non_torch_gib=_opt(non_torch),
        activation_gib=_opt(activation),
        graphs_gib=_opt(figures.cudagraph_gib),
        kv_gib=_opt(figures.kv_cache_gib),
        other_gib=max(0.0, float(total) - float(free_at_start)) if free_at_start is not None else None,
    )
    return b if b.known else None


# --- text ----------------------------------------------------------------------------------------


def bar_text(b: Breakdown, width: int = TEXT_WIDTH) -> str:
    """``WWWWWWWWNNAAGKKKKKK.....``: one character per width-th of the device, each part at least one
    character when it is there at all (largest remainders decide the rest)."""
    segs = b.segments()
    if not segs or b.total_gib <= 0:
        return " " * width
    exact = [v / b.span_gib * width for _, v in segs]
    cells = [max(1, int(x)) if v > 0 else 0 for x, (_, v) in zip(exact, segs, strict=True)]
    while sum(cells) > width:  # the minimum of one cell overshot: take from the largest
        cells[cells.index(max(cells))] -= 1
    order = sorted(range(len(segs)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    i = 0
    while sum(cells) < width:
        cells[order[i % len(order)]] += 1
        i += 1
    return "".join(CHARS[part] * n for (part, _), n in zip(segs, cells, strict=True))


def framed(b: Breakdown, width: int = TEXT_WIDTH) -> str:
    """The bar between the device's edges: ``|WWWWNNKK...|``; parts beyond the device run past the
    right edge (``|WWWWWWWWWW|WWNAG``)."""
    bar = bar_text(b, width)
    if not b.over_gib:
        return f"|{bar}|"
    edge = round(b.total_gib / b.span_gib * width)
    return f"|{bar[:edge]}|{bar[edge:]}"


def render_text(charts: Sequence[GpuChart], width: int = TEXT_WIDTH) -> str:
    """The bars of every device, predicted beside measured, with a table of the figures in GiB."""
    lines: list[str] = []
    used: set[str] = set()
    for chart in charts:
        lines.append(chart.title)
        rows = [(name, b) for name, b in (("predicted", chart.predicted), ("measured", chart.measured)) if b]
        for name, b in rows:
            lines.append(f"  {name:<9} {framed(b, width)}")
            used.update(part for part, _ in b.segments())
        if not rows:
            lines.append("  (no figures)")
            continue
        parts = [p for p in (*PARTS, "free", "unknown") if any(_shown(b, p) is not None for _, b in rows)]
        head = "  " + " " * 10 + "".join(f"{LABELS[p]:>{_col(p)}}" for p in parts)
        lines.append(head)
        for name, b in rows:
            cells = []
            for p in parts:
                v = _shown(b, p)
                cells.append(f"{'-' if v is None else f'{v:.2f}':>{_col(p)}}")
            notes = []
            if b.over_gib:
                notes.append(f"{b.over_gib:.2f} more than the device has")
            if b.kv_short_gib:
                notes.append(f"KV short by {b.kv_short_gib:.2f}")
            note = f"  ({'; '.join(notes)})" if notes else ""
            lines.append(f"  {name:<10}" + "".join(cells) + note)
    if used:
        key = ", ".join(f"{CHARS[p]} {LABELS[p]}" for p in (*PARTS, "free", "unknown") if p in used)
        lines.append(f"  GiB per device; key: {key}")
    return "\n".join(lines) + "\n"


def _shown(b: Breakdown, part: str) -> float | None:
    if part in PARTS:
        return b.value(part)
    seg = dict(b.segments())
    return seg.get(part)


def _col(part: str) -> int:
    return max(8, len(LABELS[part]) + 2)


# --- SVG -----------------------------------------------------------------------------------------

_BAR_W = 640
_BAR_H = 26
_LABEL_W = 90
_ROW_H = 16  # a row of the legend


def render_svg(chart: GpuChart) -> str:
    """An inline SVG of one device: a bar per breakdown, segments labelled where they are wide
    enough, a tooltip (``<title>``) on each, and a legend that is also the table of figures: each
    part's GiB, predicted and measured, in print, so a part too thin to see on the bar (a KV cache
    of a few GiB on a 141 GiB device) is read there, not only in a tooltip. No fonts or scripts
    from outside."""
    rows = [(name, b) for name, b in (("predicted", chart.predicted), ("measured", chart.measured)) if b]
    used = [p for p in (*PARTS, "free", "unknown") if any(p in dict(b.segments()) for _, b in rows)]
    height = 30 + len(rows) * (_BAR_H + 10) + 8 + (len(used) + 1) * _ROW_H
    width = _LABEL_W + _BAR_W + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="memchart" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{_esc(chart.title)}" '
        'font-family="sans-serif" font-size="12">',
        '<defs><pattern id="unknown-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="{COLORS["unknown"]}"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#8a8a8a" stroke-width="2"/></pattern></defs>',
        f'<text x="0" y="16" font-weight="bold">{_esc(chart.title)}</text>',
    ]
    y = 28
    for name, b in rows:
        out.append(f'<text x="0" y="{y + 17}">{name}</text>')
        x = float(_LABEL_W)
        scale = _BAR_W / max(b.span_gib, 1e-9)
        for part, gib in b.segments():
            w = gib * scale
            fill = "url(#unknown-hatch)" if part == "unknown" else COLORS[part]
            out.append(
                f'<rect class="seg seg-{part}" data-part="{part}" data-gib="{gib:.3f}" x="{x:.2f}" y="{y}" '
                f'width="{w:.2f}" height="{_BAR_H}" fill="{fill}" stroke="#ffffff" stroke-width="1">'
                f"<title>{name} {LABELS[part]}: {gib:.2f} GiB</title></rect>"
            )
            label = f"{LABELS[part]} {gib:.1f}"
            if w >= 7.2 * len(label) + 6 and part not in ("free", "unknown"):
                out.append(
                    f'<text x="{x + 4:.2f}" y="{y + 17}" fill="#ffffff" pointer-events="none">{label}</text>'
                )
            x += w
        device_w = b.total_gib * scale
        out.append(
            f'<rect class="device" x="{_LABEL_W}" y="{y}" width="{device_w:.2f}" height="{_BAR_H}" '
            'fill="none" stroke="#555555"/>'
        )
        if b.over_gib:
            out.append(
                f'<rect class="over" x="{_LABEL_W + device_w:.2f}" y="{y - 2}" '
                f'width="{_BAR_W - device_w:.2f}" height="{_BAR_H + 4}" fill="none" stroke="#c62828" '
                'stroke-width="2" stroke-dasharray="4 3">'
                f"<title>{b.over_gib:.2f} GiB more than the device has</title></rect>"
            )
        y += _BAR_H + 10
    # the legend, one part a row, with its figures: every part readable however thin its segment
    cols = [(name, _LABEL_W + 150 + 90 * i) for i, (name, _) in enumerate(rows)]
    out.append(f'<text class="legend-head" x="{_LABEL_W}" y="{y + 11}" font-weight="bold">GiB</text>')
    out += [
        f'<text class="legend-head" x="{cx}" y="{y + 11}" font-weight="bold" text-anchor="end">{name}</text>'
        for name, cx in cols
    ]
    for part in used:
        y += _ROW_H
        fill = "url(#unknown-hatch)" if part == "unknown" else COLORS[part]
        out.append(f'<rect x="{_LABEL_W}" y="{y}" width="12" height="12" fill="{fill}" stroke="#555555"/>')
        out.append(f'<text x="{_LABEL_W + 16}" y="{y + 11}">{LABELS[part]}</text>')
        for (_, b), (name, cx) in zip(rows, cols, strict=True):
            shown = dict(b.segments()).get(part)
            figure = "-" if shown is None else f"{shown:.2f}"
            out.append(
                f'<text class="figure" data-part="{part}" data-row="{name}" x="{cx}" y="{y + 11}" '
                f'text-anchor="end">{figure}</text>'
            )
    out.append("</svg>")
    return "\n".join(out)


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _opt(value: Any) -> float | None:
    return float(value) if _number(value) else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
