"""What one rank's run says about itself: events and console lines (rank 0 writes them; the
other ranks' calls do nothing), the run_start announcement (the fp8 boundary, the compile
plan, what the resolution changed), each logged step's record or an unlogged step's
slow-step note, evaluations, and the end-of-run summary. The trainer holds one and hands its
``event``/``say`` to the parts that report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from meshforge.checkpoint.continuing import resume_hint
from meshforge.config.run_plan import RunPlan
from meshforge.data.dataset import TokenDataset
from meshforge.metrics.cpu_peak import estimated_cpu_peak, recheck
from meshforge.metrics.logged_steps import slow_step_line
from meshforge.metrics.mfu import peak_flops
from meshforge.metrics.sinks import MetricsLogger
from meshforge.metrics.step_metrics import StepMetrics, end_line, start_line
from meshforge.metrics.step_result import StepResult
from meshforge.metrics.time_breakdown import PhaseTimer, run_breakdown
from meshforge.models.flops import num_params
from meshforge.parallel.compile import compile_plan_event
from meshforge.parallel.fp8 import fp8_emulated, model_fp8_plan, unmatched_warnings
from meshforge.parallel.mesh import Mesh
from meshforge.safeio.links import write_new


class RunLog:
    """The run's voice: event/say, step records, evaluations and the summary."""

    def __init__(self, plan: RunPlan, mesh: Mesh, stream: TextIO | None = None):
        self.plan, self.mesh = plan, mesh
        self.logger: MetricsLogger | None = None
        if mesh.is_main:
            m = plan.metrics
            self.logger = MetricsLogger(Path(plan.run.dir), plan.train.steps, m.console, m.jsonl, m.tensorboard, stream)
        self.peak = peak_flops(mesh.device, plan.train.precision)
        self._rechecked = False  # the CPU peak was measured again once already (_peak_beaten)
        self.metrics = StepMetrics(plan, plan.shape, mesh.world_size, self.peak, mesh.device)
        self.phases = PhaseTimer()  # host time of checkpoint, eval and logging (time_breakdown)

    def event(self, name: str, **fields: Any) -> None:
        if self.logger:
            self.logger.event(name, **fields)

    def say(self, text: str) -> None:
        if self.logger:
            self.logger.print(text)

    def announce(self, model: nn.Module, data: TokenDataset) -> None:
        """The run_start event and line; what resolution changed, the fp8 boundary and the compile plan."""
        plan, device = self.plan, self.mesh.device
        params = num_params(plan.shape)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        precision = plan.train.precision
        world = self.mesh.world_size
        start = {"world_size": world, "device": str(device), "device_name": name, "precision": precision}
        self.event("run_start", **start, params=params, peak_flops=self.peak, plan=plan.decisions())
        self.say(start_line(plan, params, world, device, precision, data))
        for change in plan.changes:  # what the resolution set differently from the config, and why
            self.event("config_changed", key=change.key, given=change.given, used=change.used, reason=change.reason)
            self.say(f"note: {change.line()}")
        self._say_if_no_evaluation(data)
        if precision == "fp8":
            self._announce_fp8()
        if plan.train.compile:  # which blocks compile whole, and why the others do not
            self.event("compile", **compile_plan_event(list(getattr(model, "layers", {}).values())))

    def _say_if_no_evaluation(self, data: TokenDataset) -> None:
        """Evaluation asked for, but the validation split is smaller than one global batch."""
        t = self.plan.train
        if t.eval_batches and len(data.val) < t.global_batch_size:
            line = (
                f"no evaluation: the validation split holds {len(data.val)} sequences of {t.seq_len + 1} tokens, "
                f"fewer than one global batch ({t.global_batch_size}); {_more_validation(self.plan.data.path)}"
            )
            self.event("warning", key="train.eval_batches", message=line)
            self.say(f"note: {line}")

    def _announce_fp8(self) -> None:
        """The fp8 boundary as an event (every converted and excluded module, and why), and
        exclude patterns that match nothing as warnings."""
        t = self.plan.train
        fp8 = model_fp8_plan(self.plan.shape, list(t.fp8_exclude))
        emulated = fp8_emulated(self.mesh.device)
        self.event("fp8_modules", recipe=t.fp8_recipe, emulated=emulated, **fp8.as_event())
        for line in unmatched_warnings(fp8):
            self.event("warning", key="train.fp8_exclude", message=line)
            self.say(f"warning: {line}")

    def step(self, n: int, result: StepResult, tokens_seen: int, dt: float, extra: dict[str, Any] | None) -> None:
        """Book step ``n``; with ``extra`` (a measured, logged step's figures) record and write it,
        else a word if it was slow."""
        self.metrics.add(dt, result)
        if extra is None:
            slow = slow_step_line(n, self.plan.train.steps, dt, self.plan.metrics.log_interval)
            if slow:
                self.say(slow)
            return
        rec = self.metrics.record(n, tokens_seen, result, extra)
        if self.logger:
            if self.mesh.device.type == "cpu" and max(rec["mfu"], rec["hfu"]) > 1:
                self._peak_beaten(rec)
            self.logger.log_step(rec)

    def _peak_beaten(self, rec: dict[str, Any]) -> None:
        """A step beat the CPU's cached peak (MFU > 100%: the peak was measured while the cores
        were busy): measure it again once, else take the estimate (metrics/cpu_peak.py); say so."""
        old, precision = self.peak, self.plan.train.precision
        reached = rec["hfu"] * old  # the hardware FLOP/s per device this step reached
        if self._rechecked:
            new, how = max(estimated_cpu_peak(precision), reached), "estimate"
        else:
            new, how = recheck(precision, reached)
        self._rechecked = True
        self.peak = self.metrics.peak = new
        rec["mfu"], rec["hfu"] = rec["mfu"] * old / new, rec["hfu"] * old / new
        self.event("peak_flops", old=old, new=new, source=how, reached=reached, step=rec["step"])
        self.say(
            f"note: step {rec['step']} reached {reached / 1e9:.3g} GFLOP/s per device, more than the CPU peak cached "
            f"for this machine ({old / 1e9:.3g} GFLOP/s: measured while the cores were busy?); MFU now against the "
            f"peak {'measured again' if how != 'estimate' else 'estimated from cores x clock x FLOPs per cycle'}: "
            f"{new / 1e9:.3g} GFLOP/s"
        )

    def evaluation(self, step: int, loss: float | None) -> None:
        if self.logger and loss is not None:
            self.logger.log_eval(step, loss)

    def summary(self, reduce_loss: Any, interrupted: bool, wall: float, **fields: Any) -> dict[str, Any]:
        """The run's summary (a collective: ``reduce_loss`` reduces the kept losses); rank 0
        writes summary.json. ``fields``: steps, tokens, val_loss."""
        m = self.metrics
        summary = m.summary(reduce_loss, interrupted=interrupted, wall_time_s=wall, **fields)
        summary["time_breakdown"] = run_breakdown(wall, sum(m.times), m.breakdown_sum, self.phases.totals)
        if self.mesh.is_main:
            write_new(Path(self.plan.run.dir) / "summary.json", json.dumps(summary, indent=1))
        return summary

    def finish(self, summary: dict[str, Any]) -> None:
        """The run_end event and the last lines (after the final weights are written)."""
        self.event("run_end", **summary)
        self.say(end_line(summary, self.plan.run.dir))
        self.say(resume_hint(self.plan, self.mesh.world_size, not summary["interrupted"], summary["steps"]))

    def close(self) -> None:
        if self.logger:
            self.logger.close()


def _more_validation(path: str) -> str:
    """How to get a larger validation split: data.val_fraction splits raw text as it is prepared,
    so it does nothing to shards that `meshforge data prepare` already split."""
    if path and (Path(path) / "index.json").is_file():
        return (
            f"{path} holds prepared shards, split when they were prepared (data.val_fraction does not apply to "
            f"them): prepare the text again with a larger --val-fraction, or add data"
        )
    return "raise data.val_fraction or add data"
