"""The service-level picture: concurrency against p95 TTFT and p95 ITL, the targets drawn and the chosen
point marked, as text (the tune report) and as SVG (the HTML report). Pure: a
:class:`r1sup.core.slo.SloResult` in, text out."""

from __future__ import annotations

from html import escape

from r1sup.core.slo import IMPOSSIBLE, Level, SloResult

BAR = 22  # characters of one text bar


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _bar(value: float | None, target: float | None, top: float) -> str:
    """A bar of ``value`` on a scale to ``top``, the target as ``|`` (``!`` where the bar passes it)."""
    cells = [" "] * BAR
    if value is not None and top > 0:
        for i in range(min(BAR, max(1, round(value / top * BAR)))):
            cells[i] = "#"
    if target is not None and top > 0:
        at = min(BAR - 1, round(target / top * BAR))
        cells[at] = "!" if cells[at] == "#" and value is not None and value > target else "|"
    return "".join(cells)


def _top(levels: tuple[Level, ...], attr: str, target: float | None) -> float:
    values = [getattr(lv, attr) for lv in levels if getattr(lv, attr) is not None]
    return max([*values, (target or 0.0) * 1.25]) or 1.0


def render_text(result: SloResult) -> str:
    """One line per load level: TTFT and ITL p95 as bars against their targets (``|``), the request
    rate and goodput, what broke; the chosen level marked ``*``, the knee ``k``."""
    t = result.targets
    lines = [f"service level: {t.describe()}; workload: {result.workload.describe()}"]
    if not result.levels:
        return "\n".join([*lines, f"  {result.reason}", ""])
    ttft_top = _top(result.levels, "ttft_p95_s", t.ttft_p95_s)
    itl_top = _top(result.levels, "itl_p95_s", t.itl_p95_s)
    best, knee = result.best, result.knee
    lines.append(
        f"  {'':2}{'at once':>7}  {'TTFT p95':<{BAR}} {'':>8}  {'ITL p95':<{BAR}} {'':>7}  "
        f"{'req/s':>6} {'goodput':>7}  broke"
    )
    for lv in result.levels:
        mark = ("*" if best is not None and lv.concurrency == best.concurrency else " ") + (
            "k" if knee == lv.concurrency else " "
        )
        lines.append(
            f"  {mark}{lv.concurrency:>7}  {_bar(lv.ttft_p95_s, t.ttft_p95_s, ttft_top)} "
            f"{_ms(lv.ttft_p95_s):>8}  {_bar(lv.itl_p95_s, t.itl_p95_s, itl_top)} {_ms(lv.itl_p95_s):>7}  "
            f"{lv.request_rate:>6.2f} {lv.goodput:>7.2f}  {','.join(lv.broken) or '-'}"
        )
    lines.append("  (| the target, ! a bar past it; * the chosen level, k the knee)")
    if best is not None:
        lines.append(
            f"proven: {best.concurrency} requests at once, {best.request_rate:g} requests/s, "
            f"goodput {best.goodput:g}/s" + (f", knee at {knee}" if knee is not None else "")
        )
    elif result.verdict == IMPOSSIBLE:
        lines.append(f"refused: {result.reason}")
    else:
        lines.append(f"not proven: {result.reason}")
    if result.relaunch:
        lines.append(f"relaunched: {result.relaunch}")
    return "\n".join([*lines, ""])


W, H, PAD = 300, 180, 38


def _panel(result: SloResult, attr: str, target: float | None, title: str, x0: int) -> list[str]:
    levels = result.levels
    cmax = max(lv.concurrency for lv in levels)
    top = _top(levels, attr, target)

    def px(c: int) -> float:
        return x0 + PAD + (c / cmax) * (W - PAD - 10)

    def py(v: float) -> float:
        return H - PAD + 10 - (v / top) * (H - PAD - 10)

    out = [
        f'<text x="{x0 + W / 2:.0f}" y="12" text-anchor="middle" class="t">{escape(title)}</text>',
        f'<line x1="{x0 + PAD}" y1="{H - PAD + 10}" x2="{x0 + W - 10}" y2="{H - PAD + 10}" class="axis"/>',
        f'<line x1="{x0 + PAD}" y1="20" x2="{x0 + PAD}" y2="{H - PAD + 10}" class="axis"/>',
        f'<text x="{x0 + W / 2:.0f}" y="{H + 4}" text-anchor="middle">requests at once (max {cmax})</text>',
        f'<text x="{x0 + 2}" y="24">{escape(_ms(top))}</text>',
    ]
    if target is not None:
        y = py(target)
        out.append(f'<line x1="{x0 + PAD}" y1="{y:.1f}" x2="{x0 + W - 10}" y2="{y:.1f}" class="target"/>')
        out.append(
            f'<text x="{x0 + W - 12}" y="{y - 3:.1f}" text-anchor="end">target {escape(_ms(target))}</text>'
        )
    pts = [(lv, getattr(lv, attr)) for lv in levels if getattr(lv, attr) is not None]
    if pts:
        path = " ".join(f"{px(lv.concurrency):.1f},{py(v):.1f}" for lv, v in pts)
        out.append(f'<polyline points="{path}" class="line"/>')
    best = result.best
    for lv, v in pts:
        cls = (
            "chosen"
            if best is not None and lv.concurrency == best.concurrency
            else ("ok" if lv.meets else "broke")
        )
        r = 6 if cls == "chosen" else 3
        out.append(
            f'<circle cx="{px(lv.concurrency):.1f}" cy="{py(v):.1f}" r="{r}" class="{cls}">'
            f"<title>{lv.concurrency} at once: {escape(_ms(v))}</title></circle>"
        )
    return out


def render_svg(result: SloResult) -> str:
    """Two panels side by side (TTFT p95, ITL p95 against the concurrency), the targets dashed, the
    chosen level ringed; an empty string when no level was measured."""
    if not result.levels:
        return ""
    t = result.targets
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="slo-chart" width="{2 * W}" height="{H + 10}" '
        f'viewBox="0 0 {2 * W} {H + 10}" font-family="sans-serif" font-size="10">',
        "<style>.axis{stroke:#444}.target{stroke:#c00;stroke-dasharray:4 3}.line{fill:none;stroke:#36c}"
        ".ok{fill:#36c}.broke{fill:#c00}.chosen{fill:none;stroke:#090;stroke-width:2}.t{font-weight:bold}"
        "</style>",
        *_panel(result, "ttft_p95_s", t.ttft_p95_s, "TTFT p95", 0),
        *_panel(result, "itl_p95_s", t.itl_p95_s, "ITL p95", W),
        "</svg>",
    ]
    return "\n".join(parts) + "\n"
