"""Where a run's wall time went (summary.json's ``time_breakdown``), as a stacked bar and a
table, and the run's events as a readable table."""

from __future__ import annotations

import math
from html import escape
from typing import Any

PARTS = (
    ("compute_s", "compute", "#4c9be8"),
    ("exposed_comm_s", "exposed communication", "#e8894c"),
    ("bubble_s", "pipeline bubble", "#c9c9c9"),
    ("data_s", "data loading", "#6cc36c"),
    ("optimizer_s", "optimizer step", "#9467bd"),
    ("checkpoint_s", "checkpoints", "#8c564b"),
    ("eval_s", "evaluation", "#e377c2"),
    ("logging_s", "logging and measurement", "#17becf"),
    ("other_s", "other (per-step checks and measurement, the loop itself)", "#7f7f7f"),
)


def _stack(rows: list[tuple[str, float, str]], whole: float, digits: int) -> tuple[str, str]:
    """A stacked bar and its table rows: (label, seconds, colour) as shares of ``whole`` seconds."""
    bar = "".join(
        f'<div class="part" style="width:{100 * s / whole:.3f}%;background:{c}" '
        f'title="{escape(label)}: {s:,.{digits}f} s ({100 * s / whole:.1f}%)"></div>'
        for label, s, c in rows
    )
    body = "".join(
        f'<tr><td><span class="swatch" style="background:{c}"></span>{escape(label)}</td>'
        f'<td class="num">{s:,.{digits}f}</td><td class="num">{100 * s / whole:.1f}%</td></tr>'
        for label, s, c in rows
    )
    return bar, body


def breakdown_html(name: str, tb: dict[str, Any]) -> str:
    """One run's whole-run breakdown; empty when its summary predates ``wall_s``."""
    wall = tb.get("wall_s")
    if not isinstance(wall, (int, float)) or wall <= 0:
        return ""
    rows = [(label, float(tb.get(key, 0.0)), color) for key, label, color in PARTS if tb.get(key, 0) >= 0.005]
    bar, body = _stack(rows, wall, 2)
    total = sum(s for _, s, _ in rows)
    body += _axis_rows(tb, wall)
    return (
        f'<div class="breakdown" data-run="{escape(name)}"><h3>{escape(name)}: {wall:,.1f} s wall time</h3>'
        f'<div class="stack">{bar}</div><table class="breakdown-table"><tr><th>part</th><th>seconds</th>'
        f"<th>share of wall time</th></tr>{body}<tr><th>total</th><th class='num'>{total:,.2f}</th>"
        f"<th class='num'>{100 * total / wall:.1f}%</th></tr></table></div>"
    )


def _axis_rows(tb: dict[str, Any], wall: float) -> str:
    """Table rows for each mesh axis's part of the exposed communication (``exposed_comm_<axis>_s``),
    largest first; they are inside "exposed communication", not added to the total."""
    axes = sorted(
        (
            (k[len("exposed_comm_") : -2], float(v))
            for k, v in tb.items()
            if k.startswith("exposed_comm_") and k != "exposed_comm_s" and isinstance(v, (int, float))
        ),
        key=lambda kv: -kv[1],
    )
    return "".join(
        f'<tr class="axis-part"><td>&nbsp;&nbsp;of which on {escape(axis)}</td><td class="num">{s:,.2f}</td>'
        f'<td class="num">{100 * s / wall:.1f}%</td></tr>'
        for axis, s in axes
        if s >= 0.005
    )


# the planner's step terms (planner/estimate.py ``_budget``), in the order it adds them
PREDICTED = (
    ("useful_at_peak", "model FLOPs at peak", "#4c9be8"),
    ("matmul_inefficiency", "matmuls below peak", "#9cc3ee"),
    ("recompute", "recomputation", "#1f5f99"),
    ("non_gemm", "element-wise and norms", "#6cc36c"),
    ("tp_exposed", "exposed tp communication", "#e8894c"),
    ("cp_exposed", "exposed cp communication", "#d95f02"),
    ("pp_p2p", "pipeline sends", "#f2b880"),
    ("ep_a2a", "expert all-to-all", "#b35806"),
    ("dp_exposed", "exposed dp communication", "#e34a33"),
    ("offload_exposed", "exposed offload copies", "#8c564b"),
    ("bubble", "pipeline bubble", "#c9c9c9"),
    ("optimizer", "optimizer step", "#9467bd"),
)


def predicted_html(name: str, step_s: float, budget: dict[str, float]) -> str:
    """The planner's predicted step for this run's layout, term by term (why it predicts that)."""
    rows = [(label, step_s * budget.get(k, 0.0), c) for k, label, c in PREDICTED if budget.get(k, 0.0) >= 5e-4]
    if step_s <= 0 or not rows:
        return ""
    bar, body = _stack(rows, step_s, 4)
    return (
        f'<div class="predicted" data-run="{escape(name)}"><h3>{escape(name)}: {step_s:,.4f} s per step '
        f'predicted</h3><div class="stack">{bar}</div><table class="predicted-table"><tr><th>term</th>'
        f"<th>seconds</th><th>share of the step</th></tr>{body}</table></div>"
    )


def fmt_value(v: Any, depth: int = 0) -> str:
    """A field value for people: floats to 4 significant digits, big integers with separators,
    dicts as key=value, long lists cut."""
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 1e5 else f"{v:.4g}"
    if isinstance(v, dict):
        if depth > 1:
            return "{…}"
        items = [f"{k}={fmt_value(x, depth + 1)}" for k, x in list(v.items())[:12]]
        return "{" + ", ".join(items) + (", …" if len(v) > 12 else "") + "}"
    if isinstance(v, (list, tuple)):
        items = [fmt_value(x, depth + 1) for x in v[:8]]
        return "[" + ", ".join(items) + (f", … {len(v)} in all" if len(v) > 8 else "") + "]"
    text = str(v)
    return text if len(text) <= 300 else text[:300] + " …"


PERCENT_FIELDS = ("mfu", "hfu")  # fractions in events.jsonl, shown in % as the overview and charts show them


def _field(key: str, v: Any) -> str:
    if key in PERCENT_FIELDS and isinstance(v, float) and math.isfinite(v):
        return f"{100 * v:.2f}%"
    return fmt_value(v)


def event_row(e: dict[str, Any], t0: float, key: bool) -> str:
    """One event: time since the run's first event, its step, its kind, its other fields."""
    t = e.get("time")
    when = f"{t - t0:,.1f}" if isinstance(t, (int, float)) else "—"
    step = e.get("step")
    fields = [(k, x) for k, x in e.items() if k not in ("time", "event", "step")]
    details = "".join(f'<span class="field"><b>{escape(str(k))}</b> {escape(_field(k, x))}</span>' for k, x in fields)
    cls = ' class="key-event"' if key else ""
    return (
        f'<tr{cls}><td class="num">{when}</td><td class="num">{escape(str(step)) if step is not None else ""}</td>'
        f'<td class="event">{escape(str(e.get("event", "?")))}</td><td>{details}</td></tr>'
    )
