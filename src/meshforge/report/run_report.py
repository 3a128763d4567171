"""The HTML run report: read what a run directory holds (even a crashed run's partial files)
and write one self-contained page — curves (uPlot, inlined), where the wall time went, events,
config and the planner's prediction beside what was measured — that opens offline in any
browser, from file:// too."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from meshforge.errors import MeshforgeError
from meshforge.planner.hardware import PRESETS, THIS_CPU, preset_for_device
from meshforge.planner.plan import parse_plan_args, plan_from_args
from meshforge.report.breakdown import breakdown_html, event_row, predicted_html
from meshforge.report.charts import CHARTS, COLORS, Series, page_script, panels, spec, vendored
from meshforge.report.timeline import pipeline_timeline
from meshforge.safeio.files import MAX_JSONL_BYTES, read_regular
from meshforge.safeio.links import remove
from meshforge.safeio.parse import loads_json, read_json


@dataclass
class Run:
    """What one run directory holds; missing files leave their field empty."""

    path: Path
    name: str
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    config_text: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    prediction: dict[str, Any] | str | None = None  # predict()'s answer, once asked


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (a killed writer) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in read_regular(path, MAX_JSONL_BYTES).decode("utf-8", errors="replace").splitlines():
        try:
            rec = loads_json(line, str(path))  # (nested past MAX_DEPTH: skipped as a torn line is)
        except MeshforgeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _read_json(path: Path) -> Any:
    try:
        return read_json(path) if path.is_file() else None
    except MeshforgeError:
        return None


def load_run(path: str | Path) -> Run:
    """Read a run directory; refuse a directory that holds neither metrics nor events."""
    p = Path(path)
    if not (p / "metrics.jsonl").is_file() and not (p / "events.jsonl").is_file():
        raise MeshforgeError(f"{p} is not a meshforge run directory (it has no metrics.jsonl and no events.jsonl)")
    run = Run(p, p.resolve().name, read_jsonl(p / "metrics.jsonl"), read_jsonl(p / "events.jsonl"))
    if (p / "config.toml").is_file():
        run.config_text = config_text(p / "config.toml")
    summary = _read_json(p / "summary.json")
    run.summary = summary if isinstance(summary, dict) else {}
    run.timeline = _timeline_rows(_read_json(p / "pipeline_timeline.json"))
    return run


def _timeline_rows(tl: Any) -> list[dict[str, Any]]:
    """pipeline_timeline.json's rows, each with only well-formed actions (numbers for start and end):
    a damaged or hand-written file draws what it holds of a timeline, never a traceback."""
    rows = []
    for r in tl if isinstance(tl, list) else []:
        if isinstance(r, dict):
            acts = r.get("actions") if isinstance(r.get("actions"), list) else []
            ok = [a for a in acts if isinstance(a, dict) and all(_number(a.get(k)) for k in ("start", "end"))]
            rows.append({**r, "actions": ok})
    return rows


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


MAX_CONFIG_BYTES = 1 << 20  # a config.toml is a few KiB; more is not a config


def config_text(path: Path) -> str:
    """config.toml as the report shows it: its text, or a word why it is not shown (not UTF-8
    text, control characters, too large) -- never a binary file dropped into the page."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            return f"(config.toml not shown: {size:,} bytes, more than a config holds)"
        text = read_regular(path, MAX_CONFIG_BYTES).decode("utf-8")
    except OSError as e:
        return f"(config.toml not shown: {e.strerror or e})"
    except MeshforgeError:  # a FIFO or device put there, or grown past the cap since
        return "(config.toml not shown: it is not a regular file of a config's size)"
    except UnicodeDecodeError:
        return "(config.toml not shown: it is not UTF-8 text; the file is damaged or not a config)"
    if any(ord(c) < 32 and c not in "\t\n\r" or ord(c) == 127 for c in text):
        return "(config.toml not shown: it holds control characters; the file is damaged or not a config)"
    return text


