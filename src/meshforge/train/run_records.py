"""What one rank's run says about itself, outside the step: the run_start announcement
(with the fp8 boundary and the compile plan), each step's record or slow-step note, and
the end-of-run summary. Split out of train/loop.py, which calls them with itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from meshforge.metrics.progress import slow_step_line
from meshforge.metrics.step_metrics import end_line, resume_hint, start_line
from meshforge.metrics.time_breakdown import run_breakdown
from meshforge.models.flops import num_params
from meshforge.parallel.compile import compile_plan_event
from meshforge.parallel.fp8 import fp8_emulated, model_fp8_plan, unmatched_warnings

if TYPE_CHECKING:  # the Trainer's view, so this module types it without importing train/loop.py
    from meshforge.health.trainer_view import TrainerView as Trainer
    from meshforge.train.step import StepResult


def announce(tr: Trainer) -> None:
    """The run_start event and line; the fp8 boundary and the compile plan when they apply."""
    params = num_params(tr.args)
    tr.event(
        "run_start",
        world_size=tr.mesh.world_size,
        device=str(tr.device),
        device_name=torch.cuda.get_device_name(tr.device) if tr.device.type == "cuda" else "cpu",
        precision=tr.precision,
        params=params,
        peak_flops=tr.peak,
    )
    tr.say(start_line(tr.cfg, params, tr.mesh.world_size, tr.device, tr.precision, tr.accum, tr.micro, tr.data))
    if tr.precision == "fp8":
        announce_fp8(tr)
    if tr.cfg.train.compile:  # which blocks compile whole, and why the others do not
        tr.event("compile", **compile_plan_event(list(getattr(tr.model, "layers", {}).values())))
    for change in tr.plan.changes:  # what the resolution set differently from the config, and why
        tr.event("config_changed", key=change.key, given=change.given, used=change.used, reason=change.reason)
        tr.say(f"note: {change.line()}")


def announce_fp8(tr: Trainer) -> None:
    """The fp8 boundary as an event (every converted and excluded module, and why), and
    exclude patterns that match nothing as warnings."""
    plan = model_fp8_plan(tr.args, tr.cfg.train.fp8_exclude)
    emulated = fp8_emulated(tr.device)
    tr.event("fp8_modules", recipe=tr.cfg.train.fp8_recipe, emulated=emulated, **plan.as_event())
    for line in unmatched_warnings(plan):
        tr.event("warning", key="train.fp8_exclude", message=line)
        tr.say(f"warning: {line}")


def log_step(tr: Trainer, n: int, result: StepResult, logged: bool, dt: float) -> None:
    """Record and write logged step ``n``; a word on an unlogged step that was slow."""
    if not logged:
        slow = slow_step_line(n, tr.cfg.train.steps, dt, tr.cfg.metrics.log_interval)
        if slow:
            tr.say(slow)
        return
    extra = {"comm_bytes_by_kind": tr.comm_bytes, "pp_stats": tr.pp_stats, "moe": tr.moe_stats}
    rec = tr.metrics.record(n, tr.state.tokens_seen, result, extra)
    if tr.logger:
        tr.logger.log_step(rec)


def finish_run(tr: Trainer, interrupted: bool, wall: float, val_loss: float | None) -> dict[str, Any]:
    """The run's summary (summary.json, the run_end event, the last lines) after the final
    weights are exported; returns it."""
    st = tr.state
    summary = tr.metrics.summary(
        tr.runner.reduce_loss,
        steps=st.step,
        interrupted=interrupted,
        tokens=st.tokens_seen,
        wall_time_s=wall,
        val_loss=val_loss,
    )
    parts = tr.metrics.breakdown_sum
    summary["time_breakdown"] = run_breakdown(wall, sum(tr.metrics.times), parts, tr.phases.totals)
    if tr.mesh.is_main:
        (Path(tr.cfg.run.dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    tr.checkpoints.export_final(pipelined=tr.pipeline is not None)
    tr.event("run_end", **summary)
    tr.say(end_line(summary, tr.cfg.run.dir))
    tr.say(resume_hint(tr.cfg, tr.mesh.world_size, finished=not interrupted))
    return summary
