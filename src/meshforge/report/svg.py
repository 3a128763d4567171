"""Small inline SVG charts (standard library only): the report must open offline, with no
JavaScript library, so every chart is plain SVG text written here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

MAX_POINTS = 2000  # per series: keeps a long run's report small
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
ACTION_COLORS = {"F": "#4c9be8", "B": "#e8894c", "W": "#6cc36c"}
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 640, 240, 64, 12, 12, 28


@dataclass
class Series:
    label: str
    color: str
    points: list[tuple[float, float]]
    dashed: bool = False


def downsample(points: Sequence[tuple[float, float]], limit: int = MAX_POINTS) -> list[tuple[float, float]]:
    """At most ``limit`` points, evenly strided, always keeping the last one (the final value matters)."""
    pts = [(x, y) for x, y in points if isinstance(y, (int, float)) and math.isfinite(y)]
    if len(pts) <= limit:
        return pts
    stride = math.ceil(len(pts) / (limit - 1))
    return pts[::stride] + [pts[-1]]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


def _bounds(series: Sequence[Series]) -> tuple[float, float, float, float]:
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.05, y1 + (abs(y1) or 1) * 0.05
    return x0, x1, y0, y1


def line_chart(metric: str, title: str, series: Sequence[Series], xlabel: str = "step") -> str:
    """One chart: a polyline per series (class "series", data-label = its name), axes with
    min/max ticks, and a legend. Empty series are dropped; no data at all gives a note."""
    series = [Series(s.label, s.color, downsample(s.points), s.dashed) for s in series]
    series = [s for s in series if s.points]
    head = f'<div class="chart"><h3>{escape(title)}</h3>'
    if not series:
        return head + '<p class="nodata">no data</p></div>'
    x0, x1, y0, y1 = _bounds(series)
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B

    def sx(x: float) -> float:
        return PAD_L + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return PAD_T + (1 - (y - y0) / (y1 - y0)) * ph

    out = [
        f'<svg class="chart-svg" data-metric="{escape(metric)}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
        'xmlns="http://www.w3.org/2000/svg" role="img">',
        f'<rect x="{PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>',
    ]
    for y, anchor in ((y0, PAD_T + ph), (y1, PAD_T + 8)):
        out.append(f'<text x="{PAD_L - 4}" y="{anchor}" text-anchor="end" class="tick">{escape(_fmt(y))}</text>')
    for x, anchor, align in ((x0, PAD_L, "start"), (x1, PAD_L + pw, "end")):
        out.append(f'<text x="{anchor}" y="{H - 12}" text-anchor="{align}" class="tick">{escape(_fmt(x))}</text>')
    out.append(f'<text x="{PAD_L + pw / 2}" y="{H - 4}" text-anchor="middle" class="tick">{escape(xlabel)}</text>')
    for s in series:
        pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s.points)
        dash = ' stroke-dasharray="5,3"' if s.dashed else ""
        out.append(
            f'<polyline class="series" data-label="{escape(s.label)}" fill="none" stroke="{escape(s.color)}" '
            f'stroke-width="1.5"{dash} points="{pts}"><title>{escape(s.label)}</title></polyline>'
        )
        if len(s.points) == 1:
            (x, y) = s.points[0]
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{escape(s.color)}"/>')
    out.append("</svg>")
    legend = "".join(
        f'<span class="key"><span class="swatch" style="background:{escape(s.color)}"></span>{escape(s.label)}</span>'
        for s in series
    )
    return head + "".join(out) + f'<div class="legend">{legend}</div></div>'


def pipeline_timeline(rows: Sequence[dict], title: str) -> str:
    """The pipeline step as a Gantt chart: one lane per pipeline rank, a rectangle per F/B/W
    action (class "action", data-kind), hover text naming the micro-batch and chunk."""
    actions = [a for r in rows for a in r.get("actions", [])]
    head = f'<div class="chart"><h3>{escape(title)}</h3>'
    if not actions:
        return head + '<p class="nodata">no pipeline actions recorded</p></div>'
    t0 = min(a["start"] for a in actions)
    span = max(a["end"] for a in actions) - t0 or 1.0
    lane, width, left = 28, 900, 70
    height = lane * len(rows) + 30
    out = [
        f'<svg class="timeline-svg" data-metric="pipeline_timeline" viewBox="0 0 {width + left + 10} {height}" '
        f'width="{width + left + 10}" height="{height}" xmlns="http://www.w3.org/2000/svg" role="img">'
    ]
    for i, r in enumerate(rows):
        y = 4 + i * lane
        out.append(f'<text x="4" y="{y + lane / 2 + 4}" class="tick">rank {escape(str(r.get("rank", i)))}</text>')
        for a in r.get("actions", []):
            x = left + (a["start"] - t0) / span * width
            w = max(0.5, (a["end"] - a["start"]) / span * width)
            kind = str(a.get("kind", "?"))
            ms = 1e3 * (a["end"] - a["start"])
            tip = f"{kind} micro-batch {a.get('microbatch')} chunk {a.get('chunk')}: {ms:.2f} ms"
            out.append(
                f'<rect class="action" data-kind="{escape(kind)}" x="{x:.1f}" y="{y}" width="{w:.1f}" '
                f'height="{lane - 6}" fill="{ACTION_COLORS.get(kind, "#999")}" stroke="#fff" stroke-width="0.5">'
                f"<title>{escape(tip)}</title></rect>"
            )
    out.append(f'<text x="{left}" y="{height - 6}" class="tick">0 ms</text>')
    out.append(
        f'<text x="{left + width}" y="{height - 6}" text-anchor="end" class="tick">{1e3 * span:.1f} ms</text></svg>'
    )
    swatch = '<span class="key"><span class="swatch" style="background:{}"></span>{}</span>'
    legend = "".join(swatch.format(c, k) for k, c in ACTION_COLORS.items())
    return head + "".join(out) + f'<div class="legend">{legend}</div></div>'