def _timeline_caption(ev: dict[str, Any]) -> str:
    """The measured step's schedule and bubble, from its ``pipeline_gantt`` event (if it says)."""
    if "schedule" not in ev:
        return ""
    chunks = f" x {ev['chunks']} chunks" if ev.get("chunks", 1) > 1 else ""
    return (
        f" -- {ev['schedule']}, pp={ev.get('pp')}{chunks}, m={ev.get('microbatches')}, step {ev.get('step')}: "
        f"measured bubble {ev.get('bubble', 0):.3f} (theory {ev.get('bubble_theory', 0):.3f})"
    )


def _event(run: Run, name: str) -> dict[str, Any]:
    return next((e for e in run.events if e.get("event") == name), {})


def _gpu_for(run: Run) -> str:
    """The planner's hardware for the run's device: a CPU run's is this CPU's measured figures
    (``this-cpu``: the report is made where the run ran), a GPU's its preset by name, else the CUDA
    preset whose peak matches the peak FLOPs the run measured with."""
    start = _event(run, "run_start")
    device = str(start.get("device_name") or start.get("device") or "cpu")
    preset = preset_for_device(device)
    if preset == "cpu":
        return THIS_CPU
    if preset != "h100-sxm" or "h100" in device.lower():
        return preset
    peak, precision = start.get("peak_flops"), start.get("precision", "bf16")
    for name, hw in PRESETS.items():
        if peak and name != "cpu" and abs(hw.peak_flops.get(precision, 0) - peak) < 1e-3 * peak:
            return name
    return preset


def predict(run: Run) -> dict[str, Any] | str:
    """The planner's estimate for this run's exact layout, or the reason there is none (asked once)."""
    if run.prediction is None:
        run.prediction = _predict(run)
    return run.prediction


def _predict(run: Run) -> dict[str, Any] | str:
    cfg = run.path / "config.toml"
    if not cfg.is_file():
        return "no config.toml in the run directory"
    world = _event(run, "run_start").get("world_size") or 1
    if type(world) is not int or world < 1:
        return f"the run's world size ({world!r}, events.jsonl) is not a number of ranks"
    gpu = _gpu_for(run)
    try:
        pl = plan_from_args(parse_plan_args(["--config", str(cfg), "--gpus", str(world), "--gpu", gpu]))
        best = pl.results[0] if pl.results else (pl.results.refused[0] if pl.results.refused else None)
    except (MeshforgeError, ValueError, KeyError, ZeroDivisionError) as e:
        return f"the planner could not estimate this run: {e}"
    except SystemExit:
        return "the planner could not read this run's config"
    if best is None:
        return "the planner found no layout for this run's config"
    mem = best.memory["total"]
    out = {"gpu": gpu, "world": world, "step_time_s": best.step_time_s, "mfu": best.mfu, "mem_gib": mem}
    return out | {"budget": best.budget}


def status(run: Run) -> str:
    """How the run ended, from its events."""
    kinds = [e.get("event") for e in run.events]
    if "failure" in kinds:
        return "failed"
    if "run_end" in kinds:
        return "interrupted" if _event(run, "run_end").get("interrupted") else "finished"
    if "interrupted" in kinds:
        return "interrupted"
    return "incomplete (no run_end: killed, or still running)"


def _series(runs: list[Run], key: str) -> list[Series]:
    return [
        Series(r.name, COLORS[i % len(COLORS)], [(m["step"], m[key]) for m in r.metrics if "step" in m and key in m])
        for i, r in enumerate(runs)
    ]


def _loss_series(runs: list[Run]) -> list[Series]:
    out = []
    for i, r in enumerate(runs):
        c = COLORS[i % len(COLORS)]
        out.append(Series(f"{r.name} loss", c, [(m["step"], m["loss"]) for m in r.metrics if "loss" in m]))
        evals = [(e["step"], e["val_loss"]) for e in r.events if e.get("event") == "eval" and "val_loss" in e]
        out.append(Series(f"{r.name} val loss", c, evals, dashed=True))
    return out


def _comm_series(runs: list[Run]) -> list[Series]:
    out, n = [], 0
    for r in runs:
        axes = sorted({a for m in r.metrics for a in (m.get("comm_bytes") or {})})
        for axis in axes:
            pts = [(m["step"], m["comm_bytes"][axis]) for m in r.metrics if axis in (m.get("comm_bytes") or {})]
            out.append(Series(f"{r.name} {axis}", COLORS[n % len(COLORS)], pts))
            n += 1
    return out


