"""The pipeline step as a Gantt chart (inline SVG): one lane per pipeline rank, a rectangle per
F/B/W action with hover text, a millisecond axis with ticks and grid lines."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

ACTION_COLORS = {"F": "#4c9be8", "B": "#e8894c", "W": "#6cc36c"}
LANE, WIDTH, LEFT = 28, 900, 70


def nice_step(span: float, target: int = 8) -> float:
    """A 1/2/5 x 10^k tick step giving about ``target`` ticks over ``span``."""
    raw = span / target
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _ticks(span_ms: float, top: float, bottom: float) -> list[str]:
    step = nice_step(span_ms)
    out, t = [], 0.0
    while t <= span_ms * (1 + 1e-9):
        x = LEFT + t / span_ms * WIDTH
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}" stroke="#e4e4e4"/>')
        label = f"{t:.{max(0, -math.floor(math.log10(step)))}f} ms"
        out.append(f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle" class="tick">{label}</text>')
        t += step
    return out


def pipeline_timeline(rows: Sequence[dict], title: str) -> str:
    """The chart: rectangles of class "action" (data-kind F/B/W), a title per rectangle naming
    the micro-batch, chunk and duration."""
    actions = [a for r in rows for a in r.get("actions", [])]
    head = f'<div class="chart timeline"><h3>{escape(title)}</h3>'
    if not actions:
        return head + '<p class="nodata">no pipeline actions recorded</p></div>'
    t0 = min(a["start"] for a in actions)
    span = max(a["end"] for a in actions) - t0 or 1e-3
    lanes = LANE * len(rows) + 4
    height = lanes + 22
    out = [
        f'<svg class="timeline-svg" data-metric="pipeline_timeline" viewBox="0 0 {WIDTH + LEFT + 30} {height}" '
        f'width="{WIDTH + LEFT + 30}" height="{height}" xmlns="http://www.w3.org/2000/svg" role="img">',
        *_ticks(1e3 * span, 0, lanes),
    ]
    for i, r in enumerate(rows):
        y = 4 + i * LANE
        out.append(f'<text x="4" y="{y + LANE / 2 + 4}" class="tick">rank {escape(str(r.get("rank", i)))}</text>')
        for a in r.get("actions", []):
            x = LEFT + (a["start"] - t0) / span * WIDTH
            w = max(0.5, (a["end"] - a["start"]) / span * WIDTH)
            kind = str(a.get("kind", "?"))
            ms = 1e3 * (a["end"] - a["start"])
            tip = f"{kind} micro-batch {a.get('microbatch')} chunk {a.get('chunk')}: {ms:.2f} ms"
            out.append(
                f'<rect class="action" data-kind="{escape(kind)}" x="{x:.1f}" y="{y}" width="{w:.1f}" '
                f'height="{LANE - 6}" fill="{ACTION_COLORS.get(kind, "#999")}" stroke="#fff" stroke-width="0.5">'
                f"<title>{escape(tip)}</title></rect>"
            )
    out.append("</svg>")
    swatch = '<span class="key"><span class="swatch" style="background:{}"></span>{}</span>'
    names = {"F": "F forward", "B": "B backward", "W": "W weight gradient"}
    legend = "".join(swatch.format(c, names[k]) for k, c in ACTION_COLORS.items())
    return head + "".join(out) + f'<div class="legend">{legend}</div></div>'
