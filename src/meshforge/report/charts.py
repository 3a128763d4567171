"""The report's line charts: series gathered from the runs here, drawn in the page by uPlot
(vendored under vendor/, MIT, inlined so the report opens offline and from file://).

Python builds one JSON spec per panel (title, unit, series, aligned data); the small script
below turns each into a uPlot chart with ticks and grid on both axes, a legend per series
(dashed series get a dashed marker), values in the panel's unit on the axis and on hover.
A panel whose series are all empty is left out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from importlib import resources
from typing import Any

MAX_POINTS = 2000  # per series: keeps a long run's report small
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")

# (metric key in metrics.jsonl, chart title, unit): units are drawn by UNIT_JS below
CHARTS = (
    ("lr", "learning rate", "sci"),
    ("grad_norm", "gradient norm", ""),
    ("tokens_per_s", "throughput (tokens/s, all ranks)", "tok/s"),
    ("step_time_s", "step time (mean since the previous logged step)", "s"),
    ("mfu", "MFU (model FLOPs utilization)", "%"),
    ("hfu", "HFU (hardware FLOPs utilization)", "%"),
    ("peak_mem_gib", "peak memory per rank", "GiB"),
    ("state_mem_gib", "model + optimizer state memory per rank", "GiB"),
)


@dataclass
class Series:
    label: str
    color: str
    points: list[tuple[float, float]]
    dashed: bool = False


def downsample(points: Sequence[tuple[float, float]], limit: int = MAX_POINTS) -> list[tuple[float, float]]:
    """At most ``limit`` finite points, evenly strided, always keeping the last one (the final value matters)."""
    pts = [(x, y) for x, y in points if isinstance(y, (int, float)) and math.isfinite(y)]
    if len(pts) <= limit:
        return pts
    stride = math.ceil(len(pts) / (limit - 1))
    return pts[::stride] + [pts[-1]]


def spec(metric: str, title: str, unit: str, series: Sequence[Series]) -> dict[str, Any] | None:
    """One panel for the page's script: x (the union of the series' steps) and one y column per
    series, None where a series has no point; None when no series has data."""
    kept = [Series(s.label, s.color, downsample(s.points), s.dashed) for s in series]
    kept = [s for s in kept if s.points]
    if not kept:
        return None
    xs = sorted({x for s in kept for x, _ in s.points})
    cols = []
    for s in kept:
        at = dict(s.points)
        cols.append([at.get(x) for x in xs])
    return {
        "metric": metric,
        "title": title,
        "unit": unit,
        "series": [{"label": s.label, "color": s.color, "dashed": s.dashed} for s in kept],
        "data": [xs, *cols],
    }


def script_json(value: Any) -> str:
    """JSON safe inside a <script> element (no "</script>", no HTML specials)."""
    text = json.dumps(value, allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def vendored() -> tuple[str, str]:
    """uPlot's script and stylesheet, from the package data."""
    base = resources.files("meshforge.report") / "vendor"
    return (base / "uPlot.iife.min.js").read_text(), (base / "uPlot.min.css").read_text()


# Formats a value in a panel's unit: on an axis with the decimals its tick step needs, on
# hover (the legend) in full. Each chart records its last tick labels in data-xticks /
# data-yticks (what a browser test reads; uPlot draws ticks on a canvas).
UNIT_JS = r"""
const dec = incr => Math.max(0, Math.min(8, -Math.floor(Math.log10(incr) + 1e-9)));
const num = (v, d) => v.toLocaleString("en-US", {minimumFractionDigits: d, maximumFractionDigits: d});
const BYTES = ["B", "KiB", "MiB", "GiB", "TiB"];
function bytes(v, ref, d) {
  const k = Math.min(4, Math.max(0, Math.floor(Math.log(Math.max(Math.abs(ref), 1)) / Math.log(1024))));
  return num(v / 1024 ** k, d) + " " + BYTES[k];
}
function axisFmt(unit, splits, incr) {
  const top = Math.max(...splits.map(v => Math.abs(v || 0)));
  return splits.map(v => {
    if (v == null) return "";
    if (unit === "%") return num(100 * v, dec(100 * incr)) + "%";
    if (unit === "s") return num(v, dec(incr)) + " s";
    if (unit === "GiB") return num(v, dec(incr)) + " GiB";
    if (unit === "B") return bytes(v, top, 1);
    if (unit === "sci") return v === 0 ? "0" : v.toExponential(Math.max(0, dec(incr) - dec(top)));
    return num(v, dec(incr));
  });
}
function hoverFmt(unit, v) {
  if (v == null) return "--";
  if (unit === "%") return num(100 * v, 2) + "%";
  if (unit === "tok/s") return num(Math.round(v), 0) + " tok/s";
  if (unit === "s") return num(v, 4) + " s";
  if (unit === "GiB") return num(v, 3) + " GiB";
  if (unit === "B") return bytes(v, v, 2);
  if (unit === "sci") return v.toExponential(3);
  return Math.abs(v) >= 1000 ? num(v, 1) : v.toPrecision(5);
}
const ySize = (u, values) => 16 + 7 * Math.max(3, ...(values || []).map(v => String(v).length));
function drawChart(el, c) {
  const ticks = {};
  const keep = (name, labels) => { el.dataset[name] = labels.filter(s => s).join("|"); return labels; };
  const axis = (name, fmt, label) => ({
    label, grid: {show: true, stroke: "#e4e4e4", width: 1}, ticks: {show: true, stroke: "#999", width: 1},
    values: (u, splits, ai, space, incr) => keep(name, fmt(splits, incr)),
  });
  const ylabel = c.unit === "tok/s" ? "tokens/s" : "";  // other units are on the tick labels
  const opts = {
    width: 560, height: 240, title: "", scales: {x: {time: false}},
    axes: [axis("xticks", (s, incr) => axisFmt("", s, Math.max(1, incr)), "step"),
           Object.assign(axis("yticks", (s, incr) => axisFmt(c.unit, s, incr), ylabel), {size: ySize})],
    legend: {markers: {dash: (u, i) => (u.series[i].dash ? "dashed" : "solid"), width: 3}},
    cursor: {points: {size: 6}},
    series: [{label: "step", value: (u, v) => (v == null ? "--" : String(v))}].concat(c.series.map(s => ({
      label: s.label, stroke: s.color, width: 1.5, dash: s.dashed ? [6, 4] : undefined, spanGaps: true,
      points: {show: c.data[0].length < 60}, value: (u, v) => hoverFmt(c.unit, v),
    }))),
  };
  opts.axes[0].incrs = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];
  el.uplot = new uPlot(opts, c.data, el.querySelector(".plot"));
}
function drawAll() {
  const specs = JSON.parse(document.getElementById("report-data").textContent);
  for (const c of specs) drawChart(document.querySelector(`.chart[data-metric="${c.metric}"]`), c);
  document.body.dataset.charts = "drawn";
}
drawAll();
"""


def panels(specs: Sequence[dict[str, Any]]) -> str:
    """The chart containers (the script fills them), in the specs' order."""
    return "".join(
        f'<div class="chart" data-metric="{escape(c["metric"])}"><h3>{escape(c["title"])}</h3>'
        '<div class="plot"></div></div>'
        for c in specs
    )


def page_script(specs: Sequence[dict[str, Any]]) -> str:
    """uPlot, the specs as JSON and the drawing script, all inline."""
    js, _ = vendored()
    return (
        f'<script type="application/json" id="report-data">{script_json(list(specs))}</script>\n'
        f"<script>{js}</script>\n<script>{UNIT_JS}</script>"
    )