def charts(runs: list[Run]) -> list[dict[str, Any]]:
    """Every metric's chart spec, all runs overlaid; metrics no run has are left out."""
    out = [spec("loss", "loss (solid) and validation loss (dashed)", "", _loss_series(runs))]
    out += [spec(key, title, unit, _series(runs, key)) for key, title, unit in CHARTS]
    out.append(spec("comm_bytes", "communication bytes per step, by mesh axis", "B", _comm_series(runs)))
    return [c for c in out if c is not None]


def _fmt(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "—"


def _measured(run: Run) -> dict[str, Any]:
    """Steady-state figures: medians past the first logged step (compile, caches)."""
    steady = run.metrics[1:] or run.metrics

    def med(key: str) -> float | None:
        vals = [m[key] for m in steady if isinstance(m.get(key), (int, float))]
        return statistics.median(vals) if vals else None

    mems = [m["peak_mem_gib"] for m in run.metrics if isinstance(m.get("peak_mem_gib"), (int, float))]
    last = run.metrics[-1]["loss"] if run.metrics and "loss" in run.metrics[-1] else None
    return {"step_time_s": med("step_time_s"), "mfu": med("mfu"), "mem_gib": max(mems) if mems else None, "loss": last}


def overview(runs: list[Run]) -> str:
    """One row per run: how it ended, final loss, measured against predicted."""
    rows = []
    for i, r in enumerate(runs):
        m, p = _measured(r), predict(r)
        steps = r.metrics[-1].get("step") if r.metrics else None
        swatch = f'<span class="swatch" style="background:{COLORS[i % len(COLORS)]}"></span>'
        pred = (
            [_fmt(p["step_time_s"], ".4f"), _fmt(100 * p["mfu"], ".2f") + "%", _fmt(p["mem_gib"], ".3f")]
            if isinstance(p, dict)
            else [f'<span class="err">{escape(p)}</span>', "", ""]
        )
        hw = escape(f"{p['world']} x {p['gpu']}") if isinstance(p, dict) else ""
        cells = [
            f"{swatch}{escape(r.name)}<br><small>{escape(str(r.path))}</small>",
            escape(status(r)),
            escape(str(steps if steps is not None else "—")),
            _fmt(m["loss"], ".4f"),
            _fmt(r.summary.get("final_loss"), ".4f"),
            _fmt(r.summary.get("val_loss"), ".4f"),
            _fmt(m["step_time_s"], ".4f"),
            pred[0],
            _fmt(100 * m["mfu"], ".2f") + "%" if m["mfu"] is not None else "—",
            pred[1],
            _fmt(m["mem_gib"], ".3f"),
            pred[2],
            hw,
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = (
        "run,status,last step,last loss,final loss (mean of last steps),val loss,step time s (measured),"
        "step time s (planner),MFU (measured),MFU (planner),peak mem GiB (measured),mem GiB/GPU (planner),"
        "planner hardware"
    ).split(",")
    return (
        '<table class="overview"><tr>' + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>" + "".join(rows)
    ) + "</table>"


EVENT_KINDS = ("run_start", "checkpoint_saved", "resumed", "restart", "interrupted", "failure", "run_end", "eval")
EVENT_KINDS += ("nonfinite", "loss_spike", "hang", "straggler", "rollback", "data_not_text", "checkpoint_skipped")


def events_table(run: Run) -> str:
    """The run's events in order, times relative to the first; the listed kinds are highlighted."""
    if not run.events:
        return "<p>no events.jsonl</p>"
    t0 = next((e["time"] for e in run.events if isinstance(e.get("time"), (int, float))), 0.0)
    rows = "".join(event_row(e, t0, e.get("event") in EVENT_KINDS) for e in run.events)
    head = "<tr><th>time (s)</th><th>step</th><th>event</th><th>details</th></tr>"
    return f'<table class="events">{head}{rows}</table>'


CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1240px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}h3{font-size:.95em;margin:.3em 0}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:3px 6px;vertical-align:top}
th{background:#f4f4f4}.charts{display:flex;flex-wrap:wrap;gap:12px}.chart{border:1px solid #eee;padding:6px}
.tick{font-size:10px;fill:#555}.legend{font-size:.8em}.key{margin-right:1em;white-space:nowrap}
.swatch{display:inline-block;width:10px;height:10px;margin-right:4px}.err{color:#b00}
tr.key-event td.event{font-weight:bold}pre{background:#f8f8f8;padding:8px;font-size:.8em;overflow:auto}
.nodata{color:#888}td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.field{display:inline-block;margin-right:1em}.field b{font-weight:600;color:#555}
.stack{display:flex;height:22px;width:600px;border:1px solid #ccc;margin:4px 0 8px}.stack .part{height:100%}
.u-legend td,.u-legend th{border:none;background:none}.u-legend{font-size:12px}
.u-legend .u-marker{width:18px;height:0;border-width:3px 0 0 0!important}
"""


def _breakdowns(runs: list[Run]) -> list[str]:
    parts = [breakdown_html(r.name, r.summary.get("time_breakdown") or {}) for r in runs]
    parts = [p for p in parts if p]
    if not parts:
        return []
    note = (
        "<p><small>From summary.json: every step's host time split in the proportions measured on the "
        "logged steps; checkpoints, evaluation and logging timed on the host; other is the rest.</small></p>"
    )
    return ["<h2>Where the wall time went</h2>", note, *parts]


def _predicted(runs: list[Run]) -> list[str]:
    parts = []
    for r in runs:
        p = predict(r)
        if isinstance(p, dict):
            parts.append(predicted_html(r.name, p["step_time_s"], p.get("budget") or {}))
    parts = [p for p in parts if p]
    if not parts:
        return []
    note = (
        "<p><small>The planner's step for this run's exact layout (<code>meshforge plan --config</code>), "
        "term by term: exposed communication is what compute does not hide.</small></p>"
    )
    return ["<h2>Where the planner says a step goes</h2>", note, *parts]


def build_html(runs: list[Run]) -> str:
    """The whole page for one or more runs (their curves overlaid, one colour per run)."""
    names = ", ".join(r.name for r in runs)
    specs = charts(runs)
    _, css = vendored()
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>meshforge report: {escape(names)}</title>",
        f"<style>{css}</style><style>{CSS}</style></head><body><h1>meshforge run report: {escape(names)}</h1>",
        "<h2>Overview: measured and predicted</h2>",
        overview(runs),
        "<p><small>Measured: medians past the first logged step; planner: <code>meshforge plan --config "
        "RUN_DIR/config.toml --gpus WORLD</code> for that exact layout.</small></p>",
        '<h2>Curves</h2><p><small>Hover a chart for the values at a step.</small></p><div class="charts">',
        panels(specs) if specs else '<p class="nodata">no logged steps</p>',
        "</div>",
        *_breakdowns(runs),
        *_predicted(runs),
    ]
    for r in runs:
        if r.timeline:
            title = f"{r.name}: pipeline timeline (one measured step; F forward, B backward, W weight gradient)"
            title += _timeline_caption(_event(r, "pipeline_gantt"))
            parts += ["<h2>Pipeline timeline</h2>", pipeline_timeline(r.timeline, title)]
    for r in runs:
        parts += [f"<h2>Events: {escape(r.name)}</h2>", events_table(r)]
    for r in runs:
        body = escape(r.config_text) if r.config_text else "(no config.toml)"
        parts.append(f"<h2>Config: {escape(r.name)}</h2><details open><summary>config.toml</summary>")
        parts.append(f'<pre class="config">{body}</pre></details>')
    parts += [page_script(specs), "</body></html>\n"]
    return "\n".join(parts)


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write the report of ``run_dirs`` to ``out`` (default: the first run's report.html)."""
    if not run_dirs:
        raise MeshforgeError("give at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    path = Path(out) if out else runs[0].path / "report.html"
    html = build_html(runs)
    part = path.with_name(f".{path.name}.part")  # never a half-written (or 0-byte) report: write, then rename
    try:
        remove(part)  # a stale one goes; a link put at the temporary name is refused, never written through
        part.write_text(html)
        part.replace(path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return path
