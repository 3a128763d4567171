"""The trainer's health part: wires the step guard into the runner, times each rank's
forward for the straggler check, runs the hang watchdog, and reports what they found (one
event and one console warning on rank 0): a skip is already done by the guard, a stop is
raised here, a rollback is asked of the trainer. The detectors live beside it in health/.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshforge.config.run_plan import RunPlan
from meshforge.errors import MeshforgeError
from meshforge.health.fault_hooks import RunHooks
from meshforge.health.guard import StepGuard
from meshforge.health.sdc import Across, SdcCheck
from meshforge.health.straggler import StragglerCheck
from meshforge.health.text_check import not_text_files
from meshforge.health.watchdog import HangWatchdog
from meshforge.launch import env as launch_env
from meshforge.parallel.data.apply import replica_group
from meshforge.parallel.mesh import Mesh

OVERSUBSCRIBED = (
    "the straggler check is off: this node's CPU ranks outnumber its {} cores, so they take turns on them and a "
    "rank's compute time measures the sharing, not the rank"
)


class HealthStop(MeshforgeError):
    """The run was stopped by a health check (health.on_nonfinite = stop, or too many bad steps)."""

    every_rank = True  # the guard's verdict is agreed: every rank stops at the same step


def describe(v: dict[str, Any]) -> str:
    """The one console line for a health event: what happened and what was done."""
    done = {"skip": "skipped the update", "stop": "stopping the run", "rollback": "rolling back", "log": "logged"}
    if v["event"] == "nonfinite":
        what = f"non-finite {' and '.join(v['where'])} at step {v['step']} on rank(s) {v['ranks']}"
        if v.get("param"):
            what += f" (first in {v['param']} on rank {v['param_rank']})"
    elif v["event"] == "loss_spike":
        what = f"loss spike at step {v['step']}: {v['loss']:.4g} is {v['score']} deviations above {v['median']:.4g}"
    elif v["event"] == "sdc":
        who = f"rank(s) {v['ranks']}" + (f" on {', '.join(v['hosts'])}" if v["hosts"] else "")
        who += f", replica group(s) {v['replicas']}" if v.get("replicas") else ""
        what = f"silent data corruption at step {v['step']}: {', '.join(v['params'][:3])} differ(s) between replicas"
        what += f"; off the majority: {who}" if v["decided"] else f"; no majority, one of {who}"
    elif v["event"] == "straggler":
        what = f"straggler: rank {v['rank']} on {v['host']} computes {v['ratio']}x slower than the median rank"
    else:
        what = v["event"]
    return f"warning: {what}; {done.get(v.get('action', ''), v.get('action', ''))}" + (
        f" ({v['reason']})" if v.get("reason") else ""
    )


class HealthKeeper:
    """One per rank: ``before_step`` / ``after_step`` around every step. It detects and reports;
    what to do about a rollback is the trainer's (it holds the checkpoints and the state)."""

    def __init__(
        self,
        plan: RunPlan,
        mesh: Mesh,
        *,
        runner: Any,
        model: nn.Module,
        called: list[nn.Module],
        event: Callable[..., None],
        say: Callable[[str], None],
        hooks: RunHooks,
        samples: Callable[[int], list[int]],
        across: Across | None = None,
    ):
        """``runner``: the step runner (its guard slot and loss reduction); ``model``: this rank's
        parameters (the non-finite diagnosis names one); ``called``: the modules
        a forward calls (under pp the stages' parts); ``event``, ``say``: the run log's;
        ``samples(lag)``: the sample indices of the batch ``lag`` steps before the last one;
        ``across``: the other replica groups' parameter fingerprints (fault tolerance)."""
        self.mesh, self.runner, self.called, self.samples = mesh, runner, called, samples
        self.event, self.say = event, say
        self.run_dir, h = Path(plan.run.dir), plan.health
        self.guard = StepGuard(h, model, mesh.rank, mesh.distributed, runner.reduce_loss, hooks)
        self.watchdog = None
        if mesh.distributed and h.hang_timeout_s > 0:
            axes = {g.group_name: axis for g, axis in mesh.groups_by_axis().items()}
            self.watchdog = HangWatchdog(h.hang_timeout_s, mesh.rank, mesh.world_size, axes, self.run_dir)
            self.watchdog.start()
        self.stragglers = None
        if mesh.distributed and h.straggler_factor > 0 and launch_env.oversubscribed(mesh.device.type):
            self.event("warning", key="health.straggler_factor", message=OVERSUBSCRIBED.format(launch_env.cpu_cores()))
        elif mesh.distributed and h.straggler_factor > 0:
            self.stragglers = StragglerCheck(h.straggler_factor, mesh.rank, mesh.world_size, mesh.device)
        group = replica_group(mesh, plan.layout, plan.fsdp)
        self.sdc = SdcCheck(model, h.sdc_interval, group, mesh.distributed, mesh.rank, across, h.on_sdc == "log")
        self.on_sdc = h.on_sdc
        self.redo = False  # the rollback asked for redoes the steps since (sdc), rather than skipping their batches
        self.logged, self.compute_s, self._t0 = False, 0.0, 0.0
        self.first_logged = 1 if plan.metrics.log_interval == 1 else 2  # step 1 is warm-up unless it is all
        self.hooks: list[Any] = []
        self.pause(False)
        if mesh.is_main and plan.data.tokenizer == "byte":
            self._warn_if_not_text(plan.data.path, h.text_warn_fraction)

    def pause(self, paused: bool) -> None:
        """Take the per-step checks out (guard, forward timing) or put them back; for the
        overhead benchmark, which compares both in one run."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.runner.guard = None if paused else self.guard
        if not paused:
            for m in self.called:
                self.hooks.append(m.register_forward_pre_hook(self._forward_starts))
                self.hooks.append(m.register_forward_hook(self._forward_ends))

    def _forward_starts(self, *_: Any) -> None:
        if self.logged and self.mesh.device.type == "cuda":
            torch.cuda.synchronize(self.mesh.device)
        self._t0 = time.perf_counter()

    def _forward_ends(self, *_: Any) -> None:
        if self.logged and self.mesh.device.type == "cuda":
            torch.cuda.synchronize(self.mesh.device)
        self.compute_s += time.perf_counter() - self._t0

    def _warn_if_not_text(self, path: str, threshold: float) -> None:
        bad = not_text_files(path, threshold)
        if bad:
            f, share = bad[0]
            more = f" and {len(bad) - 1} more file(s)" if len(bad) > 1 else ""
            self.event("data_not_text", files={str(p): round(s, 4) for p, s in bad[:20]}, threshold=threshold)
            self.say(
                f"warning: data.path {f}{more} does not look like text: {share:.0%} of its bytes are not valid "
                "UTF-8, yet the byte tokenizer trains on them; check data.path"
            )

    def close(self) -> None:
        """The loop is over: later phases (final evaluation, export) are not watched."""
        if self.watchdog:
            self.watchdog.stop()

    def before_step(self, n: int, logged: bool) -> None:
        """Step ``n`` (1-based) is about to run; ``logged``: it will be measured and logged."""
        self.guard.step = n
        self.logged, self.compute_s = logged, 0.0
        if self.watchdog:
            self.watchdog.beat(n)

    def after_step(self, n: int) -> bool:
        """Report and act on the guard's verdict for step ``n``; True when it asks to go back to
        the last checkpoint (the trainer rolls back; HealthStop when it asks to stop)."""
        if self.stragglers and self.logged and n >= self.first_logged:
            for found in self.stragglers.check(self.compute_s, n):
                self.report({"event": "straggler", "action": "log", **found})
        late, self.guard.late = self.guard.late, []
        for v in late:  # logged spikes of earlier steps, judged now: their batches are further back
            self.report(self._with_samples(v))
        v, self.guard.verdict = self.guard.verdict, None
        sdc = self.sdc.check(n) if self.sdc.due(n) else None
        self.redo = v is None and sdc is not None
        if v is None and sdc is not None:
            v = {**sdc, "action": self.on_sdc}
        if v is None:
            return False
        self.report(self._with_samples(v) if v["event"] == "loss_spike" else v)
        if v["action"] == "stop":
            raise HealthStop(describe(v).removeprefix("warning: ") + f"; see {self.run_dir / 'events.jsonl'}")
        return v["action"] == "rollback"

    def _with_samples(self, v: dict[str, Any]) -> dict[str, Any]:
        """A spike's event names its batch's sample indices (``lag`` steps before the current one)."""
        return {**v, "samples": self.samples(v.pop("lag", 0))}

    def report(self, v: dict[str, Any]) -> None:
        self.event(v["event"], **{k: x for k, x in v.items() if k != "event"})
        self.say(describe(v))
